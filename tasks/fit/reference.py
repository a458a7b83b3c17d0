"""The reference a plan is validated against when eager PyTorch does not fit the device memory limit.

Validation compares a plan's step with a reference step from the same weights and batch. Under a
`device_memory` limit (tasks/fit/memory_limit.py) the reference must fit it too, or a device that cannot run
eager could not validate anything. `reference_step` tries, in order, each run under the limit
(`runtime.measure.meter.PeakMeter(limit_bytes=...)`, which raises `DeviceMemoryExceeded` past it):

1. eager: `loss_fn(model, *batch).backward()`;
2. per-block checkpointing: the same step with `torch.utils.checkpoint` (non-reentrant, the RNG state
   preserved) around every repeated block that capture records (`runtime.tracing.modules.marked_modules`: the
   children of `nn.ModuleList` / `nn.Sequential` containers, a transformer's layers, ResNet's blocks), except
   a block that computes in place (`inplace = True`: MobileNetV3's classifier holds Hardswish and Dropout in
   place), which runs once as in eager (`_in_place`). Recomputation re-runs the same kernels on the same
   inputs, so the loss and gradients are eager's bit for bit on deterministic kernels: the validation
   tolerance (`[validate] rtol`, `atol`) stays as it is. Its recomputed forward would update BatchNorm running
   statistics a second time; the buffers are put back to their values after the forward, which are eager's;
3. nested checkpointing: `torch.utils.checkpoint` around every submodule at every depth (each block, and
   within it each child, down to the leaves; not the root, nor a module that computes in place, whose input
   a recomputation would no longer see: `_in_place`), so that a block's recomputation in the backward keeps
   only its children's inputs; the tolerance and the buffers as for per-block checkpointing;
4. micro-batches: the batch split into 2, 4, 8, ... equal parts (the last smaller when they do not divide
   it), each part's step run in turn (per-block checkpointed when the model has blocks), its loss weighted
   by its share of the batch for a mean loss (`reduction = "mean"`: cross_entropy, mse, causal_lm, labels, all
   means over samples or tokens) or left as it is for a sum, the gradients accumulating in `p.grad`. That is the
   full batch's gradient up to floating-point rounding (sums taken in another order), so this reference
   compares with `rtol = max(rtol, MICRO_BATCH_RTOL)` and `atol = max(atol, MICRO_BATCH_ATOL)`. It is not
   offered for a model with BatchNorm (batch statistics of parts are not the batch's), with dropout (the
   parts draw other masks) or for a loss given by import path (its reduction is unknown);
5. the host: eager's step on the host CPU, without the device's limit ("the same step on another device"),
   unless the limit says `host_reference = False` (`[validate] host_reference`). On a CPU device the limit
   models a smaller accelerator and the host is the same CPU with the same kernels: eager's step bit for
   bit, the validation's own tolerance. On a GPU the host runs other kernels, which sum in another order:
   `HOST_RTOL` / `HOST_ATOL` as for micro-batches.

The first that fits is the reference; when none fits, `NoFittingReference` says by how much each missed. A
checkpointed module that changes its input in place without saying so (no `inplace = True`) is found in the
trial step (its input's version counter moved) and a step that raises for another reason than memory is passed
over: both are named in that message (`ReferenceFailed`, a `NoFittingReference`, when none missed for memory),
one paragraph, never a traceback; eager's own step raising is the model's failure (`ReferenceFailed` at once).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Callable, Iterator

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from memplan.runtime.measure.meter import PeakMeter
from memplan.runtime.tracing.modules import marked_modules
from memplan.tasks.config import MemplanError
from memplan.tasks.fit.memory_limit import MemoryLimit
from memplan.tasks.records import EAGER

PER_BLOCK_CHECKPOINT = "per-block checkpoint"
NESTED_CHECKPOINT = "nested checkpoint"
HOST = "host (eager on cpu, no device limit)"
MICRO_BATCH_RTOL = 1e-3
MICRO_BATCH_ATOL = 1e-4
HOST_RTOL, HOST_ATOL = MICRO_BATCH_RTOL, MICRO_BATCH_ATOL
"""The least tolerance of a host reference for a plan on a GPU: the same step, summed in another order."""
LOSS_REDUCTIONS = {"cross_entropy": "mean", "mse": "mean", "causal_lm": "mean", "labels": "mean", "sum": "sum"}
"""How each named loss reduces over the batch (micro-batch references weight their parts by it)."""


class NoFittingReference(MemplanError):
    """No reference step fits the device memory limit."""


@dataclass(frozen=True)
class ReferenceStep:
    """The training step of the reference named `kind`, on its own copy of the model, and the least
    tolerance its comparison needs (0: the validation's own)."""

    kind: str
    model: nn.Module
    step: Callable[[], torch.Tensor]
    rtol: float = 0.0
    atol: float = 0.0
    device: str | None = None
    """Where the step runs when not on the plan's device (the host reference on a GPU: "cpu")."""


class ReferenceFailed(NoFittingReference):
    """A reference step cannot be run as built (not for memory): a checkpointed module changes its input in place,
    or the step raised."""


def checkpoint_blocks(model: nn.Module) -> None:
    """Wrap every repeated block of `model` in `torch.utils.checkpoint` (non-reentrant), in place, except blocks
    that compute in place (`_in_place`); raises `NoFittingReference` for a model without repeated blocks."""
    blocks = marked_modules(model)
    if not blocks:
        raise NoFittingReference(f"{type(model).__name__} has no repeated blocks (children of nn.ModuleList or "
                                 f"nn.Sequential) to checkpoint")
    for name, block in blocks.items():
        if not _in_place(block):
            block.forward = _checkpointed(block.forward, name, block)


def checkpoint_nested(model: nn.Module) -> None:
    """Wrap every submodule of `model` below the root, at every depth, in `torch.utils.checkpoint`
    (non-reentrant), in place, except modules that compute in place (`_in_place`); raises `NoFittingReference`
    for a model without submodules."""
    modules = {name: m for name, m in model.named_modules() if name and not _in_place(m)}
    if not modules:
        raise NoFittingReference(f"{type(model).__name__} has no submodules to checkpoint")
    for name, module in modules.items():
        module.forward = _checkpointed(module.forward, name, module)


def _in_place(module: nn.Module) -> bool:
    """Whether `module` writes its result into its input (`inplace = True`: ReLU, Hardswish, SiLU, Dropout, ...).
    Checkpointed alone, it would run again in the backward on an input that it, and the in-place ops after it,
    have changed since, and change it once more under the tensors autograd saved from it (MobileNetV3's
    classifier, Hardswish and Dropout in place: "output 0 of Mul is at version 2; expected version 1", issue
    #53). Left out, it runs once, as in eager, inside or between checkpointed regions (whose recomputation reads
    their inputs, never what the module wrote), so the step stays eager's bit for bit; its memory is what eager's
    in-place op takes, nothing."""
    return getattr(module, "inplace", False) is True


def _checkpointed(forward: Callable, name: str, module: nn.Module) -> Callable:
    """`forward` under non-reentrant checkpointing; raises `ReferenceFailed` when the call changed one of its
    input tensors in place (a module that does so without `inplace = True`): the backward's recomputation would
    read the changed input and compute other values than eager's."""
    def run(*args, **kwargs):
        inputs = [t for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor)]
        versions = [t._version for t in inputs]
        out = checkpoint(forward, *args, use_reentrant=False, **kwargs)
        if any(t._version != v for t, v in zip(inputs, versions)):
            raise ReferenceFailed(f"module {name!r} ({type(module).__name__}) changes its input in place, which "
                                  f"checkpointing it cannot recompute")
        return out

    return run


