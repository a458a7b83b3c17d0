"""Callables running one operator node of a captured graph alone (profiling, variant checks): its
default implementation (`node_function`) or an implementation variant (`variant_function`)."""

from __future__ import annotations

import operator
from typing import Callable

from torch import fx

from memplan.runtime.format.graph import OpGraph
from memplan.runtime.tracing.program import CaptureError, Program
from memplan.runtime.variants.rules import emit_variant
from memplan.runtime.variants.offered import graph_variants


def _program(graph: OpGraph) -> Program:
    if not isinstance(graph.program, Program):
        raise CaptureError("this graph has no captured program (it was loaded from JSON); run "
                           "runtime.capture(model, loss_fn, batch) to get an executable graph.")
    return graph.program


def node_function(graph: OpGraph, node_id: int) -> fx.GraphModule:
    """A callable `f(*inputs) -> tuple(outputs)` running operator node `node_id` alone: inputs are the
    tensors of `nodes[node_id].inputs` (graph values, in order), outputs those of `.outputs`. Views of
    another node's value that the node reads are re-derived from the value passed in."""
    program = _program(graph)
    _check_node(graph, node_id)
    node = graph.nodes[node_id]
    g = fx.Graph()
    placeholder = {v: g.placeholder(f"v{v}") for v in node.inputs}
    env: dict[fx.Node, fx.Node] = {}
    resolve = _replayer(program, g, placeholder, env)
    for m in program.groups[node_id]:
        env[m] = g.node_copy(m, resolve)
    g.output(tuple(_value_node(program, g, env, v) for v in node.outputs))
    return fx.GraphModule(program.gm, g)


def variant_function(graph: OpGraph, node_id: int, impl: str) -> fx.GraphModule:
    """Like `node_function`, for node `node_id` run as implementation variant `impl` (runtime.variants.offered):
    `f(*inputs) -> tuple(outputs)` with the tensors of the variant spec's `inputs` and `outputs` (variant
    values such as a mask included). The default variant is `node_function`."""
    program = _program(graph)
    _check_node(graph, node_id)
    variants = graph_variants(graph)
    spec = variants.spec(node_id, impl)
    if spec is None:
        return node_function(graph, node_id)
    g = fx.Graph()
    placeholder = {v: g.placeholder(f"v{v}") for v in spec.inputs}
    env: dict[fx.Node, fx.Node] = {}
    made = emit_variant(g, graph, variants, spec, env, _replayer(program, g, placeholder, env), placeholder)
    g.output(tuple(made[v] if v in made else _value_node(program, g, env, v) for v in spec.outputs))
    return fx.GraphModule(program.gm, g)


def _check_node(graph: OpGraph, node_id: int) -> None:
    if not 0 <= node_id < len(graph.nodes):
        raise IndexError(f"node id {node_id} is out of range 0..{len(graph.nodes) - 1}.")


def _replayer(program: Program, g: fx.Graph, placeholder: dict[int, fx.Node],
              env: dict[fx.Node, fx.Node]) -> Callable[[fx.Node], fx.Node]:
    """Resolve a captured FX node read by a lone node: its value's placeholder, or a view of another
    node's value replayed from its base."""
    def resolve(a: fx.Node) -> fx.Node:
        if a not in env:
            v = program.value_of.get(a)
            if v in placeholder and program.primary[v] is a:
                env[a] = placeholder[v]
            else:                                          # a view: replay it from its base
                env[a] = g.node_copy(a, resolve)
        return env[a]
    return resolve


def _value_node(program: Program, g: fx.Graph, env: dict[fx.Node, fx.Node], v: int) -> fx.Node:
    """The node of `g` holding graph value `v` of a group copied into `env`."""
    where = program.primary[v]
    if isinstance(where, fx.Node):
        return env[where]
    tup, idx = where
    return g.call_function(operator.getitem, (env[tup], idx))
