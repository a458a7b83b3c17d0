"""Validation judges a plan, not the capture's rounding (issue #53, item 2): the reference also runs its step in
float64, and a plan's tensor outside rtol / atol is accepted when its distance to the float64 step is within
`FLOAT64_FACTOR` x eager's own (tasks/validate/stage.py, `float64_problem`). A step that rounds otherwise passes; a
gradient a few percent off, or missing a term, does not; where there is no float64 step, rtol / atol alone judge."""

from __future__ import annotations

import copy
import sys
import types

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from memplan.tasks.config import ModelConfig, ValidateConfig
from memplan.tasks.records import Referenced
from memplan.tasks.validate.reference import RandomTape, float64_deltas, float64_step, step_state
from memplan.tasks.validate.stage import FLOAT64_FACTOR, compare_tensors

RTOL, ATOL = 1e-4, 1e-5
BF16_RTOL = 1.6e-2


class DecomposedBatchNorm2d(nn.BatchNorm2d):
    """BatchNorm written out as the captured graph decomposes it: the same step, rounded otherwise."""

    def forward(self, x):
        mean = x.mean((0, 2, 3), keepdim=True)
        var = (x - mean).pow(2).mean((0, 2, 3), keepdim=True)
        with torch.no_grad():
            n = x.numel() / x.shape[1]
            self.running_mean.mul_(1 - self.momentum).add_(self.momentum * mean.flatten())
            self.running_var.mul_(1 - self.momentum).add_(self.momentum * var.flatten() * n / (n - 1))
            self.num_batches_tracked.add_(1)
        return (x - mean) * torch.rsqrt(var + self.eps) * self.weight[:, None, None] + self.bias[:, None, None]


def resnet(decomposed: bool = False, detach_shortcut: bool = False) -> nn.Module:
    """torchvision's resnet18 with 4 classes (BatchNorm over two 1x1 samples in its last stage at 32x32)."""
    import torchvision

    torch.manual_seed(0)
    model = torchvision.models.resnet18(num_classes=4)
    for module in model.modules():
        if decomposed and isinstance(module, nn.BatchNorm2d):
            module.__class__ = DecomposedBatchNorm2d
    if detach_shortcut:                        # a dropped term: layer1.1's identity passes no gradient
        block = model.layer1[1]
        forward = block.forward

        def without_shortcut(x):
            return forward(x) - x + x.detach()
        block.forward = without_shortcut
    return model


def ce(model, x, y):
    return F.cross_entropy(model(x), y)


def eager_state(model: nn.Module, batch: tuple, tape: RandomTape | None = None) -> dict:
    """The state after one eager step (`step_state`), from seed 0, its random ops recorded on `tape`."""
    torch.manual_seed(0)
    step = lambda: _step(model, batch)                                   # noqa: E731
    return step_state(model, (step if tape is None else tape.recording(step))())


def _step(model, batch):
    loss = ce(model, *batch)
    loss.backward()
    return loss


@pytest.fixture(scope="module")
def resnet_steps():
    """Eager's float32 step of resnet18 at batch 2 on 32x32 images, the float64 step's distance to it, and a step
    that rounds otherwise (BatchNorm decomposed)."""
    torch.set_num_threads(1)
    generator = torch.Generator().manual_seed(0)
    batch = (torch.randn(2, 3, 32, 32, generator=generator), torch.tensor([1, 3]))
    eager = eager_state(resnet(), batch)
    exact = float64_step(resnet(), ce, batch, "cpu", 0, RandomTape())
    return eager, float64_deltas(eager, exact), eager_state(resnet(decomposed=True), batch), batch


def test_a_step_that_rounds_otherwise_is_accepted_by_eager_own_distance_to_float64(resnet_steps):
    eager, float64, rounded, _ = resnet_steps
    problems, _, compared = compare_tensors(eager, rounded, RTOL, ATOL)
    assert len(problems) > 30 and any(p.startswith("grad:conv1.weight differs from eager") for p in problems)
    assert compare_tensors(eager, rounded, RTOL, ATOL, float64=float64) == ([], pytest.approx(
        compare_tensors(eager, rounded, RTOL, ATOL)[1]), compared)
    # eager's own float32 gradients are far from float64's here (BatchNorm over two samples is ill-conditioned)
    conv = float(float64["grad:conv1.weight"].abs().max())
    assert conv > 1e-2 * float(eager["grad:conv1.weight"].abs().max())
    assert "buffer:bn1.num_batches_tracked" not in float64          # integer buffers: compared exactly


