"""Run a plan in the policy form: selective activation checkpointing in the user's own training loop.

`apply(plan, model, loss_fn, batch)` wraps the forward of each region the plan recomputes (a repeated
module recorded at capture, runtime/tracing/modules.py, or a child of one for the layers the plan splits) in
`torch.utils.checkpoint(use_reentrant=False, context_fn=...)`, whose `create_selective_checkpoint_contexts`
policy returns MUST_SAVE for the ops of the nodes the plan keeps and PREFER_RECOMPUTE for the rest
(runtime/policy/form.py says which schedules that is and what the simulator predicts for them). A region
the plan recomputes whole is wrapped in plain `torch.utils.checkpoint(use_reentrant=False)`, which does the
same without the policy's dispatch mode (it cost 4% of a GPT-2 step split into 24 whole regions). The model then trains with `loss.backward()`, under
`torch.compile` and DistributedDataParallel unchanged.

Op calls are matched to the captured graph's ops of the region by order: the policy sees the region's
ATen calls as eager PyTorch (or torch.compile's tracer) dispatches them, the graph holds them as
AOTAutograd traced them (`capture_eager`). Views are skipped on both sides (recomputing a view allocates
nothing); ops compare by name without overload or in-place suffix (`bernoulli_.float` is `bernoulli.p`).
A call whose op is among the next `LOOKAHEAD` graph ops is that op, and the graph ops it passes count as
run; torch.compile's `native_dropout` is eager's `empty_like`, `bernoulli`, `div`, `mul` (`_EXPANDS`); any
other call is part of the next graph op and takes its decision. After each eager forward of a region
with a policy every graph op must have been matched, else the model ran another forward than the captured
one and the step raises PolicyMismatch. Each region with a policy is registered in `_REGIONS` under a key
its wrapper holds (torch.compile takes a `context_fn` only as a function or a partial of constants).
"""

from __future__ import annotations

import contextlib
import functools
import os
import uuid
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Mapping

import torch
from torch import nn
from torch.utils import _pytree as pytree
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from memplan.runtime.tracing.autograd_nodes import label_backward
from memplan.runtime.tracing.capture import capture
from memplan.runtime.format.graph import OpGraph
from memplan.runtime.execute.model_state import ModelChanged, ModelState, describe
from memplan.runtime.tracing.modules import META_KEY, PART_KEY, marked_modules, module_parts
from memplan.runtime.tracing.ops import allocating_calls, is_view, op_name
from memplan.runtime.execute.optim_step import check_optimizer, step_in_backward
from memplan.runtime.format.plan import Plan
from memplan.runtime.policy.form import PolicyFormError, Regions, decisions

LOOKAHEAD = 3
_WRAPPED = "_memplan_policy"


class PolicyMismatch(RuntimeError):
    """A region's eager ATen calls do not follow the captured graph's ops, so the policy cannot map them."""


_EXPANDS = {"native_dropout": ("empty_like", "bernoulli", "div", "mul")}
"""A traced op (torch.compile's) standing for several ops of the eager capture, each as `runtime.tracing.ops.op_name` gives it."""


def region_ops(graph: OpGraph, name: str) -> list[tuple[Any, int]]:
    """(ATen op, operator node id) of each non-view call of region `name`'s forward (a recorded module or
    part), in graph order."""
    return [(op, node) for m, op, node in allocating_calls(graph)
            if name in (m.meta.get(META_KEY), m.meta.get(PART_KEY)) and graph.nodes[node].phase != "backward"]


class _Matcher:
    """Walks one eager forward (or recomputation) of a region against its graph ops (module docstring)."""

    def __init__(self, ops: list[tuple[Any, int]], saved: frozenset[int]):
        self.ops, self.saved, self.at = ops, saved, 0

    def decide(self, func: Any) -> CheckpointPolicy:
        if is_view(func) or self.at >= len(self.ops):
            return CheckpointPolicy.PREFER_RECOMPUTE
        name = op_name(func)
        ahead = [op_name(op) for op, _ in self.ops[self.at:self.at + LOOKAHEAD + len(_EXPANDS.get(name, ()))]]
        chain = _EXPANDS.get(name, (name,))
        hit = next((i for i in range(len(ahead)) if tuple(ahead[i:i + len(chain)]) == chain), None)
        if hit is None:                                  # decomposed differently: part of the next graph op
            node = self.ops[self.at][1]
        else:
            self.at += hit + len(chain)
            node = self.ops[self.at - 1][1]
        return CheckpointPolicy.MUST_SAVE if node in self.saved else CheckpointPolicy.PREFER_RECOMPUTE


@dataclass(eq=False)
class _Region:
    """A checkpointed region: its name, graph ops, saved nodes and the matcher of its latest eager forward."""

    name: str
    ops: list[tuple[Any, int]]
    saved: frozenset[int]
    forward_pass: _Matcher | None = None


