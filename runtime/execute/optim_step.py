"""The optimizer inside the step (optimizer-in-backward): each parameter is updated as soon as the planned
backward has its final gradient, and that gradient is freed right after, so no gradient lives to the end of
the step.

`InStepOptimizer` wraps the user's `torch.optim` optimizer as PyTorch's "optimizer in backward" recipe does, with
one optimizer of the same class per update point: the parameters the plan updates after the same schedule step
(and that share a param group) are updated by ONE `step()` of an optimizer over them, built from their group
(with its `foreach`/`fused` choice), so a step pays an update's per-call overhead once per update point, not
once per parameter. Before each update that optimizer takes its group's current hyperparameters (so an LR
scheduler stepping the user's optimizer works) and shares the user's state dict of each of its parameters (so
`optimizer.state_dict()` holds the same momentum buffers, steps and moments as after eager `optimizer.step()`
calls, and `optimizer.load_state_dict` takes effect). For SGD, Adam and AdamW, once the parameters' state
exists, the update is the class's functional API called as its `step()` calls it (runtime.execute.optim_functional:
the same update through far less code, which matters because each update runs cold, right after a backward
kernel), and where it allocates temporaries (Adam's, AdamW's) a parameter larger than `slice_bytes` is updated in
elementwise slices (`runtime.format.schedule.update_slices`), so they are a slice's, as the planner counts them. Updates
of different parameters are independent for the classes in `PER_PARAMETER`; others (LBFGS, which needs a closure
over the whole model; SparseAdam) are refused. `update_points` says after which schedule step each parameter is
updated (torch-free `runtime.format.schedule.update_steps`, the rule the simulator charges). The policy form
(`step_in_backward`) stays per parameter: autograd runs post-accumulate-grad hooks one parameter at a time.
"""

from __future__ import annotations

import functools
from typing import Mapping, NamedTuple, Sequence

import torch
from torch import optim

from memplan.runtime.execute.grads import accumulate_grad
from memplan.runtime.format.graph import OpGraph
from memplan.runtime.execute.optim_functional import FUNCTIONAL, single_tensor, update_in_slices
from memplan.runtime.format.plan import Plan
from memplan.runtime.format.schedule import UPDATE_SLICE_BYTES, update_steps
from memplan.runtime.variants.offered import GraphVariants

PER_PARAMETER = (optim.SGD, optim.Adam, optim.AdamW, optim.Adamax, optim.NAdam, optim.RAdam, optim.Adagrad,
                 optim.Adadelta, optim.RMSprop, optim.ASGD, optim.Rprop, optim.Adafactor)
"""Optimizer classes whose step updates each parameter from its own gradient and state only."""


