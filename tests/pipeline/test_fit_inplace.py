"""`memplan fit`'s references on models that compute in place (issue #53, item 5).

MobileNetV3's classifier (`Linear, Hardswish(inplace=True), Dropout(inplace=True), Linear`) is a
`nn.Sequential`, so per-block checkpointing wrapped each of its children: the in-place Hardswish and Dropout,
recomputed in the backward, ran again on the tensor they had already changed, under the tensors autograd saved
("output 0 of Mul is at version 2; expected version 1"), and `memplan fit` ended in a traceback after its
whole search. Modules that compute in place are now left out of checkpointing (they run once, as in eager);
one that changes its input without saying so, and any step that fails otherwise than for memory, is named in
the reference's one-paragraph message.
"""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import memplan.tasks.fit.reference as fitting
from memplan.runtime.measure.meter import DeviceMemoryExceeded
from memplan.tasks.config import MemplanError
from memplan.tasks.fit.reference import (EAGER, MICRO_BATCH_ATOL, MICRO_BATCH_RTOL, NESTED_CHECKPOINT,
                                             PER_BLOCK_CHECKPOINT, NoFittingReference, ReferenceFailed,
                                             checkpoint_nested, rebuilt_step, reference_step, training_step)
from memplan.tasks.fit.memory_limit import MemoryLimit


def cross_entropy(model, x, y):
    return F.cross_entropy(model(x), y)


