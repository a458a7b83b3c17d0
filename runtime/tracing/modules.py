"""Module boundaries recorded at capture (`aot_export_module` keeps no module of its own: its final
re-trace runs the joint graph, not the model, so `nn_module_stack` is empty).

The repeated units a user checkpoints by hand are the children of `nn.ModuleList` and `nn.Sequential`
containers (transformer layers, ResNet bottlenecks, MobileNet's inverted residuals); `marked_modules`
picks the outermost of them. Their children (`module_parts`: a layer's attention, MLP and norms) are
recorded too where asked (the policy form's capture), so it can checkpoint a layer by its parts. While
tracing, hooks pass the first tensor entering and leaving each such module through the identity op
`memplan::module_boundary` (its gradient passes through unmarked); the markers survive the re-trace as FX
nodes. `strip_boundaries` tags
every FX node between a module's two markers with the module's name (`node.meta["memplan_module"]`) and
the part's (`node.meta["memplan_part"]`; a part called more than once in a step is not one), then removes
the markers, so the graph is the one captured without them.
"""

from __future__ import annotations

from collections import Counter
from contextlib import contextmanager
from typing import Any, Iterator

import torch
from torch import fx, nn
from torch.utils import _pytree as pytree

META_KEY = "memplan_module"
PART_KEY = "memplan_part"


@torch.library.custom_op("memplan::module_boundary", mutates_args=())
def module_boundary(x: torch.Tensor, name: str, enter: bool) -> torch.Tensor:
    """Identity marking where module `name` is entered (`enter`) or left."""
    return x.clone()


@module_boundary.register_fake
def _(x: torch.Tensor, name: str, enter: bool) -> torch.Tensor:
    return torch.empty_like(x)


def _pass_gradient(ctx: Any, grad: torch.Tensor) -> tuple:
    return grad, None, None


module_boundary.register_autograd(_pass_gradient)
BOUNDARY = torch.ops.memplan.module_boundary.default


def marked_modules(model: nn.Module) -> dict[str, nn.Module]:
    """The outermost children of `nn.ModuleList` / `nn.Sequential` containers, by qualified name."""
    out: dict[str, nn.Module] = {}

    def visit(module: nn.Module, prefix: str) -> None:
        for name, child in module.named_children():
            qual = f"{prefix}{name}"
            if isinstance(module, (nn.ModuleList, nn.Sequential)):
                out[qual] = child
            else:
                visit(child, qual + ".")

    visit(model, "")
    return out


def module_parts(model: nn.Module) -> dict[str, nn.Module]:
    """The children of each module of `marked_modules`, by qualified name."""
    return {f"{name}.{child_name}": child for name, module in marked_modules(model).items()
            for child_name, child in module.named_children()}


def _mark_first_tensor(tree: Any, name: str, enter: bool) -> tuple[Any, bool]:
    leaves, spec = pytree.tree_flatten(tree)
    for i, leaf in enumerate(leaves):
        if isinstance(leaf, torch.Tensor):
            leaves[i] = module_boundary(leaf, name, enter)
            return pytree.tree_unflatten(leaves, spec), True
    return tree, False


@contextmanager
def boundary_hooks(model: nn.Module, parts: bool = False) -> Iterator[None]:
    """Mark the entry and exit of every module of `marked_modules(model)`, and with `parts` of
    `module_parts(model)`, while the context is open."""
    handles = []
    for name, module in {**marked_modules(model), **(module_parts(model) if parts else {})}.items():
        def enter(mod, args, kwargs, name=name):
            args, done = _mark_first_tensor(args, name, True)
            if not done:
                kwargs, _ = _mark_first_tensor(kwargs, name, True)
            return args, kwargs

        def leave(mod, args, output, name=name):
            return _mark_first_tensor(output, name, False)[0]

        handles.append(module.register_forward_pre_hook(enter, with_kwargs=True))
        handles.append(module.register_forward_hook(leave))
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def strip_boundaries(graph: fx.Graph) -> None:
    """Tag each FX node between a module's entry and exit markers with the module's name (`META_KEY`)
    and, inside a part entered once, the part's (`PART_KEY`), then remove the markers (their users read
    the marked tensor)."""
    inside: list[str] = []
    markers, entries = [], Counter()
    for n in graph.nodes:
        if n.op == "call_function" and n.target is BOUNDARY:
            markers.append(n)
            _, name, enter = n.args
            if enter:
                inside.append(name)
                entries[name] += 1
            elif name in inside:
                del inside[inside.index(name):]
        elif n.op == "call_function" and inside:
            n.meta[META_KEY] = inside[0]
            if len(inside) > 1:
                n.meta[PART_KEY] = inside[1]
    for n in graph.nodes:
        if entries[n.meta.get(PART_KEY)] > 1:
            del n.meta[PART_KEY]
    for n in markers:
        n.replace_all_uses_with(n.args[0])
        graph.erase_node(n)
