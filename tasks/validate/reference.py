"""The reference step a plan must reproduce, measured once per model x batch size x device x seed.

`measure_reference` builds the model from `seed`, runs one reference step under IEEE fp32
(`runtime.measure.exact.exact_fp32`, as validation runs the plan's first step) and keeps its loss, gradients and
buffers, and with an `optimizer` (for plans with the optimizer inside the step) the parameters after that
optimizer's update; it measures the peak of a second step with `runtime.measure.meter.PeakMeter(allocator=True)`
(bytes allocated during the step, not the parameters, buffers and batch that exist before it: the split of
tasks/validate/stage.py) and times `steps` more (median). The reference step is eager PyTorch, or under a device
memory `limit` the first reference step that fits it (tasks/fit/reference.py, recorded as `kind` with
the tolerance it needs; the host's runs on the CPU, where its peak and time are measured). The tensors go
to a safetensors file, written atomically (no pickle); the `Referenced` record points at it and every plan
of the cell is checked against it (`tasks.validate.stage.validate_plans`).

The float64 step: eager's own float32 (or bfloat16, float16) step is not exact either, and how far it is from the
exact step depends on the model's conditioning (BatchNorm over two samples: gradients 1.5% off). So the same step
is run once more in float64 (`float64_step`: a float64 copy of the model and of the batch's floating tensors,
without autocast, the optimizer's update too), with the random ops (dropout's masks) replaying what the reference
step drew (`RandomTape`: the same masks on every device and dtype). Per floating tensor the file also holds the
float64 step's value minus the reference's, in float32, under `float64:<name>`; `tasks.validate.stage.compare_tensors`
judges a plan's distance to the float64 step by eager's own. Where it cannot run (a model or op without float64,
other random ops than the reference's, a device memory limit it does not fit, a reference kind other than eager
or the host's), the record says why (`float64_skipped`) and plans are judged by rtol / atol alone.
"""

from __future__ import annotations

import contextlib
import copy
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves, tree_map

from memplan.runtime.measure.exact import exact_fp32
from memplan.tasks.config import MemplanError, ModelConfig
from memplan.tasks.fit.reference import HOST, LOSS_REDUCTIONS, reference_step, training_step
from memplan.tasks.fit.memory_limit import MemoryLimit
from memplan.tasks.models import build_batch, build_loss, build_model
from memplan.tasks.records import EAGER, Referenced
from memplan.tasks.solve.core.optimizer import OPTIMIZERS

State = dict[str, torch.Tensor | None]
Step = Callable[[], torch.Tensor]


def optimizer_named(name: str, model: nn.Module) -> torch.optim.Optimizer:
    """The torch optimizer `name` (`tasks.solve.core.optimizer.OPTIMIZERS`) over `model`'s parameters, with the
    settings validation uses (lr 0.01 and the model's own arguments, e.g. momentum 0.9)."""
    if name not in OPTIMIZERS:
        raise MemplanError(f"optimizer {name!r} is not one this memplan knows (one of {', '.join(OPTIMIZERS)}); "
                           f"solve the plan again with this memplan.")
    spec = OPTIMIZERS[name]
    return getattr(torch.optim, spec.torch_class)(model.parameters(), lr=0.01, **dict(spec.torch_kwargs))


def step_state(model: nn.Module, loss: torch.Tensor, params: bool = False) -> State:
    """Loss, parameter gradients and buffers after a step, keyed `loss`, `grad:<name>`, `buffer:<name>`, and with
    `params` the parameters, `param:<name>`."""
    state: State = {"loss": loss.detach().clone()}
    if params:
        state |= {f"param:{n}": p.detach().clone() for n, p in model.named_parameters()}
    state |= {f"grad:{n}": None if p.grad is None else p.grad.detach().clone() for n, p in model.named_parameters()}
    state |= {f"buffer:{n}": b.detach().clone() for n, b in model.named_buffers()}
    return state


