"""The ops a graph's node targets name, and the facts about them a graph records at capture
(`meta["random_nodes"]`, `meta["in_place"]`), so that solving a graph loaded from JSON needs no torch."""

from __future__ import annotations

from typing import Any, Iterator

import torch

from memplan.runtime.tracing import dropout, fused_gelu, fused_loss, modules  # noqa: F401  (register the memplan:: ops)
from memplan.runtime.format.graph import OpGraph


def op_of(target: str) -> torch._ops.OpOverload | None:
    """The op a node target of a graph (JSON included) names, ATen's or memplan's (`aten.mm.default`,
    `memplan.dropout_mask.default`); None for any other target."""
    namespace, _, name = target.partition(".")
    packet, _, overload = name.partition(".")
    if namespace not in ("aten", "memplan"):
        return None
    op = getattr(getattr(getattr(torch.ops, namespace), packet, None), overload, None)
    return op if isinstance(op, torch._ops.OpOverload) else None


def random_nodes(graph: OpGraph) -> list[int]:
    """Nodes running an op tagged `nondeterministic_seeded` (ATen's, or memplan's `dropout_mask`): they may
    draw from a random generator. A captured program knows more (`runtime.capture` also reads an attention
    op's `dropout_p`, and at 0 the op draws nothing); the JSON graph does not record arguments, so this
    errs on the side of random."""
    found = []
    for node in graph.nodes:
        for target in node.targets:
            op = op_of(target)
            if op is not None and torch.Tag.nondeterministic_seeded in op.tags:
                found.append(node.id)
                break
    return found


def op_name(func: Any) -> str:
    """The op without overload and in-place suffix, as eager calls and traced graphs both name it (eager's
    `bernoulli_.float` is the capture's `bernoulli.p`)."""
    return getattr(func, "_opname", str(func)).rstrip("_")


UNTRACKED_VIEWS = frozenset({"aten::_unsafe_view"})
"""Ops whose result shares its input's storage though the schema declares no alias (autograd does not track
it as a view): `matmul` reshapes its `mm` / `bmm` result so in eager PyTorch, where a traced graph may not."""


def is_view(func: Any) -> bool:
    """Whether every result of `func` aliases an input without writing it (a view allocates nothing),
    `UNTRACKED_VIEWS` included."""
    schema = getattr(func, "_schema", None)
    if getattr(schema, "name", None) in UNTRACKED_VIEWS:
        return True
    returns = getattr(schema, "returns", ())
    return bool(returns) and all(r.alias_info is not None and not r.alias_info.is_write for r in returns)


def allocating_calls(graph: OpGraph) -> Iterator[tuple[Any, Any, int]]:
    """(FX node, ATen op, operator node id) of each non-view ATen call of a captured graph, in graph order."""
    program = graph.program
    group_of = {m: gid for gid, group in enumerate(program.groups) for m in group}
    for m in program.gm.graph.nodes:
        if m.op == "call_function" and isinstance(m.target, torch._ops.OpOverload) and not is_view(m.target) \
                and m in group_of:
            yield m, m.target, group_of[m]