class InStepOptimizer:
    """Updates parameters `params[k]` from their gradients (`update(members, *grads)`, or one from its `.grad`:
    `step_accumulated(k)`) with an optimizer of `optimizer`'s class per update point (module docstring),
    `clip_grad_value` clamping each gradient first, the functional updates of parameters larger than
    `slice_bytes` in slices (runtime.execute.optim_functional.update_in_slices; None: whole); parameters the optimizer
    does not hold are not updated (`holds`)."""

    def __init__(self, optimizer: optim.Optimizer, params: Sequence[torch.Tensor],
                 clip_grad_value: float | None = None, slice_bytes: int | None = UPDATE_SLICE_BYTES):
        check_optimizer(optimizer)
        check_slice_bytes(slice_bytes)
        self.optimizer = optimizer
        self.params = list(params)
        self.clip_grad_value = clip_grad_value
        self.slice_bytes = slice_bytes
        group_of = {id(p): group for group in optimizer.param_groups for p in group["params"]}
        self._groups = [group_of.get(id(p)) for p in self.params]
        self._together: dict[tuple[int, ...], optim.Optimizer] = {}   # parameter indices -> their optimizer
        self._by_group: dict[tuple, list[tuple[int, ...]]] = {}          # update's members -> indices per group
        self._functional = FUNCTIONAL.get(type(optimizer))

    def holds(self, k: int) -> bool:
        """Whether the optimizer updates `params[k]`."""
        return self._groups[k] is not None

    def update(self, members: Sequence[tuple[int, int]], *grads: torch.Tensor) -> None:
        """Update `params[k]` for each (k, n) in `members` with the sum of its next n gradients in `grads` (its
        final gradients of this step: one per name the model holds it under, summed as autograd's
        AccumulateGrad does), one optimizer step per param group, then drop the gradients."""
        position = 0
        for k, n in members:
            for grad in grads[position:position + n]:
                accumulate_grad(self.params[k], grad)
            position += n
        by_group = self._by_group.get(members)
        if by_group is None:
            ks_of: dict[int, list[int]] = {}
            for k, _ in members:
                ks_of.setdefault(id(self._groups[k]), []).append(k)
            by_group = self._by_group[members] = [tuple(ks) for ks in ks_of.values()]
        for ks in by_group:
            self._step(ks)

    def step_accumulated(self, k: int, *_: object) -> None:
        """Update `params[k]` with its `.grad`, then set it to None (also a post-accumulate-grad hook)."""
        self._step((k,))

    def _step(self, ks: tuple[int, ...]) -> None:
        """One step of the optimizer over `params[k]`, k in `ks` (one param group), from their `.grad`: the
        class's functional update (`FUNCTIONAL`) once their state exists, large parameters in slices where that
        bounds its temporaries, else `step()` of an optimizer of the class over them (which creates the state)."""
        group = self._groups[ks[0]]
        params = [self.params[k] for k in ks]
        if self.clip_grad_value is not None:
            for p in params:
                p.grad.clamp_(-self.clip_grad_value, self.clip_grad_value)
        states = [self.optimizer.state[p] for p in params]     # the user's optimizer's state (created empty)
        if self._functional is not None and self._functional.ready(states, group):
            grads = [p.grad for p in params]
            if self.slice_bytes is not None and self._functional.allocates(states, group) and \
                    single_tensor(params, group):
                update_in_slices(self._functional.update, params, grads, states, group, self.slice_bytes)
            else:
                self._functional.update(params, grads, states, group)
        else:
            together = self._together.get(ks)
            if together is None:
                together = self._together[ks] = type(self.optimizer)([{**_hyperparameters(group), "params": params}])
            together.param_groups[0].update(_hyperparameters(group))
            for p, state in zip(params, states):
                if together.state.get(p) is not state:
                    together.state[p] = state
            together.step()
        for p in params:
            p.grad = None


def step_in_backward(optimizer: optim.Optimizer, model: torch.nn.Module) -> list:
    """The policy form's optimizer inside the step: a `register_post_accumulate_grad_hook` on each parameter
    `optimizer` holds runs its update as soon as autograd has accumulated the parameter's gradient, and frees
    it. Returns the hooks' handles (`handle.remove()` takes the optimizer out of the step again)."""
    params = [p for p in model.parameters() if p.requires_grad]
    in_step = InStepOptimizer(optimizer, params)
    return [p.register_post_accumulate_grad_hook(functools.partial(in_step.step_accumulated, i))
            for i, p in enumerate(params) if in_step.holds(i)]


def _hyperparameters(group: Mapping) -> dict:
    return {k: v for k, v in group.items() if k != "params"}


