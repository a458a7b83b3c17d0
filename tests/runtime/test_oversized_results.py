"""Kernels that return a result in a storage larger than the result (on CPU, `mse_loss` and `smooth_l1_loss`
reduce into the storage of their unreduced loss): the plan's memory model counts the result's own bytes, and
the executor holds no more, so the measured peak still equals the simulated one and the step equals eager."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from memplan import runtime


@pytest.mark.parametrize("loss", [F.mse_loss, F.smooth_l1_loss], ids=lambda f: f.__name__)
def test_a_loss_reduced_in_its_unreduced_storage_is_held_at_its_own_size(helpers, loss):
    torch.manual_seed(0)
    model, batch = nn.Linear(64, 64).to(helpers.device), (torch.randn(256, 64), torch.randn(256, 64))
    batch = tuple(t.to(helpers.device) for t in batch)

    def loss_fn(m, x, y):
        return loss(m(x), y)

    if helpers.device.type == "cpu":                        # what the executor guards against
        assert loss_fn(model, *batch).untyped_storage().nbytes() == 256 * 64 * 4
    graph = runtime.capture(model, loss_fn, batch)
    plan = runtime.default_plan(graph)
    result = helpers.train_plan(model, loss_fn, batch, plan, graph=graph)
    helpers.assert_same_step(helpers.train_eager(model, loss_fn, batch), result)
    helpers.assert_peak_matches(result.peak, helpers.simulated_peak(graph, plan.schedule))
