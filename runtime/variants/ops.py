"""What the variant rules' code is written with (torch): `VariantStep`, one variant compute being emitted
into an FX graph, and helpers to read the captured op it replaces (`runtime.variants.rules.emit_variant`).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Callable, Mapping

import torch
from torch import fx

from memplan.runtime.format.graph import OpGraph
from memplan.runtime.variants.kernels import VariantError
from memplan.runtime.variants.spec import GraphVariants, VariantSpec

__all__ = ["VariantError", "VariantStep", "aten", "head_node", "schema_arg"]

aten = torch.ops.aten


def head_node(graph: OpGraph, node: int) -> fx.Node:
    """The allocating FX node of operator node `node` (the one its name comes from)."""
    name = graph.nodes[node].name
    return next(m for m in graph.program.groups[node] if m.name == name)


@dataclass(eq=False)
class VariantStep:
    """One variant compute being emitted into `g`. `resolve` maps a captured FX node the group reads to
    its node in `g`; `values` maps a variant value id the step reads to its (newest) node in `g`."""

    g: fx.Graph
    graph: OpGraph
    variants: GraphVariants
    spec: VariantSpec
    env: dict[fx.Node, fx.Node]
    resolve: Callable[[fx.Node], fx.Node]
    values: Mapping[int, fx.Node]

    @cached_property
    def head(self) -> fx.Node:
        return head_node(self.graph, self.spec.node)

    def copy_group(self, head: Callable[[], fx.Node] | None = None) -> None:
        """Copy the node's FX group into `g`; `head`, if given, emits the replacement of the head op."""
        for m in self.graph.program.groups[self.spec.node]:
            self.env[m] = head() if head is not None and m is self.head else self.g.node_copy(m, self.resolve)

    def call(self, op, *args) -> fx.Node:
        return self.g.call_function(op, args)

    def graph_value(self, value: int) -> fx.Node:
        """The FX node (in `g`) of graph value `value`, which the step reads."""
        return self.resolve(self.graph.program.primary[value])

    def resolve_arg(self, arg):
        """A captured op's argument in `g`: an FX node resolved, a constant as it is."""
        return self.resolve(arg) if isinstance(arg, fx.Node) else arg


def schema_arg(node: fx.Node, index: int):
    """Argument `index` of a captured op call: positional, keyword or the schema's default."""
    arg = node.target._schema.arguments[index]
    if index < len(node.args):
        return node.args[index]
    return node.kwargs.get(arg.name, arg.default_value)
