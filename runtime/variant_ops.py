"""Code of the implementation variants of `runtime.variants`: the FX nodes a variant step emits.

`emit_variant(...)` runs node `spec.node` as variant `spec` inside an FX graph being built: the rule's
emitter (`RULES[spec.rule]`) copies or replaces the FX nodes of the node's captured group, filling `env`
(captured FX node -> its copy), so later readers find the node's graph values as for a default step,
and returns the FX nodes of the variant values it allocates, by value id. The executor and
`runtime.capture.variant_function` share it.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Callable, Mapping

import torch
from torch import fx

from runtime.graph import OpGraph
from runtime.variants import GraphVariants, VariantSpec

aten = torch.ops.aten


class VariantError(ValueError):
    """A plan's implementation variant that cannot run on the captured program."""


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


def emit_variant(g: fx.Graph, graph: OpGraph, variants: GraphVariants, spec: VariantSpec,
                 env: dict[fx.Node, fx.Node], resolve: Callable[[fx.Node], fx.Node],
                 values: Mapping[int, fx.Node]) -> dict[int, fx.Node]:
    """Emit node `spec.node` run as `spec` (module docstring); returns {variant value id: FX node}."""
    emitter = RULES.get(spec.rule)
    if emitter is None:
        raise VariantError(f"node {spec.node} ({graph.nodes[spec.node].name}) runs variant {spec.name!r} of rule "
                           f"{spec.rule!r}, which this runtime has no code for (known: {', '.join(RULES)}). "
                           f"Update memplan or plan without that variant.")
    return emitter(VariantStep(g, graph, variants, spec, env, resolve, values))


def _arg(node: fx.Node, index: int):
    """Argument `index` of a captured op call: positional, keyword or the schema's default."""
    arg = node.target._schema.arguments[index]
    if index < len(node.args):
        return node.args[index]
    return node.kwargs.get(arg.name, arg.default_value)


def _mask(step: VariantStep) -> dict[int, fx.Node]:
    """Rule `mask` (runtime.variants). Forward ReLU: `out = relu(x)`, `mask = le(x, 0)` (the same mask as
    `le(out, 0)`, NaNs included, and read while x is live so the step holds what the simulator charges).
    Forward hardtanh: `mask = le(x, min)`, then `logical_or_(mask, ge(x, max))` (one bool temporary,
    the spec's workspace). Backward: `masked_fill(grad, mask, 0.0)` instead of the threshold/hardtanh backward
    (`where(mask, 0.0, grad)` would also allocate the scalar as a 0-dim tensor the simulator does not charge)."""
    target = step.head.target
    if target in (aten.relu.default, aten.hardtanh.default):
        step.copy_group()
        x = step.resolve(step.head.args[0])
        if target is aten.relu.default:
            mask = step.call(aten.le.Scalar, x, 0)
        else:
            mask = step.call(aten.le.Scalar, x, _arg(step.head, 1))
            step.call(aten.logical_or_.default, mask, step.call(aten.ge.Scalar, x, _arg(step.head, 2)))
        return {step.spec.outputs[-1]: mask}
    if target in (aten.threshold_backward.default, aten.hardtanh_backward.default):
        _check_backward(step)
        mask = _mask_view(step)
        step.copy_group(lambda: step.call(aten.masked_fill.Scalar, step.resolve(step.head.args[0]), mask, 0.0))
        return {}
    raise VariantError(f"variant 'mask' of node {step.spec.node} ({step.head.name}) runs {target}, which is not "
                       f"ReLU, hardtanh or their backward; the graph's variants do not match its captured program.")


def _mask_input(step: VariantStep) -> int:
    return next(v for v in step.spec.inputs if v >= step.variants.num_graph_values)


def _check_backward(step: VariantStep) -> None:
    """The backward's constants must be the ones its forward's mask was computed with."""
    head = step.head
    if head.target is aten.threshold_backward.default:
        if _arg(head, 2) != 0:
            raise VariantError(f"node {step.spec.node} ({head.name}) runs threshold_backward with threshold "
                               f"{_arg(head, 2)}, but the ReLU mask marks out <= 0; run it as the default variant.")
        return
    forward = head_node(step.graph, step.variants.value(step.graph, _mask_input(step)).producer)
    ours, theirs = (_arg(head, 2), _arg(head, 3)), (_arg(forward, 1), _arg(forward, 2))
    if ours != theirs:
        raise VariantError(
            f"node {step.spec.node} ({head.name}) runs hardtanh_backward with min/max {ours}, but the mask it reads "
            f"was computed by {forward.name} with min/max {theirs}; the gradient would differ. Run both nodes as "
            f"the default variant.")


def _mask_view(step: VariantStep) -> fx.Node:
    """The mask, viewed as the backward views the activation it replaces (usually not at all)."""
    program = step.graph.program
    saved = step.head.args[1]
    value = program.value_of[saved]
    base = program.primary[value]
    mask = step.values[_mask_input(step)]

    def rebase(a: fx.Node) -> fx.Node:
        if a is base:
            return mask
        if program.value_of.get(a) == value:
            return step.g.node_copy(a, rebase)
        return step.resolve(a)

    return rebase(saved)


RULES: dict[str, Callable[[VariantStep], dict[int, fx.Node]]] = {"mask": _mask}
