"""Exact fp32 arithmetic on CUDA, for comparing a plan's step with eager PyTorch.

Eager PyTorch and the captured graph may run the same op with different CUDA kernels: eager batch
norm is cuDNN's, the graph's is ATen's (`_native_batch_norm_legit_functional`), and with TF32 (on by
default for cuDNN convolutions) they may also pick different convolution algorithms. Both are right,
but their rounding differs by more than fp32 comparison tolerances (measured on an H100: up to 0.67 on a
resnet50 gradient at batch 8, 64x64, where the last stages normalize 32 values per channel). A
comparison therefore runs both with cuDNN off (ATen's own kernels for every op) and TF32 off, so that
what remains is the schedule's effect alone; timed steps keep the process's settings.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch


@contextmanager
def exact_fp32(device: str) -> Iterator[None]:
    """On CUDA: cuDNN off and no TF32 in matmuls; restored afterwards (module docstring)."""
    if not device.startswith("cuda"):
        yield
        return
    flags = (torch.backends.cuda.matmul, "allow_tf32"), (torch.backends.cudnn, "enabled")
    saved = [getattr(owner, name) for owner, name in flags]
    for (owner, name), value in zip(flags, (False, False)):
        setattr(owner, name, value)
    try:
        yield
    finally:
        for (owner, name), value in zip(flags, saved):
            setattr(owner, name, value)