@pytest.mark.parametrize("name", ["loss", "grad:fc.bias"])
def test_a_tensor_a_few_percent_off_is_refused_naming_both_distances(resnet_steps, name):
    eager, float64, rounded, _ = resnet_steps
    wrong = dict(rounded, **{name: rounded[name] * 1.05})
    own = float(float64[name].abs().max())
    assert 0.05 * float(eager[name].abs().max()) > 2 * FLOAT64_FACTOR * own   # eager itself is closer than that
    problems, _, _ = compare_tensors(eager, wrong, RTOL, ATOL, float64=float64)
    assert len(problems) == 1 and problems[0].startswith(f"{name} differs from eager by up to ")
    assert "from the float64 step by up to" in problems[0] and f"more than 4 x eager's own {own:.3g}" in problems[0]


def test_a_plan_missing_a_gradient_term_is_refused(resnet_steps):
    eager, float64, _, batch = resnet_steps
    dropped = eager_state(resnet(decomposed=True, detach_shortcut=True), batch)
    problems, _, _ = compare_tensors(eager, dropped, RTOL, ATOL, float64=float64)
    refused = {p.split()[0] for p in problems}
    assert {"grad:conv1.weight", "grad:bn1.weight", "grad:layer1.0.conv1.weight"} <= refused
    assert "grad:fc.weight" not in refused and "loss" not in refused        # after the shortcut: unchanged
    assert all("from the float64 step" in p for p in problems)


def test_without_a_float64_distance_the_rtol_atol_verdict_and_message_stand(resnet_steps):
    eager, float64, rounded, _ = resnet_steps
    partial = {k: v for k, v in float64.items() if k != "grad:conv1.weight"}
    problems, _, _ = compare_tensors(eager, rounded, RTOL, ATOL, float64=partial)
    assert [p.split()[0] for p in problems] == ["grad:conv1.weight"]
    assert problems == [p for p in compare_tensors(eager, rounded, RTOL, ATOL)[0] if p.startswith("grad:conv1.")]


def test_a_plan_inside_rtol_atol_passes_whatever_float64_says():
    want = {"grad:w": torch.tensor([1.0, 2.0])}
    assert compare_tensors(want, {"grad:w": want["grad:w"] + 1e-6}, RTOL, ATOL,
                           float64={"grad:w": torch.zeros(2)})[0] == []


# -- bfloat16 --------------------------------------------------------------------------------------------------

def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.LayerNorm(64), nn.GELU(), nn.Linear(64, 64), nn.GELU(),
                         nn.Linear(64, 10)).to(torch.bfloat16)


def test_a_bfloat16_plan_within_one_rounding_passes_and_one_off_by_a_quarter_does_not():
    """The plan sums the batch in another order (the batch reversed): bfloat16 rounds the small gradients by more
    than rtol / atol allow, but not farther from float64 than eager's own bfloat16 step."""
    generator = torch.Generator().manual_seed(0)
    x, y = torch.randn(16, 32, generator=generator).to(torch.bfloat16), torch.randint(0, 10, (16,), generator=generator)
    eager = eager_state(mlp(), (x, y))
    reordered = eager_state(mlp(), (x.flip(0), y.flip(0)))
    exact = float64_step(mlp(), ce, (x, y), "cpu", 0, RandomTape())
    float64 = float64_deltas(eager, exact)
    assert {v.dtype for v in float64.values()} == {torch.float32} and set(float64) == set(eager)
    assert compare_tensors(eager, reordered, BF16_RTOL, ATOL)[0] != []          # rtol / atol alone refuse it
    assert compare_tensors(eager, reordered, BF16_RTOL, ATOL, float64=float64)[0] == []
    wrong = dict(reordered, **{"grad:3.weight": reordered["grad:3.weight"] * 1.25})
    problems, _, _ = compare_tensors(eager, wrong, BF16_RTOL, ATOL, float64=float64)
    assert [p.split()[0] for p in problems] == ["grad:3.weight"]


# -- through measure_reference and validate_plan ----------------------------------------------------------------

