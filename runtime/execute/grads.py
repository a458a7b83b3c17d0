"""Gradients into `.grad` as autograd leaves them, for the plan executor and its CUDA-graph replay."""

from __future__ import annotations

import torch


def stealable(p: torch.Tensor, g: torch.Tensor) -> bool:
    """Whether gradient `g` can become `p.grad` as it is: the parameter's layout, a storage of its own."""
    return g.stride() == p.stride() and g.storage_offset() == 0 and \
        g.untyped_storage().nbytes() == g.numel() * g.element_size()


def accumulate_grad(p: torch.Tensor, g: torch.Tensor, steal: bool | None = None) -> None:
    """What autograd's AccumulateGrad does: steal a `stealable` gradient (`steal`, when the caller knows),
    else copy it into the parameter's layout; add in place to an existing `.grad`."""
    if p.grad is None:
        steal = stealable(p, g) if steal is None else steal
        p.grad = g if steal else torch.empty_strided(p.shape, p.stride(), dtype=g.dtype, device=g.device).copy_(g)
    else:
        p.grad += g