_REGIONS: dict[str, _Region] = {}
"""Applied regions by the key their wrapper passes to `_context` (module docstring)."""


def _context(key: str) -> tuple[Any, Any]:
    region = _REGIONS[key]
    forward_pass, recompute = _Matcher(region.ops, region.saved), _Matcher(region.ops, region.saved)
    region.forward_pass = forward_pass

    def policy(ctx, func, *args, **kwargs):
        return (recompute if ctx.is_recompute else forward_pass).decide(func)

    return create_selective_checkpoint_contexts(policy)


def _checkpoint(forward: Callable, *args: Any, context_fn: Callable | None = None, **kwargs: Any) -> Any:
    """`torch.utils.checkpoint(forward, *args, use_reentrant=False, **kwargs)` with every tensor of the call
    passed as a positional argument: checkpoint saves those for its recomputation with `save_for_backward`,
    which an enclosing (nested) checkpoint packs and recomputes, but keeps keyword arguments (a transformer
    layer's `self_attn(hidden_states=...)`) in its frame as they are, from the forward to the end of the
    region's backward, which the schedule of a nested module does not (runtime/policy/form.py)."""
    leaves, spec = pytree.tree_flatten((args, kwargs))
    at = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]
    inputs = [leaves[i] for i in at]
    others = [None if isinstance(leaf, torch.Tensor) else leaf for leaf in leaves]   # no tensor in the closure

    def run(*tensors: torch.Tensor) -> Any:
        call = list(others)
        for i, t in zip(at, tensors):
            call[i] = t
        call_args, call_kwargs = pytree.tree_unflatten(call, spec)
        return forward(*call_args, **call_kwargs)

    extra = {} if context_fn is None else {"context_fn": context_fn}
    return checkpoint(run, *inputs, use_reentrant=False, **extra)


def _checkpointed(forward: Callable, key: str, *args: Any, **kwargs: Any) -> Any:
    out = _checkpoint(forward, *args, context_fn=functools.partial(_context, key), **kwargs)
    region = _REGIONS[key]
    if not torch.compiler.is_compiling() and region.forward_pass is not None and region.forward_pass.at < len(region.ops):
        op, node = region.ops[region.forward_pass.at]
        raise PolicyMismatch(f"region {region.name!r}: its eager forward ran none of the captured graph's {op} "
                             f"(operator node {node}) and what follows, so the plan's decisions cannot be mapped "
                             f"onto its ATen calls. The model's forward differs from the captured one (a branch on "
                             f"a flag, a cache); capture it as it trains, or run the plan with runtime.load.")
    return out


class _ModelWatch:
    """The forward pre-hook `apply` puts on the model: each forward (not under torch.compile's tracing) checks
    that the model's modules are the ones captured, by identity (`runtime.execute.model_state`), and refuses a changed
    tree. Parameters are not checked: autograd runs whatever tensors the modules hold (a replaced parameter is
    used, a frozen one gets no gradient), and FSDP2 swaps them by design."""

    def __init__(self, model: nn.Module):
        self.state = ModelState.of(model, parameters=False)

    def __call__(self, model: nn.Module, args: tuple) -> None:
        if torch.compiler.is_compiling():
            return
        changes = self.state.changes(model)
        if changes:
            raise ModelChanged(f"the model's modules changed since runtime.apply captured it ({describe(changes)}): "
                               f"the plan's checkpointed regions and the ops it maps are those of the captured "
                               f"modules, and a module put in since runs without them or fails to map onto them. "
                               f"Make the change before runtime.apply, and apply a plan made for the changed model "
                               f"to a fresh copy of it.")


@contextmanager
def _eager_dropout() -> Iterator[None]:
    """Trace `aten.dropout` as eager PyTorch runs it on the CPU (a float mask from `bernoulli_`, then
    `div_` and `mul`) rather than through torch's Python decomposition (`native_dropout`, a bool mask),
    so the graph holds the tensors eager autograd keeps."""
    op = torch.ops.aten.dropout.default
    keys = [k for k in (torch._C.DispatchKey.CompositeImplicitAutograd, torch._C.DispatchKey.Autograd)
            if k in op.py_kernels]
    kernels = {k: op.py_kernels.pop(k) for k in keys}
    op._dispatch_cache.clear()
    try:
        yield
    finally:
        op.py_kernels.update(kernels)
        op._dispatch_cache.clear()