class Float32Only(nn.Module):
    """Casts its input to float32: no float64 step."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(8, 4)

    def forward(self, x):
        return self.linear(x.to(torch.float32))


class RandomMask(nn.Module):
    """Draws its own mask with `rand_like`, which draws other numbers in float64 than in float32 from one seed."""

    def __init__(self):
        super().__init__()
        self.linear, self.out = nn.Linear(8, 32), nn.Linear(32, 4)

    def forward(self, x):
        h = torch.tanh(self.linear(x))
        return self.out(h * (torch.rand_like(h) > 0.5) * 2)


class DtypeRandom(RandomMask):
    """Draws random numbers in float32 only: the float64 step's random ops are not the reference step's."""

    def forward(self, x):
        h = torch.tanh(self.linear(x))
        return self.out(h * (torch.rand_like(h) > 0.5) * 2 if h.dtype == torch.float32 else h)


@pytest.fixture(scope="module")
def specs():
    module = types.ModuleType("tests_fp64_tolerance_models")
    module.float32_only, module.random_mask, module.dtype_random = Float32Only, RandomMask, DtypeRandom
    sys.modules[module.__name__] = module

    def spec(name):
        return ModelConfig(name=name, factory=f"{module.__name__}:{name}", loss="mse",
                           inputs=[{"shape": [8]}, {"shape": [4]}])
    yield spec
    del sys.modules[module.__name__]


def _reference(spec, tmp_path):
    from memplan.tasks.validate.reference import measure_reference

    return measure_reference(spec, 8, "cpu", 0, tmp_path / f"{spec.name}.safetensors", steps=1)


def test_a_model_without_float64_falls_back_to_rtol_atol_and_says_why(specs, tmp_path):
    from safetensors import safe_open

    from memplan import runtime
    from memplan.runtime.format.plan import default_plan
    from memplan.tasks.models import build_batch, build_loss, build_model
    from memplan.tasks.validate.reference import reference_float64
    from memplan.tasks.validate.stage import validate_plan

    spec = specs("float32_only")
    reference = _reference(spec, tmp_path)
    assert reference.float64_tensors == 0 and reference.float64_skipped.startswith("the float64 step raised RuntimeError")
    assert reference_float64(reference, "cpu") is None
    with safe_open(reference.path, "pt") as f:
        assert not any(k.startswith("float64:") for k in f.keys())
    graph = runtime.capture(build_model(spec, 0), build_loss(spec), build_batch(spec, 8, 0, "cpu"))
    plan = default_plan(graph)
    plan.provenance["budget_bytes"] = 10**9
    validated = validate_plan(plan, spec, 8, "cpu", 0, ValidateConfig(steps=1, max_steps=1, warmup=0), reference,
                              graph)
    assert validated.passed and validated.float64_tensors == 0


def test_random_ops_replay_the_reference_steps_draws_in_float64(specs, tmp_path):
    from memplan.tasks.validate.reference import reference_float64

    reference = _reference(specs("random_mask"), tmp_path)
    assert reference.float64_skipped is None and reference.float64_tensors == 5
    deltas = reference_float64(reference, "cpu")
    assert all(float(d.abs().max()) < 1e-5 for d in deltas.values())      # the same masks: rounding apart
    other = _reference(specs("dtype_random"), tmp_path)
    assert other.float64_tensors == 0 and "draws fewer random numbers" in other.float64_skipped


def test_a_reference_record_from_before_the_float64_step_still_loads(tmp_path):
    record = dict(kind="eager", path=str(tmp_path / "r.safetensors"), model="m", batch_size=2, device="cpu",
                  device_name="cpu", seed=0, loss=1.0, peak_bytes=1, step_ms=1.0, tensors=1, absent=[])
    loaded = Referenced.from_json(record)
    assert loaded.float64_tensors == 0 and loaded.float64_skipped is None


def test_dropout_masks_match_between_the_reference_and_its_float64_step():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 64), nn.Dropout(0.5), nn.Linear(64, 4))
    batch = (torch.randn(4, 8), torch.randint(0, 4, (4,)))
    tape = RandomTape()
    state = eager_state(copy.deepcopy(model), batch, tape)
    assert len(tape.outputs) == 1                                         # dropout's one draw
    exact = float64_step(model, ce, batch, "cpu", 0, tape)
    assert all(float(d.abs().max()) < 1e-5 for d in float64_deltas(state, exact).values())


def test_a_float64_step_whose_loss_is_not_eager_s_is_not_a_yardstick():
    """A loss that changes between calls would give eager a distance to the float64 step that excuses any plan:
    such a float64 step is discarded (plans are then judged by rtol / atol alone)."""
    from memplan.tasks.config import ModelConfig
    from memplan.tasks.validate.reference import Float64Unavailable, check_same_loss

    spec = ModelConfig.model_validate({"name": "m", "factory": "torch.nn:Linear", "loss": "mse",
                                       "kwargs": {"in_features": 2, "out_features": 2},
                                       "inputs": [{"shape": [2]}, {"shape": [2]}]})
    check_same_loss(1.0000001, 1.0, spec)                                       # one rounding apart: one computation
    with pytest.raises(Float64Unavailable, match="not eager's .* up to rounding"):
        check_same_loss(2.0, 1.0, spec)                                         # the drifting loss's second call
    check_same_loss(1.01, 1.0, spec.model_copy(update={"dtype": "bfloat16"}))  # bf16 rounds coarser