def in_place_model(dropout: float) -> nn.Module:
    """Blocks ending in in-place activations, and a classifier like MobileNetV3's whose children include the
    in-place Hardswish and Dropout."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Sequential(nn.Linear(8, 16), nn.ReLU(inplace=True)),
        nn.Sequential(nn.Linear(16, 16), nn.Hardswish(inplace=True), nn.Linear(16, 16), nn.ReLU(inplace=True)),
        nn.Linear(16, 32), nn.Hardswish(inplace=True), nn.Dropout(p=dropout, inplace=True), nn.Linear(32, 4))


def batch(rows: int = 8):
    generator = torch.Generator().manual_seed(1)
    return torch.randn(rows, 8, generator=generator), torch.randint(0, 4, (rows,), generator=generator)


def gradients(model, step, seed=3):
    torch.manual_seed(seed)                    # the same dropout masks in every step
    loss = step()
    return loss, {name: p.grad.clone() for name, p in model.named_parameters()}


@pytest.mark.parametrize("kind, dropout", [(PER_BLOCK_CHECKPOINT, 0.2), (NESTED_CHECKPOINT, 0.2),
                                           ("2 micro-batches (per-block checkpoint)", 0.0),
                                           ("4 micro-batches (per-block checkpoint)", 0.0)])
def test_each_reference_kind_gives_eager_gradients_on_in_place_modules(kind, dropout):
    model, data = in_place_model(dropout), batch()
    eager = copy.deepcopy(model)
    eager_loss, eager_grads = gradients(eager, training_step(eager, cross_entropy, data))
    reference = rebuilt_step(kind, model, cross_entropy, data, reduction="mean")
    loss, grads = gradients(reference.model, reference.step)
    if reference.rtol == 0 and reference.atol == 0:          # checkpointing: eager's step bit for bit
        assert torch.equal(loss, eager_loss)
        for name, grad in eager_grads.items():
            assert torch.equal(grads[name], grad), name
    else:                                                    # micro-batches: summed in another order
        assert torch.allclose(loss, eager_loss, rtol=MICRO_BATCH_RTOL, atol=MICRO_BATCH_ATOL)
        for name, grad in eager_grads.items():
            assert torch.allclose(grads[name], grad, rtol=MICRO_BATCH_RTOL, atol=MICRO_BATCH_ATOL), name


def test_mobilenet_v3_references_survive_its_in_place_classifier():
    torchvision = pytest.importorskip("torchvision")
    torch.manual_seed(0)
    model = torchvision.models.mobilenet_v3_small(num_classes=10)
    data = (torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(1)), torch.tensor([1, 7]))
    eager = copy.deepcopy(model)
    _, eager_grads = gradients(eager, training_step(eager, cross_entropy, data))
    for kind in (PER_BLOCK_CHECKPOINT, NESTED_CHECKPOINT):
        reference = rebuilt_step(kind, model, cross_entropy, data, reduction="mean")
        _, grads = gradients(reference.model, reference.step)
        for name, grad in eager_grads.items():
            assert torch.equal(grads[name], grad), (kind, name)


class Doubles(nn.Module):
    """Changes its input in place without an `inplace` attribute to say so."""

    def forward(self, x):
        return x.mul_(2)


def hidden_in_place_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), Doubles(), nn.Tanh(), nn.Linear(16, 4))


class RefusesEager:
    """A meter whose limit only eager's step misses (the first trial), as a device's would."""

    calls = 0

    def __init__(self, *args, **kwargs):
        pass

    def __enter__(self):
        RefusesEager.calls += 1
        if RefusesEager.calls == 1:
            raise DeviceMemoryExceeded("the step would exceed the device memory limit by 1 B; refused")

    def __exit__(self, *exc):
        return False


def test_a_checkpointed_module_that_changes_its_input_is_named_not_recomputed_wrongly():
    model = hidden_in_place_model()
    checkpoint_nested(model)
    with pytest.raises(ReferenceFailed, match=r"module '1' \(Doubles\) changes its input in place"):
        training_step(model, cross_entropy, batch())()


def test_failing_references_give_one_clear_paragraph(monkeypatch):
    monkeypatch.setattr(fitting, "PeakMeter", RefusesEager)
    RefusesEager.calls = 0
    limit = MemoryLimit(limit_bytes=1, host_reference=False)
    with pytest.raises(NoFittingReference) as caught:
        reference_step(hidden_in_place_model(), cross_entropy, batch(), "cpu", limit, 0, reduction=None)
    message = str(caught.value)
    assert "\n" not in message and "Traceback" not in message
    assert f"{EAGER}: the step would exceed" in message
    assert f"{PER_BLOCK_CHECKPOINT}: module '1' (Doubles) changes its input in place" in message
    assert f"{NESTED_CHECKPOINT}: module '1' (Doubles) changes its input in place" in message
    assert "another reason than memory" in message and "raise device_memory" in message

    def broken(*args, **kwargs):                             # a step that raises for another reason than memory
        raise RuntimeError("one of the variables needed for gradient computation has been modified by an "
                           "inplace operation:\n  is at version 2; expected version 1 instead.")

    monkeypatch.setattr(fitting, "checkpoint", broken)
    RefusesEager.calls = 0
    with pytest.raises(NoFittingReference) as caught:
        reference_step(in_place_model(0.2), cross_entropy, batch(), "cpu", limit, 0, reduction=None)
    message = str(caught.value)
    assert "\n" not in message
    assert (f"{PER_BLOCK_CHECKPOINT}: raised RuntimeError: one of the variables needed for gradient computation has "
            f"been modified by an inplace operation: is at version 2; expected version 1 instead.") in message


def test_a_reference_that_only_fails_is_a_reference_failure_and_fit_reports_it(monkeypatch):
    """No candidate missed for memory: `ReferenceFailed`, which `memplan fit` reports as its answer's `why_not`
    (flows/fit.py catches `NoFittingReference`) and the CLI as one paragraph (a `MemplanError`)."""
    class Fits:
        def __init__(self, *args, **kwargs):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

    monkeypatch.setattr(fitting, "PeakMeter", Fits)

    def broken_model() -> nn.Module:
        class Raises(nn.Module):
            def forward(self, x):
                raise ValueError("no such shape")
        return nn.Sequential(nn.Linear(8, 4), Raises())

    with pytest.raises(ReferenceFailed, match=r"^the eager reference step of Sequential raised ValueError: no such "
                                              r"shape \(not for memory\)"):
        reference_step(broken_model(), cross_entropy, batch(), "cpu", MemoryLimit(limit_bytes=1), 0, "mean")
    assert issubclass(ReferenceFailed, NoFittingReference) and issubclass(ReferenceFailed, MemplanError)