def training_step(model: nn.Module, loss_fn: Callable[..., torch.Tensor], batch: tuple, parts: int = 1,
                  reduction: str = "mean", keep_buffers: bool = False) -> Callable[[], torch.Tensor]:
    """One training step of `model` on `batch` in `parts` parts run in turn (module docstring, 3.), returning
    the loss; `keep_buffers` puts the buffers back to their values after each part's forward (a checkpointed
    model's recomputation would update BatchNorm statistics again)."""
    rows = batch[0].shape[0]
    bounds = [round(i * rows / parts) for i in range(parts + 1)]
    pieces = [(tuple(t[a:b] for t in batch), (b - a) / rows if reduction == "mean" else 1.0)
              for a, b in zip(bounds, bounds[1:]) if b > a]

    def step() -> torch.Tensor:
        total = None
        for piece, weight in pieces:
            loss = loss_fn(model, *piece)
            after_forward = [b.detach().clone() for b in model.buffers()] if keep_buffers else []
            (loss if len(pieces) == 1 else loss * weight).backward()
            with torch.no_grad():
                for buffer, value in zip(model.buffers(), after_forward):
                    buffer.copy_(value)
            part = loss.detach() if len(pieces) == 1 else loss.detach() * weight
            total = part if total is None else total + part
        return total

    return step