def capture_eager(model: nn.Module, loss_fn: Callable[..., torch.Tensor], batch: tuple) -> OpGraph:
    """The graph the policy form plans on: the step captured without memplan's rewrites (they change
    which tensors are kept, and eager autograd runs none of them) and, for a CPU step, with dropout as
    eager runs it there; its backward nodes are labelled with the autograd Nodes that run them
    (runtime/tracing/autograd_nodes.py), so the simulator holds a Node's saved tensors as autograd does. `apply`
    captures the same way for a plan whose provenance says `capture = "eager"`."""
    cpu = all(t.device.type == "cpu" for t in (*batch, *model.parameters()))
    with _eager_dropout() if cpu else contextlib.nullcontext():
        graph = capture(model, loss_fn, tuple(batch), rewrites={}, record_parts=True)
        label_backward(graph, model, loss_fn, tuple(batch))
    graph.meta["capture"] = "eager"
    return graph


def apply(plan: Plan | Mapping[str, Any] | str | os.PathLike, model: nn.Module, loss_fn: Callable[..., torch.Tensor],
          batch: tuple, graph: OpGraph | None = None, optimizer: torch.optim.Optimizer | None = None) -> nn.Module:
    """Make `model` train under `plan` in the policy form, in place, and return it. The plan must be one
    selective checkpointing can run (runtime/policy/form.py; solver `selective-policy` makes them),
    else PolicyFormError says why. `batch` is what the plan was made for: the model is captured with
    `capture_eager` (or `graph` is, from this model and batch) and the plan checked against it. With
    `optimizer`, `loss.backward()` also runs it, each parameter updated as soon as its gradient is accumulated
    (`runtime.execute.optim_step.step_in_backward`: post-accumulate-grad hooks); do not call optimizer.step(). Each
    forward of `model` then checks that its modules are the ones captured (`_ModelWatch`; ModelChanged if not)."""
    plan = plan if isinstance(plan, Plan) else Plan.load(plan)
    if optimizer is not None:
        check_optimizer(optimizer)
        if torch.distributed.is_available() and torch.distributed.is_initialized() and \
                torch.distributed.get_world_size() > 1:
            raise PolicyFormError(
                "optimizer= updates each parameter as soon as autograd has accumulated its gradient, which under "
                "a process group of several ranks (DistributedDataParallel, FSDP2) is the rank's own gradient, "
                "before the all-reduce or reduce-scatter: the ranks would drift apart. Apply the plan without "
                "optimizer= and call opt.step() after loss.backward().")
    if getattr(getattr(model, "config", None), "use_cache", False):
        raise PolicyFormError("this model keeps a key/value cache (config.use_cache = True), which a checkpointed "
                              "region would update twice (forward and recomputation). Set model.config.use_cache = "
                              "False before runtime.apply, as transformers' own gradient checkpointing does, and pass "
                              "no use_cache=True to its forward.")
    if any(hasattr(m, _WRAPPED) for m in model.modules()):
        raise PolicyFormError("this model already runs a plan in the policy form (runtime.apply was called on it); "
                              "apply a plan to a fresh copy of the model.")
    if plan.provenance.get("capture") != "eager":
        raise PolicyFormError("this plan was made on the graph memplan's executor runs (with its rewrites, "
                              "e.g. fused GELU and cross-entropy), whose ops eager PyTorch does not run, so the policy "
                              "form cannot map it. Make the plan on runtime.policy.apply.capture_eager's graph (its "
                              "provenance then says capture = 'eager'), or run this plan with runtime.load.")
    if graph is None or graph.program is None or graph.meta.get("capture") != "eager":
        graph = capture_eager(model, loss_fn, tuple(batch))
    plan.validate(graph)
    split, nest = plan.provenance.get("split", []), plan.provenance.get("nest", [])
    for key, names in (("split", split), ("nest", nest)):
        if not isinstance(names, list) or not all(isinstance(name, str) for name in names):
            raise PolicyFormError(f"the plan's provenance.{key} is {names!r}; it must be a list of recorded modules "
                                  f"(layer names): those checkpointed by their parts (split), and of those, the ones "
                                  f"also checkpointed whole around them (nest) (docs/plan-format.md).")
    regions = Regions.of_graph(graph, split, nest)
    saved = decisions(regions, plan.schedule)
    modules = {**marked_modules(model), **module_parts(model)}
    for name in regions.nested_modules:                 # outer checkpoints around the parts' (nested)
        setattr(modules[name], _WRAPPED, f"{uuid.uuid4().hex}:{name}")
        modules[name].forward = functools.partial(_checkpoint, modules[name].forward)
    for name, keep in saved.items():
        module, key = modules[name], f"{uuid.uuid4().hex}:{name}"
        setattr(module, _WRAPPED, key)
        if keep:
            _REGIONS[key] = _Region(name, region_ops(graph, name), keep)
            module.forward = functools.partial(_checkpointed, module.forward, key)
        else:                                        # recomputed whole: no op to map, no policy to consult
            module.forward = functools.partial(_checkpoint, module.forward)
    if optimizer is not None:
        step_in_backward(optimizer, model)
    model.register_forward_pre_hook(_ModelWatch(model))
    return model