def first_steps(model: nn.Module, step: Step, device: str, seed: int, params: bool = False,
                update: torch.optim.Optimizer | None = None) -> tuple[State, int]:
    """The state after one step (in IEEE fp32) from the fresh `model` (`step_state`; with `params` the
    parameters after it), and the measured peak of a second step. With `update` (an optimizer over `model`) the
    state also holds the parameters after that optimizer's step from the first step's gradients."""
    from memplan.runtime.measure.meter import PeakMeter

    torch.manual_seed(seed)
    with exact_fp32(device):
        state = step_state(model, step(), params)
        if update is not None:
            update.step()
            state |= {f"param:{n}": p.detach().clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    with PeakMeter(device, allocator=True) as meter:
        step()
    model.zero_grad(set_to_none=True)
    return state, meter.peak_bytes


def measure_reference(spec: ModelConfig, batch_size: int, device: str, seed: int, path: str | Path,
                      steps: int = 3, limit: MemoryLimit | None = None, optimizer: str | None = None,
                      built: tuple[nn.Module, Callable[..., torch.Tensor], tuple] | None = None) -> Referenced:
    """Run the reference step of `spec` at `batch_size` on `device` from `seed`'s weights and batch (see
    module doc): eager PyTorch, or the first step that fits `limit`; with `optimizer`, also that optimizer's
    update. Its tensors, and the float64 step's distance to them (`float64_step`), are written to `path`
    (safetensors). `built`: the model (on `device`, left unchanged), loss and batch to measure instead of building
    them from `spec` (`memplan.plan`'s; its loss runs the float64 step as it is)."""
    if built is None:
        base, loss_fn = build_model(spec, seed).to(device), build_loss(spec)
        batch = build_batch(spec, batch_size, seed, device)
        wide_loss = build_loss(spec.model_copy(update={"autocast": None}))
    else:
        base, loss_fn, batch = built
        wide_loss = loss_fn
    chosen = reference_step(base, loss_fn, batch, device, limit, seed, LOSS_REDUCTIONS.get(spec.loss))
    model, step, ran_on = chosen.model, chosen.step, chosen.device or device
    update = None if optimizer is None else optimizer_named(optimizer, model)
    tape = RandomTape() if chosen.kind in (EAGER, HOST) else None
    state, peak = first_steps(model, step if tape is None else tape.recording(step), ran_on, seed, update=update)
    times = []
    for _ in range(steps):
        times.append(_timed(step, ran_on))
        model.zero_grad(set_to_none=True)
    loss, (kind, rtol, atol) = float(state["loss"]), (chosen.kind, chosen.rtol, chosen.atol)
    del model, step, chosen, update                 # the float64 copy takes their place
    float64, skipped = {}, None
    if tape is None:
        skipped = "the reference runs under the device memory limit in parts or checkpointed; no float64 step"
    else:
        try:
            exact = float64_step(base, wide_loss, batch, ran_on, seed,
                                 tape, optimizer, None if limit is None or ran_on != device else limit)
            check_same_loss(loss, float(exact["loss"]), spec)
            float64 = float64_deltas(state, exact)
        except Float64Unavailable as exc:
            skipped = str(exc)
        except Exception as exc:                # a model or op without float64, or a float64 step that does not fit
            skipped = f"the float64 step raised {type(exc).__name__}: {' '.join(str(exc).split())[:300]}"
    write_state(path, state | {FLOAT64 + k: v for k, v in float64.items()})
    return Referenced(
        kind=kind, optimizer=optimizer, rtol=rtol, atol=atol, path=str(Path(path).resolve()),
        model=spec.name, batch_size=batch_size, device=device,
        device_name=torch.cuda.get_device_name(device) if device.startswith("cuda") else "cpu", seed=seed,
        loss=loss, peak_bytes=int(peak), step_ms=statistics.median(times) if times else 0.0,
        tensors=sum(v is not None for v in state.values()), absent=[k for k, v in state.items() if v is None],
        float64_tensors=len(float64), float64_skipped=skipped,
    )


FLOAT64 = "float64:"
"""The key prefix of the float64 step's distances in a reference's safetensors file (`float64_deltas`)."""


class Float64Unavailable(MemplanError):
    """The float64 step cannot be compared with the reference step (its random ops differ)."""


class RandomTape:
    """The outputs of the random ops (ATen's `nondeterministic_seeded`: dropout's masks, `bernoulli_`, `rand`, ...)
    of one step, in order: `recording(step)` records them on the step's first call (kept on the CPU),
    `replaying()` gives the same values to the same ops of another step in order (dropout's output recomputed
    from the recorded mask in the other step's dtype), and raises `Float64Unavailable` where the ops differ.
    Recording only observes: the recorded step computes as it would without it."""

    def __init__(self) -> None:
        self.outputs: list[tuple[Any, Any]] = []
        self.recorded = False

    def recording(self, step: Step) -> Step:
        def first() -> torch.Tensor:
            if self.recorded:
                return step()
            self.recorded = True
            with _Recorder(self.outputs):
                return step()
        return first

    def replaying(self) -> TorchDispatchMode:
        return _Replayer(self.outputs)


def _random(func: Any) -> bool:
    return torch.Tag.nondeterministic_seeded in func.tags


class _Recorder(TorchDispatchMode):
    def __init__(self, outputs: list) -> None:
        super().__init__()
        self.outputs = outputs

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if _random(func):
            self.outputs.append((func, tree_map(lambda t: t.detach().to("cpu", copy=True)
                                                if isinstance(t, torch.Tensor) else t, out)))
        return out


class _Replayer(TorchDispatchMode):
    def __init__(self, outputs: list) -> None:
        super().__init__()
        self.outputs = iter(outputs)
        self.left = len(outputs)

    def __exit__(self, *exc: Any) -> Any:
        out = super().__exit__(*exc)
        if exc[0] is None and self.left:
            raise Float64Unavailable(f"the float64 step draws fewer random numbers than the reference step ({self.left} "
                                     f"of its random ops not drawn); no float64 step")
        return out

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if not _random(func):
            return out
        recorded_func, recorded = next(self.outputs, (None, None))
        self.left -= 1
        got, want = tree_leaves(out), tree_leaves(recorded)
        if recorded_func != func or [tuple(t.shape) for t in got if isinstance(t, torch.Tensor)] != \
                [tuple(t.shape) for t in want if isinstance(t, torch.Tensor)]:
            raise Float64Unavailable(f"the float64 step draws other random numbers than the reference step ({func} "
                                     f"where the reference step ran {recorded_func}); no float64 step")
        if func is torch.ops.aten.native_dropout.default:            # (input * mask / (1 - p), mask)
            x, p, train = args[0], args[1], args[2] if len(args) > 2 else kwargs.get("train")
            result, mask = out
            mask.copy_(want[1])
            if train is not False and p != 0:
                result.copy_(torch.where(mask, x * (1.0 / (1.0 - p) if p < 1 else 0.0), 0))
            return out
        for tensor, value in zip(got, want):
            if isinstance(tensor, torch.Tensor):
                tensor.copy_(value)
        return out


def float64_step(base: nn.Module, loss_fn: Callable[..., torch.Tensor], batch: tuple[torch.Tensor, ...], device: str,
                 seed: int, tape: RandomTape, optimizer: str | None = None, limit: MemoryLimit | None = None) -> State:
    """The state after one eager step (`step_state`, with `optimizer` the parameters after its update) of a float64
    copy of `base` (its floating parameters and buffers; integer buffers stay as they are) on `device`, on the
    batch with its floating tensors in float64, with `loss_fn` (to run without autocast) and the random ops
    replaying `tape`. Under `limit` it is metered against it (`DeviceMemoryExceeded` where it does not fit)."""
    from memplan.runtime.measure.meter import PeakMeter

    model = copy.deepcopy(base).to(device=device, dtype=torch.float64)
    wide = tuple(t.to(device=device, dtype=torch.float64) if t.is_floating_point() else t.to(device) for t in batch)
    update = None if optimizer is None else optimizer_named(optimizer, model)
    step = training_step(model, loss_fn, wide)
    torch.manual_seed(seed)
    meter = contextlib.nullcontext() if limit is None else PeakMeter(
        device, limit_bytes=limit.limit_bytes, resident_bytes=limit.module_resident_bytes(model, wide))
    with exact_fp32(device), meter, tape.replaying():
        state = step_state(model, step())
        if update is not None:
            update.step()
            state |= {f"param:{n}": p.detach().clone() for n, p in model.named_parameters()}
    return state


LOSS_AGREEMENT = 1e-3
"""How far (relative) eager's loss may lie from the float64 step's for the two to be one computation; a model
computing in bfloat16 or float16 gets `LOW_PRECISION_LOSS_AGREEMENT` (a few roundings of 8 or 11 mantissa bits)."""
LOW_PRECISION_LOSS_AGREEMENT = 5e-2


def check_same_loss(eager: float, exact: float, spec: ModelConfig) -> None:
    """Refuse (`Float64Unavailable`) a float64 step whose loss is not eager's up to rounding: a loss that changes
    between calls, or a step that is not the same computation, would give eager a distance to it that excuses
    anything, so plans are then judged by rtol / atol alone."""
    low = {spec.dtype, spec.autocast} & {"bfloat16", "float16"}
    agreement = LOW_PRECISION_LOSS_AGREEMENT if low else LOSS_AGREEMENT
    if not abs(eager - exact) <= agreement * max(abs(exact), 1e-6):
        raise Float64Unavailable(f"the float64 step's loss {exact:.6g} is not eager's {eager:.6g} up to rounding "
                                 f"(relative {agreement:g}): the step is not one computation (a loss that changes "
                                 f"between calls?); plans are judged by rtol / atol alone")


def float64_deltas(state: State, exact: State) -> State:
    """Per floating tensor of `state` that `exact` (the float64 step's) also holds with its shape: `exact - state`
    in float32, eager's own distance to the float64 step (what `tasks.validate.stage.compare_tensors` scales)."""
    deltas = {}
    for name, tensor in state.items():
        wide = exact.get(name)
        if tensor is None or wide is None or not tensor.is_floating_point() or wide.shape != tensor.shape:
            continue
        deltas[name] = (wide.to(tensor.device, torch.float64) - tensor.double()).float()
    return deltas


def _timed(step: Step, device: str) -> float:
    """Wall time (ms, CUDA synchronised) of one step."""
    cuda = device.startswith("cuda")
    if cuda:
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    step()
    if cuda:
        torch.cuda.synchronize(device)
    return (time.perf_counter() - start) * 1000


def write_state(path: str | Path, state: State) -> Path:
    """Write the tensors of `state` to the safetensors file `path` atomically (a temporary file in the same
    folder, then `os.replace`); absent (None) entries are not stored."""
    from safetensors.torch import save_file

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        save_file({k: v.detach().cpu().contiguous() for k, v in state.items() if v is not None}, tmp)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def reference_state(reference: Referenced, device: str) -> State:
    """The reference's loss, gradients and buffers on `device`, absent gradients as None."""
    tensors = _read(reference, device, lambda key: not key.startswith(FLOAT64))
    state = {**tensors, **dict.fromkeys(reference.absent)}
    return {name: state[name] for name in sorted(state, key=lambda n: (_ORDER.index(n.split(":")[0]), n))}


def reference_float64(reference: Referenced, device: str) -> State | None:
    """Per floating tensor of the reference, the float64 step's value minus the reference's (float32, on `device`;
    `float64_deltas`), or None where the reference has none (measured without a float64 step, or before it
    existed: plans are then judged by rtol / atol alone)."""
    if not reference.float64_tensors:
        return None
    deltas = _read(reference, device, lambda key: key.startswith(FLOAT64))
    return {key.removeprefix(FLOAT64): tensor for key, tensor in deltas.items()} or None


def _read(reference: Referenced, device: str, keep: Callable[[str], bool]) -> dict[str, torch.Tensor]:
    """The tensors of the reference's safetensors file whose keys `keep` accepts, on `device`."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(reference.path, framework="pt", device=device) as file:
            return {key: file.get_tensor(key) for key in file.keys() if keep(key)}
    except (OSError, SafetensorError) as exc:
        raise MemplanError(
            f"cannot read the reference tensors of {reference.model} at batch {reference.batch_size} from "
            f"{reference.path} ({exc}); re-run with `memplan run --refresh` to measure the reference again."
        ) from None


_ORDER = ("loss", "param", "grad", "buffer")
"""The order in which a state's mismatches are reported: the loss, parameters, gradients, then buffers."""
