"""The optimizer inside the step, as the planner sees it (torch-free).

With `runtime.load(..., optimizer=opt)` each parameter is updated right after the last schedule step that
computes its gradient or reads the gradient or the parameter (`runtime.format.schedule.update_steps`), and the
gradient is freed there; the parameters updated after the same step are updated by one optimizer step
(`runtime.execute.optim_step`). With `runtime.apply(..., optimizer=opt)` (the policy form, `each_alone`) autograd's
post-accumulate-grad hooks update each parameter by a call of its own once its gradient is accumulated, so
no temporary is carried from one parameter's update to the next and foreach kernels hold one parameter's; and
autograd hands a Node's gradients on when the whole Node has run, so a gradient that an earlier op of a Node
makes (`Problem.autograd_nodes`: a weight's `mm` before its bias's `sum`) is read by the Node's last op too,
and the update follows that op (`_held_by_node`).
`in_step(problem, pairs, optimizer)` turns a problem into that one: the gradients stop being graph outputs
(so every solver sees them die early and plans with the memory freed), each becomes a `ParamUpdate` (the
simulator keeps its last copy live through the update and charges the update step's temporaries: one parameter after another for single-tensor kernels, all at once for foreach ones; a
parameter larger than `slice_bytes` whose update allocates temporaries is updated in elementwise slices by
single-tensor kernels, one call per slice, `runtime.format.schedule.update_slices`, so its temporaries are a slice's),
and the optimizer's state is a resident term (`Problem.optimizer_state_bytes`, reported as the plan's
`predicted.optimizer_state_bytes`, never in the peak).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Sequence

from memplan.runtime.format.schedule import UPDATE_SLICE_BYTES, update_slices
from memplan.tasks.solve.core.problem import ParamUpdate, Problem


@dataclass(frozen=True)
class OptimizerModel:
    """`torch.optim.<torch_class>(params, lr=..., **torch_kwargs)` (validation's reference) as bytes per
    parameter byte: `state` resident across steps; `workspace` of temporaries while one parameter is updated by
    PyTorch's single-tensor kernels after the first step (CPU's default), `carried` of which stay while the
    next parameter of the same step is updated; `foreach_workspace` per parameter byte of the temporaries
    its foreach kernels (CUDA's default) hold for all parameters of a step at once (all measured with
    runtime.measure.meter: SGD with momentum updates in place; Adam/AdamW hold sqrt(v) and its scaled copy, the
    single-tensor loop keeps the last scaled copy, `denom`, until the next parameter's)."""

    state: int
    workspace: int
    carried: int
    foreach_workspace: int
    torch_class: str
    help: str
    torch_kwargs: tuple[tuple[str, float], ...] = ()


OPTIMIZERS = {
    "sgd": OptimizerModel(0, 0, 0, 0, "SGD", "torch.optim.SGD without momentum or weight decay"),
    "sgd-momentum": OptimizerModel(1, 0, 0, 0, "SGD", "torch.optim.SGD with momentum (one buffer per parameter), "
                                   "no weight decay or Nesterov (each adds one parameter's bytes during its update)",
                                   (("momentum", 0.9),)),
    "adam": OptimizerModel(2, 2, 1, 1, "Adam", "torch.optim.Adam (two moments per parameter)"),
    "adamw": OptimizerModel(2, 2, 1, 1, "AdamW", "torch.optim.AdamW (two moments per parameter)"),
}
"""The optimizers a plan can run inside the step, by the name of the plan setting `optimizer`."""


def in_step(problem: Problem, updates: Sequence[tuple[Sequence[int], Sequence[int]]], optimizer: str,
            foreach: bool = False, slice_bytes: int | None = UPDATE_SLICE_BYTES, each_alone: bool = False) -> Problem:
    """`problem` with `optimizer` (a name in `OPTIMIZERS`) inside the step for each parameter tensor's
    (gradient values, parameter values) in `updates` (`runtime.format.graph.OpGraph.gradient_updates`), its kernels
    foreach (`foreach`) or single-tensor, these updating parameters in slices of at most `slice_bytes` (None:
    whole; `runtime.load`'s `update_slice_bytes`), each parameter by a call of its own (`each_alone`: the policy
    form's hooks) or those after one step together; see the module docstring. A tied tensor's state and
    workspace count once."""
    model = OPTIMIZERS[optimizer]
    grads = {g for gs, _ in updates for g in gs}
    nbytes = [int(problem.value_bytes[params[0]]) for _, params in updates]
    if each_alone:
        problem = replace(problem, node_inputs=_held_by_node(problem, grads))
    return replace(problem, outputs=tuple(v for v in problem.outputs if v not in grads),
                   updates=tuple(_update(tuple(gs), tuple(ps), b, model, foreach, slice_bytes, each_alone)
                                 for (gs, ps), b in zip(updates, nbytes)),
                   optimizer_state_bytes=model.state * sum(nbytes), foreach_updates=foreach and not each_alone)


def _update(grads: tuple[int, ...], params: tuple[int, ...], nbytes: int, model: OptimizerModel, foreach: bool,
            slice_bytes: int | None, each_alone: bool) -> ParamUpdate:
    """The update of a parameter of `nbytes`: foreach, single-tensor, or single-tensor in slices, one call each
    (`runtime.execute.optim_functional.update_in_slices`, which slices only updates that allocate temporaries); a call
    of its own (`each_alone`) carries nothing to the next parameter's."""
    if foreach:
        return ParamUpdate(grads, params, model.foreach_workspace * nbytes,
                           0 if each_alone else model.foreach_workspace * nbytes)
    sizes = [end - start for start, end in update_slices(nbytes, slice_bytes if model.workspace else None)]
    if len(sizes) == 1:
        return ParamUpdate(grads, params, model.workspace * nbytes, 0 if each_alone else model.carried * nbytes)
    return ParamUpdate(grads, params, sliced_workspace=model.workspace * max(sizes))


def _held_by_node(problem: Problem, grads: set[int]) -> tuple[tuple[int, ...], ...]:
    """`problem.node_inputs` with each gradient in `grads` made by an op of a run of consecutive backward nodes
    sharing an autograd Node (`Problem.autograd_nodes`, as `runtime.policy.form.held_reads` reads them) also
    read by the run's last op: autograd's AccumulateGrad, whose hook updates the parameter, gets it then."""
    labels, inputs = problem.autograd_nodes, [list(reads) for reads in problem.node_inputs]
    for g in sorted(grads) if labels else ():
        node = last = int(problem.value_producer[g])
        if node < 0 or labels[node] is None:
            continue
        while last + 1 < len(inputs) and problem.phase[last + 1] == "backward" and labels[last + 1] == labels[node]:
            last += 1
        if last != node:
            inputs[last].append(g)
    return tuple(tuple(reads) for reads in inputs)