def _candidates(model: nn.Module, rows: int, reduction: str | None, device: str, host: bool,
                ) -> Iterator[tuple[str, Callable, float, float]]:
    """(kind, prepare, rtol, atol) of each reference in the module docstring's order for a model on `device`
    (`host`: offer the host's); `prepare(model, loss_fn, batch)` wraps a copy of the model as needed (the
    host's moves it to the CPU) and returns its step."""
    def prepare(parts: int, wrap: Callable[[nn.Module], None] | None) -> Callable:
        def make(copied: nn.Module, loss_fn: Callable, batch: tuple) -> Callable[[], torch.Tensor]:
            if wrap is not None:
                wrap(copied)
            return training_step(copied, loss_fn, batch, parts, reduction or "mean", keep_buffers=wrap is not None)
        return make

    def on_host(copied: nn.Module, loss_fn: Callable, batch: tuple) -> Callable[[], torch.Tensor]:
        copied.to("cpu")
        return training_step(copied, loss_fn, tuple(t.to("cpu") for t in batch))

    blocks = bool(marked_modules(model))
    yield EAGER, prepare(1, None), 0.0, 0.0
    yield PER_BLOCK_CHECKPOINT, prepare(1, checkpoint_blocks), 0.0, 0.0
    yield NESTED_CHECKPOINT, prepare(1, checkpoint_nested), 0.0, 0.0
    batch_statistics = any(isinstance(m, nn.modules.batchnorm._BatchNorm) or isinstance(m, nn.Dropout) and m.p > 0
                           for m in model.modules())
    if reduction is not None and not batch_statistics:
        parts = 2
        while parts <= rows:
            yield (f"{parts} micro-batches" + (" (per-block checkpoint)" if blocks else ""),
                   prepare(parts, checkpoint_blocks if blocks else None), MICRO_BATCH_RTOL, MICRO_BATCH_ATOL)
            parts *= 2
    if host:
        other = torch.device(device).type != "cpu"
        yield HOST, on_host, HOST_RTOL if other else 0.0, HOST_ATOL if other else 0.0


def rebuilt_step(kind: str, model: nn.Module, loss_fn: Callable[..., torch.Tensor], batch: tuple,
                 reduction: str | None = None) -> ReferenceStep:
    """The reference step named `kind` (as `reference_step` chose it, e.g. for the cell's reference) on a copy
    of `model`, without trying the others."""
    device = str(batch[0].device)
    for name, make, rtol, atol in _candidates(model, batch[0].shape[0], reduction, device, host=True):
        if name == kind:
            return _built(name, make, rtol, atol, model, loss_fn, batch)
    raise MemplanError(f"reference kind {kind!r} is not one this model and loss offer; measure the reference again "
                       f"(`memplan run --refresh`).")


