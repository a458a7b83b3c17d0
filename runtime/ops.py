"""The ops a graph's node targets name, and the facts about them a graph records at capture
(`meta["random_nodes"]`, `meta["in_place"]`), so that solving a graph loaded from JSON needs no torch."""

from __future__ import annotations

import torch

from runtime import dropout, fused_gelu, fused_loss, modules  # noqa: F401  (register the memplan:: ops)
from runtime.graph import OpGraph


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
