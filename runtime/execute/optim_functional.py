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

Large parameters in slices (`update_in_slices`): the updates are elementwise, so updating `param.view(-1)[a:b]`
from the same slices of its gradient and state gives the same bits, while the temporaries an update allocates
(Adam's `sqrt(v)` and its scaled copy, 2x the bytes it updates) shrink to a slice's. Each slice is one call of
the functional update, whose temporaries are freed when it returns (the parameters updated before it in the same
update point are one call before it); a scalar state tensor (Adam's `step`, which each call increments) is set
back to its value before the parameter's update ahead of each later slice (`fill_`, no allocation), so the step
advances once per parameter. Only where the update runs PyTorch's single-tensor kernels (a foreach or fused
kernel holds every slice's temporaries at once) and finds all the state it reads (SGD creates its momentum
buffers on the first step).
"""

from __future__ import annotations

from typing import Callable, Mapping, NamedTuple, Sequence

import torch
from torch import optim
from torch.optim.adam import adam
from torch.optim.optimizer import _default_to_fused_or_foreach
from torch.optim.sgd import sgd

from memplan.runtime.format.schedule import update_slices

States = Sequence[dict]


class FunctionalUpdate(NamedTuple):
    """`ready(states, group)`: whether each parameter's state holds what the update reads; `update(params, grads,
    states, group)`: the class's `step()` for one param group of `params` with gradients `grads`;
    `allocates(states, group)`: whether the update allocates temporaries of a parameter's size and creates no
    state (so updating large parameters in slices bounds its memory and keeps its result)."""

    ready: Callable[[States, Mapping], bool]
    update: Callable[[list[torch.Tensor], list[torch.Tensor], States, Mapping], None]
    allocates: Callable[[States, Mapping], bool]


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


def _sgd_allocates(states: States, group: Mapping) -> bool:
    """SGD updates in place unless weight decay, Nesterov or maximize make a new gradient; with momentum, its
    first step creates the buffers."""
    return (group["weight_decay"] != 0 or group["nesterov"] or group["maximize"]) and \
        (group["momentum"] == 0 or all(state.get("momentum_buffer") is not None for state in states))


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


def _adam_allocates(states: States, group: Mapping) -> bool:
    return True                                    # sqrt(v) and its scaled copy; the state exists (ready)


FUNCTIONAL: dict[type, FunctionalUpdate] = {
    optim.SGD: FunctionalUpdate(_sgd_ready, _sgd_update, _sgd_allocates),
    optim.Adam: FunctionalUpdate(_adam_ready, _adam_update, _adam_allocates),
    optim.AdamW: FunctionalUpdate(_adam_ready, _adam_update, _adam_allocates),
}
"""Optimizer class (exactly; not subclasses) -> its functional update."""


def single_tensor(params: Sequence[torch.Tensor], group: Mapping) -> bool:
    """Whether the functional update of `params` with `group`'s choice runs the single-tensor kernels: neither
    fused nor foreach, by choice or by the default `adam()` and `sgd()` pick for these tensors."""
    if group.get("fused") or group.get("foreach"):
        return False
    return group.get("foreach") is False or not _default_to_fused_or_foreach(list(params), False, use_fused=False)[1]


def update_in_slices(update: Callable, params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor],
                     states: States, group: Mapping, slice_bytes: int) -> None:
    """`update(params, grads, states, group)` with each parameter of more than `slice_bytes` updated in its slices
    (`runtime.format.schedule.update_slices`), one call per slice, between the calls over the whole parameters before and
    after it (module docstring). A parameter stays whole when it, its gradient or a state tensor shaped like it is
    not contiguous, or its state holds another tensor that is not a scalar."""
    whole: tuple[list, list, list] = ([], [], [])
    for p, g, state in zip(params, grads, states):
        ranges = update_slices(p.numel() * p.element_size(), slice_bytes)
        tensors = [v for v in state.values() if torch.is_tensor(v)]
        if len(ranges) == 1 or g.layout != torch.strided or g.shape != p.shape or \
                not all(t.is_contiguous() for t in (p, g, *tensors) if t.shape == p.shape) or \
                not all(t.shape == p.shape or t.dim() == 0 for t in tensors):
            for into, item in zip(whole, (p, g, state)):
                into.append(item)
            continue
        if whole[0]:
            update(*whole, group)
            whole = ([], [], [])
        scalars = {key: v.item() for key, v in state.items() if torch.is_tensor(v) and v.dim() == 0}
        size = p.element_size()
        for i, (start, end) in enumerate(ranges):
            for key, value in scalars.items() if i else ():
                state[key].fill_(value)                # each slice's update advances the step from its value before
            part = slice(start // size, end // size)
            update([p.view(-1)[part]], [g.view(-1)[part]],
                   [{key: v.view(-1)[part] if torch.is_tensor(v) and v.shape == p.shape else v
                     for key, v in state.items()}], group)
    if whole[0]:
        update(*whole, group)