def _built(kind: str, make: Callable, rtol: float, atol: float, model: nn.Module, loss_fn: Callable,
           batch: tuple) -> ReferenceStep:
    """The `ReferenceStep` of candidate `kind` on a fresh copy of `model`, with the device its step runs on when
    `make` moved the copy off the batch's."""
    copied = copy.deepcopy(model)
    step = make(copied, loss_fn, batch)
    ran_on = next(copied.parameters(), batch[0]).device
    return ReferenceStep(kind, copied, step, rtol, atol, None if ran_on == batch[0].device else str(ran_on))


def reference_step(model: nn.Module, loss_fn: Callable[..., torch.Tensor], batch: tuple, device: str,
                   limit: MemoryLimit | None, seed: int, reduction: str | None = None) -> ReferenceStep:
    """The first reference of the module docstring's list whose step fits `limit` on `device` (eager when
    there is no limit), on a copy of `model`; the host's, last, runs without the limit. `reduction`: the
    loss's ("mean" or "sum"; None: unknown, no micro-batches). Raises `NoFittingReference` when none fits;
    a step that fails otherwise than for memory is passed over and named in that message (`ReferenceFailed`
    when none missed for memory), and eager's failing is the model's: `ReferenceFailed` at once."""
    if limit is None:
        copied = copy.deepcopy(model)
        return ReferenceStep(EAGER, copied, training_step(copied, loss_fn, batch))
    resident = limit.module_resident_bytes(model, batch)
    misses: list[str] = []
    failed: list[str] = []
    for kind, make, rtol, atol in _candidates(model, batch[0].shape[0], reduction, device, limit.host_reference):
        if kind == HOST:
            return _built(kind, make, rtol, atol, model, loss_fn, batch)
        try:
            trial = copy.deepcopy(model)     # the trial step leaves gradients and buffer updates behind
            trial_step = make(trial, loss_fn, batch)
            torch.manual_seed(seed)
            with PeakMeter(device, limit_bytes=limit.limit_bytes, resident_bytes=resident):
                trial_step()
        except ReferenceFailed as exc:
            failed.append(f"{kind}: {exc}")
            continue
        except (NoFittingReference, torch.OutOfMemoryError) as exc:   # DeviceMemoryExceeded, or a GPU's own
            misses.append(f"{kind}: {str(exc).partition(';')[0]}")
            continue
        except Exception as exc:             # the step itself raised: passed over, named in the message
            if kind == EAGER:
                raise ReferenceFailed(f"the eager reference step of {type(model).__name__} raised {_failure(exc)} "
                                      f"(not for memory), so no plan can be validated against it. Check the model "
                                      f"and loss with an eager step (loss_fn(model, *batch).backward()).") from None
            failed.append(f"{kind}: raised {_failure(exc)}")
            continue
        finally:
            trial = trial_step = None
        return _built(kind, make, rtol, atol, model, loss_fn, batch)
    if not failed:
        raise NoFittingReference(
            f"no reference step fits the device memory limit of {limit.limit_bytes:,} B on {device}, so no plan can "
            f"be validated there: " + "; ".join(misses) + ". Raise device_memory, lower the batch size, or set "
            "host_reference = true under [validate] in pipeline.toml to validate against eager's step on the host "
            "CPU without the limit (docs/fit.md).")
    advice = (" For those that missed the limit, raise device_memory, lower the batch size, or set host_reference = "
              "true under [validate] in pipeline.toml to validate against eager's step on the host CPU without the "
              "limit (docs/fit.md).") if misses else \
        (" Set host_reference = true under [validate] in pipeline.toml to validate against eager's step on the "
         "host CPU without the limit (docs/fit.md).")
    raise (NoFittingReference if misses else ReferenceFailed)(
        f"no reference step can validate a plan under the device memory limit of {limit.limit_bytes:,} B on "
        f"{device}: " + "; ".join(misses + failed) + ". Those that failed did so for another reason than memory "
        "(a memplan bug to report with this message)." + advice)


def _failure(exc: BaseException) -> str:
    """An exception a reference step raised, on one line: its type and the first 300 characters of its message."""
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text[:300]}{'...' if len(text) > 300 else ''}"
