"""The reference a plan is validated against when eager PyTorch does not fit the device memory limit.

Validation compares a plan's step with a reference step from the same weights and batch. Under a
`device_memory` limit (tasks/memory_limit.py) the reference must fit it too, or a device that cannot run
eager could not validate anything. `reference_step` tries, in order, each run under the limit
(`runtime.meter.PeakMeter(limit_bytes=...)`, which raises `DeviceMemoryExceeded` past it):

1. eager: `loss_fn(model, *batch).backward()`;
2. per-block checkpointing: the same step with `torch.utils.checkpoint` (non-reentrant, the RNG state
   preserved) around every repeated block that capture records (`runtime.modules.marked_modules`: the
   children of `nn.ModuleList` / `nn.Sequential` containers, a transformer's layers, ResNet's blocks).
   Recomputation re-runs the same kernels on the same inputs, so the loss and gradients are eager's bit for
   bit on deterministic kernels: the validation tolerance (`[validate] rtol`, `atol`) stays as it is. Its
   recomputed forward would update BatchNorm running statistics a second time; the buffers are put back to
   their values after the forward, which are eager's.

The first that fits is the reference; when neither fits, `NoFittingReference` says by how much each missed.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from runtime.meter import PeakMeter
from runtime.modules import marked_modules
from tasks.config import MemplanError
from tasks.memory_limit import MemoryLimit

EAGER = "eager"
PER_BLOCK_CHECKPOINT = "per-block checkpoint"


class NoFittingReference(MemplanError):
    """Neither eager PyTorch nor per-block checkpointing fits the device memory limit."""


@dataclass(frozen=True)
class ReferenceStep:
    """The training step of the reference named `kind`, on its own copy of the model."""

    kind: str
    model: nn.Module
    step: Callable[[], torch.Tensor]


def eager_step(model: nn.Module, loss_fn: Callable[..., torch.Tensor], batch: tuple) -> Callable[[], torch.Tensor]:
    """One eager training step of `model` on `batch`; returns the loss."""
    def step() -> torch.Tensor:
        loss = loss_fn(model, *batch)
        loss.backward()
        return loss

    return step


def checkpointed_step(model: nn.Module, loss_fn: Callable[..., torch.Tensor], batch: tuple
                      ) -> Callable[[], torch.Tensor]:
    """One training step of `model` with `torch.utils.checkpoint` around every repeated block (module doc);
    `model`'s blocks are wrapped in place. Raises `NoFittingReference` for a model without repeated blocks."""
    blocks = marked_modules(model)
    if not blocks:
        raise NoFittingReference(f"{type(model).__name__} has no repeated blocks (children of nn.ModuleList or "
                                 f"nn.Sequential) to checkpoint")
    for block in blocks.values():
        block.forward = _checkpointed(block.forward)

    def step() -> torch.Tensor:
        loss = loss_fn(model, *batch)
        after_forward = [b.detach().clone() for b in model.buffers()]
        loss.backward()
        with torch.no_grad():
            for buffer, value in zip(model.buffers(), after_forward):
                buffer.copy_(value)
        return loss

    return step


def _checkpointed(forward: Callable) -> Callable:
    def run(*args, **kwargs):
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)

    return run


def reference_step(model: nn.Module, loss_fn: Callable[..., torch.Tensor], batch: tuple, device: str,
                   limit: MemoryLimit | None, seed: int) -> ReferenceStep:
    """The first reference of the module docstring's list whose step fits `limit` on `device` (eager when
    there is no limit), on a copy of `model`; raises `NoFittingReference` when none does."""
    candidates = [(EAGER, eager_step), (PER_BLOCK_CHECKPOINT, checkpointed_step)]
    if limit is None:
        copied = copy.deepcopy(model)
        return ReferenceStep(EAGER, copied, eager_step(copied, loss_fn, batch))
    resident = limit.module_resident_bytes(model, batch)
    misses = []
    for kind, make in candidates:
        try:
            trial = copy.deepcopy(model)     # the trial step leaves gradients and buffer updates behind
            trial_step = make(trial, loss_fn, batch)
            torch.manual_seed(seed)
            with PeakMeter(device, limit_bytes=limit.limit_bytes, resident_bytes=resident):
                trial_step()
        except (NoFittingReference, torch.OutOfMemoryError) as exc:    # DeviceMemoryExceeded, or a GPU's own
            misses.append(f"{kind}: {exc}")
            continue
        finally:
            trial = trial_step = None
        copied = copy.deepcopy(model)
        return ReferenceStep(kind, copied, make(copied, loss_fn, batch))
    raise NoFittingReference(
        f"no reference step fits the device memory limit of {limit.limit_bytes:,} B on {device}, so no plan can be "
        f"validated there: " + "; ".join(misses) + ". Raise device_memory or lower the batch size.")