def check_optimizer(optimizer: object) -> None:
    """Refuse an optimizer whose update cannot run per parameter inside the step, in one paragraph."""
    if not isinstance(optimizer, optim.Optimizer):
        raise TypeError(f"optimizer= takes a torch.optim.Optimizer built over the model's parameters, not "
                        f"{type(optimizer).__name__}. Pass e.g. torch.optim.AdamW(model.parameters()), or no "
                        f"optimizer to keep it outside the step.")
    if not isinstance(optimizer, PER_PARAMETER):
        raise ValueError(f"optimizer {type(optimizer).__name__} cannot run inside the step: memplan updates each "
                         f"parameter alone as soon as its gradient is final, which is exact only for optimizers "
                         f"whose update of a parameter reads that parameter's gradient and state alone "
                         f"({', '.join(c.__name__ for c in PER_PARAMETER)}, or subclasses). LBFGS needs a closure "
                         f"over the whole model. Load without optimizer= and call optimizer.step() after the step.")
    for i, group in enumerate(optimizer.param_groups):
        if group.get("differentiable"):
            raise ValueError(f"optimizer param_groups[{i}] has differentiable=True, which the optimizer inside the "
                             f"step does not support (it runs without autograd). Build the optimizer with "
                             f"differentiable=False, or load without optimizer= and step it yourself.")


def check_slice_bytes(slice_bytes: object) -> None:
    """Refuse an update slice size that is not a positive number of bytes (or None), in one paragraph."""
    if slice_bytes is not None and (not isinstance(slice_bytes, int) or isinstance(slice_bytes, bool)
                                    or slice_bytes <= 0):
        raise ValueError(f"update_slice_bytes={slice_bytes!r} is not a number of bytes: pass a positive integer (the "
                         f"largest slice of a parameter the optimizer inside the step updates at once; the planner's "
                         f"default is {UPDATE_SLICE_BYTES}, runtime.format.schedule.UPDATE_SLICE_BYTES, which the plan's "
                         f"prediction assumes) or None to update every parameter whole.")


def update_points(graph: OpGraph, plan: Plan, variants: GraphVariants,
                  held: Sequence[int]) -> dict[int, list[tuple[int, tuple[int, ...]]]]:
    """Schedule step -> (k, gradient output indices) of the parameter tensors `graph.gradient_updates()[k]`,
    k in `held`, updated right after that step from the sum of those gradients
    (`runtime.format.schedule.update_steps`). Gradient output j is value `graph.outputs[1 + j]`."""
    io = [None if "compute" not in step else
          _Reads(*variants.io(graph, step["compute"], step.get("impl"))) for step in plan.schedule]
    updates = graph.gradient_updates()
    output = {v: j for j, v in enumerate(graph.outputs[1:])}
    after: dict[int, list[tuple[int, tuple[int, ...]]]] = {}
    for k, step in zip(held, update_steps(io, [updates[k] for k in held])):
        after.setdefault(step, []).append((k, tuple(output[g] for g in updates[k][0])))
    return after


class _Reads(NamedTuple):
    inputs: Sequence[int]
    outputs: Sequence[int]


def refuse_global_clipping(max_norm: float | None) -> None:
    """Refuse clipping by the global gradient norm with the optimizer inside the step."""
    if max_norm is not None:
        raise ValueError(f"clip_grad_norm={max_norm!r} cannot apply with the optimizer inside the step: clipping by "
                         f"the global norm scales every gradient by a factor that depends on all of them, and each "
                         f"parameter is updated (and its gradient freed) as soon as its own gradient is final, before "
                         f"the others exist. Clip each gradient elementwise instead (clip_grad_value=, exact per "
                         f"parameter), or load without optimizer= and call torch.nn.utils.clip_grad_norm_ before "
                         f"optimizer.step().")


def refuse_accumulation(in_step: InStepOptimizer) -> None:
    """Refuse a step that starts with a gradient in `.grad` of a parameter the optimizer updates in the step."""
    held = [i for i, p in enumerate(in_step.params) if p.grad is not None and in_step.holds(i)]
    if held:
        raise ValueError(f"{len(held)} parameter(s) the optimizer updates inside the step already hold a .grad "
                         f"(e.g. parameter {held[0]} of shape {list(in_step.params[held[0]].shape)}): gradients "
                         f"cannot accumulate across steps when the optimizer runs inside the step, since each step "
                         f"updates the parameters with its own gradients and frees them. Set the gradients to None "
                         f"(optimizer.zero_grad()) before the step, or load without optimizer= to accumulate "
                         f"gradients over several steps and call optimizer.step() yourself.")
