"""Optimizer updates inside the step as PyTorch's functional optimizer API (`torch.optim.sgd.sgd`,
`torch.optim.adam.adam`), called with a param group's hyperparameters and the user optimizer's state exactly as
the class's `step()` calls it, without `step()`'s per-call wrapping (profiler range, step hooks, grad-mode switch,
state initialization checks).

Why: the optimizer inside the step runs one update per update point (42 per ResNet-18 step), each right after a
backward kernel that has streamed megabytes through the caches, so every call's Python path runs cold. Measured
on ResNet-18 (process CPU time, interleaved rounds): its 42 `Optimizer.step()` calls inside the step took
1.4-1.9x the one `optimizer.step()` after the step (AdamW, SGD with momentum) and 1.2-1.7x the same 42 calls
made back to back after the step; the step took 1.05-1.08x the step with the optimizer outside (no
recomputation either way). The functional call is the same update (bit-equal parameters and state:
tests/runtime/test_optim_step.py) through far less code: 1.00-1.05x (bench/optimizer_in_step.py).

The state must exist: the class's own `step()` creates it on a parameter's first update (`ready` says when it
has), so the functional API never initializes state here. Classes without an entry (and subclasses, which may
override `step`) keep `step()`.
"""

from __future__ import annotations

from typing import Callable, Mapping, NamedTuple, Sequence

import torch
from torch import optim
from torch.optim.adam import adam
from torch.optim.sgd import sgd

States = Sequence[dict]


class FunctionalUpdate(NamedTuple):
    """`ready(states, group)`: whether each parameter's state holds what the update reads; `update(params, grads,
    states, group)`: the class's `step()` for one param group of `params` with gradients `grads`."""

    ready: Callable[[States, Mapping], bool]
    update: Callable[[list[torch.Tensor], list[torch.Tensor], States, Mapping], None]


def _sgd_ready(states: States, group: Mapping) -> bool:
    return True                                    # SGD's update creates its momentum buffers (SGD.step)


def _sgd_update(params: list[torch.Tensor], grads: list[torch.Tensor], states: States, group: Mapping) -> None:
    """`torch.optim.SGD.step` for one group: the momentum buffers from and back into the states."""
    momentum = group["momentum"]
    buffers = [state.get("momentum_buffer") for state in states] if momentum != 0 else []
    sgd(params, grads, buffers, has_sparse_grad=any(g.is_sparse for g in grads), foreach=group["foreach"],
        fused=group["fused"], weight_decay=group["weight_decay"], momentum=momentum, lr=group["lr"],
        dampening=group["dampening"], nesterov=group["nesterov"], maximize=group["maximize"])
    if momentum != 0:
        for state, buffer in zip(states, buffers):
            state["momentum_buffer"] = buffer


def _adam_ready(states: States, group: Mapping) -> bool:
    return all("step" in state and (not group["amsgrad"] or "max_exp_avg_sq" in state) for state in states)


def _adam_update(params: list[torch.Tensor], grads: list[torch.Tensor], states: States, group: Mapping) -> None:
    """`torch.optim.Adam.step` (and AdamW's, the same step with decoupled weight decay) for one group."""
    beta1, beta2 = group["betas"]
    adam(params, grads, [state["exp_avg"] for state in states], [state["exp_avg_sq"] for state in states],
         [state["max_exp_avg_sq"] for state in states] if group["amsgrad"] else [],
         [state["step"] for state in states], foreach=group["foreach"], capturable=group["capturable"],
         differentiable=group["differentiable"], fused=group["fused"],
         has_complex=any(torch.is_complex(p) for p in params),
         decoupled_weight_decay=group["decoupled_weight_decay"], amsgrad=group["amsgrad"], beta1=beta1, beta2=beta2,
         lr=group["lr"], weight_decay=group["weight_decay"], eps=group["eps"], maximize=group["maximize"])


FUNCTIONAL: dict[type, FunctionalUpdate] = {
    optim.SGD: FunctionalUpdate(_sgd_ready, _sgd_update),
    optim.Adam: FunctionalUpdate(_adam_ready, _adam_update),
    optim.AdamW: FunctionalUpdate(_adam_ready, _adam_update),
}
"""Optimizer class (exactly; not subclasses) -> its functional update."""
