"""A policy-form plan's peak under torch.compile, measured: what AOTAutograd's partitioner keeps is the compiler's
choice, which the simulator (eager autograd) does not predict (docs/training.md, "torch.compile");
`tasks.compiled.policy_search` plans with this measurement."""

from __future__ import annotations

import copy
from typing import Any, Callable

import torch
from torch import nn

from memplan.runtime.format.graph import OpGraph
from memplan.runtime.measure.meter import PeakMeter
from memplan.runtime.format.plan import Plan
from memplan.runtime.policy.apply import apply


def compiled_peak(plan: Plan, model: nn.Module, loss_fn: Callable[..., torch.Tensor], batch: tuple, *,
                  graph: OpGraph | None = None, backend: str | Callable[..., Any] = "inductor",
                  optimizer: Callable[[nn.Module], torch.optim.Optimizer] | None = None) -> int:
    """Peak bytes of a training step (`loss_fn(model, *batch).backward()`) of a copy of `model` under `plan`
    (`runtime.apply`, with `optimizer(copy)` inside the step when given: a plan that updates there) and
    `torch.compile(backend=backend)`, the step after the one that compiles, as
    `PeakMeter(allocator=True)` measures it. `model` and the random generators are left as they were. Each call
    compiles a fresh copy, and Dynamo counts every copy's policy as a recompilation of the same code, so it then
    drops torch.compile's caches (`torch.compiler.reset`): functions compiled before recompile at their next call.
    Measure before compiling the model you train; a measurement that would run eager fails instead."""
    replica = copy.deepcopy(model)
    update = None if optimizer is None else optimizer(replica)
    applied = apply(plan, replica, loss_fn, batch, graph=graph, optimizer=update)
    compiled = torch.compile(applied, backend=backend)
    device = next(model.parameters()).device
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), \
            torch._dynamo.config.patch(fail_on_recompile_limit_hit=True):
        try:
            loss_fn(compiled, *batch).backward()
            applied.zero_grad(set_to_none=True)
            with PeakMeter(device, allocator=True) as meter:
                loss_fn(compiled, *batch).backward()
        finally:
            torch.compiler.reset()
    return meter.peak_bytes
