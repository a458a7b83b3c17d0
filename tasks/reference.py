"""The reference step a plan must reproduce, measured once per model x batch size x device x seed.

`measure_reference` builds the model from `seed`, runs one reference step under IEEE fp32
(`runtime.exact.exact_fp32`, as validation runs the plan's first step) and keeps its loss, gradients and
buffers, and with an `optimizer` (for plans with the optimizer inside the step) the parameters after that
optimizer's update; it measures the peak of a second step with `runtime.meter.PeakMeter(allocator=True)`
(bytes allocated during the step, not the parameters, buffers and batch that exist before it: the split of
tasks/validate.py) and times `steps` more (median). The reference step is eager PyTorch, or under a device
memory `limit` the first reference step that fits it (tasks/fitting_reference.py, recorded as `kind` with
the tolerance it needs; the host's runs on the CPU, where its peak and time are measured). The tensors go
to a safetensors file, written atomically (no pickle); the `Referenced` record points at it and every plan
of the cell is checked against it (`tasks.validate.validate_plans`).
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Callable

import torch
from torch import nn

from memplan.runtime.exact import exact_fp32
from memplan.tasks.config import MemplanError, ModelConfig
from memplan.tasks.fitting_reference import LOSS_REDUCTIONS, reference_step
from memplan.tasks.memory_limit import MemoryLimit
from memplan.tasks.models import build_batch, build_loss, build_model
from memplan.tasks.records import Referenced
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
    from memplan.runtime.meter import PeakMeter

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
                      steps: int = 3, limit: MemoryLimit | None = None, optimizer: str | None = None) -> Referenced:
    """Run the reference step of `spec` at `batch_size` on `device` from `seed`'s weights and batch (see
    module doc): eager PyTorch, or the first step that fits `limit`; with `optimizer`, also that optimizer's
    update. Its tensors are written to `path` (safetensors)."""
    base = build_model(spec, seed).to(device)
    chosen = reference_step(base, build_loss(spec), build_batch(spec, batch_size, seed, device), device, limit,
                            seed, LOSS_REDUCTIONS.get(spec.loss))
    model, step, ran_on = chosen.model, chosen.step, chosen.device or device
    update = None if optimizer is None else optimizer_named(optimizer, model)
    state, peak = first_steps(model, step, ran_on, seed, update=update)
    times = []
    for _ in range(steps):
        times.append(_timed(step, ran_on))
        model.zero_grad(set_to_none=True)
    write_state(path, state)
    return Referenced(
        kind=chosen.kind, optimizer=optimizer, rtol=chosen.rtol, atol=chosen.atol, path=str(Path(path).resolve()),
        model=spec.name, batch_size=batch_size, device=device,
        device_name=torch.cuda.get_device_name(device) if device.startswith("cuda") else "cpu", seed=seed,
        loss=float(state["loss"]), peak_bytes=int(peak), step_ms=statistics.median(times) if times else 0.0,
        tensors=sum(v is not None for v in state.values()), absent=[k for k, v in state.items() if v is None],
    )


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
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        tensors = load_file(reference.path, device=device)
    except (OSError, SafetensorError) as exc:
        raise MemplanError(
            f"cannot read the reference tensors of {reference.model} at batch {reference.batch_size} from "
            f"{reference.path} ({exc}); re-run with `memplan run --refresh` to measure the reference again."
        ) from None
    state = {**tensors, **dict.fromkeys(reference.absent)}
    return {name: state[name] for name in sorted(state, key=lambda n: (_ORDER.index(n.split(":")[0]), n))}


_ORDER = ("loss", "param", "grad", "buffer")
"""The order in which a state's mismatches are reported: the loss, parameters, gradients, then buffers."""
