"""Code of the implementation variants of `runtime.variants`: the FX nodes a variant step emits (calling
the kernels of `runtime.variant_kernels`).

`emit_variant(...)` runs node `spec.node` as variant `spec` inside an FX graph being built: the rule's
emitter (`RULES[spec.rule]`) copies or replaces the FX nodes of the node's captured group, filling `env`
(captured FX node -> its copy), so later readers find the node's graph values as for a default step,
and returns the FX nodes of the variant values it allocates, by value id. The executor and
`runtime.node_functions.variant_function` share it.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from functools import cached_property
from typing import Callable, Mapping

import torch
from torch import fx

from runtime.fused_gelu import gelu_tanh_inner_by_sigmoid, tanh_by_sigmoid
from runtime.graph import OpGraph
from runtime.variant_kernels import (VariantError, attention_math_backward, attention_math_forward,
                                     batch_norm_backward_from_output, dense_order, layer_norm_backward_from_output,
                                     masked_fill_holding, max_pool_backward_from_windows, pack_zero_bits,
                                     unpack_zero_bits, window_positions)
from runtime.variants import GraphVariants, VariantSpec

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
        mask = _mask_view(step, step.values[_mask_input(step)])
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


def _mask_view(step: VariantStep, mask: fx.Node) -> fx.Node:
    """`mask`, viewed as the backward views the activation it replaces (usually not at all)."""
    program = step.graph.program
    saved = step.head.args[1]
    value = program.value_of[saved]
    base = program.primary[value]

    def rebase(a: fx.Node) -> fx.Node:
        if a is base:
            return mask
        if program.value_of.get(a) == value:
            return step.g.node_copy(a, rebase)
        return step.resolve(a)

    return rebase(saved)


def _bitmask(step: VariantStep) -> dict[int, fx.Node]:
    """Rule `bitmask` (runtime.variants): rule `mask` with the mask packed 1 bit per element
    (`pack_zero_bits` / `unpack_zero_bits`); the backward then runs the same `masked_fill`."""
    target = step.head.target
    forward = step.head if target in (aten.relu.default, aten.hardtanh.default) else \
        head_node(step.graph, step.variants.value(step.graph, _mask_input(step)).producer)
    if forward.target not in (aten.relu.default, aten.hardtanh.default):
        raise VariantError(f"variant 'bitmask' of node {step.spec.node} ({step.head.name}) runs {target}, which is "
                           f"not ReLU, hardtanh or their backward; the graph's variants do not match its program.")
    x = forward.args[0].meta["val"]
    order = _bit_order(step, forward)
    if step.head is forward:
        step.copy_group()
        low, high = (0, None) if target is aten.relu.default else (_arg(forward, 1), _arg(forward, 2))
        return {step.spec.outputs[-1]: step.call(pack_zero_bits, step.resolve(forward.args[0]), low, high, order)}
    if target in (aten.threshold_backward.default, aten.hardtanh_backward.default):
        _check_backward(step)
        packed = step.values[_mask_input(step)]
        mask = _mask_view(step, step.call(unpack_zero_bits, packed, list(x.shape), list(x.stride()), order))
        step.copy_group(lambda: step.call(masked_fill_holding, step.resolve(step.head.args[0]), mask, packed))
        return {}
    raise VariantError(f"variant 'bitmask' of node {step.spec.node} ({step.head.name}) runs {target}, which is "
                       f"not the backward of {forward.name}; the graph's variants do not match its program.")


def _bit_order(step: VariantStep, forward: fx.Node) -> list[int]:
    """The memory order of the input of ReLU / hardtanh `forward`, in which its bit mask is packed."""
    x = forward.args[0].meta["val"]
    order = dense_order(list(x.shape), list(x.stride()))
    if order is None:
        raise VariantError(f"node {step.spec.node} ({step.head.name}): the input of {forward.name} has strides "
                           f"{list(x.stride())} with gaps or overlaps, which a bit mask in memory order cannot "
                           f"mirror; run it as the default or `mask` variant.")
    return order


def _in_place(step: VariantStep) -> dict[int, fx.Node]:
    """Rule `inplace` (runtime.variants): `relu_(x)` in place of `relu(x)`; `mask-inplace` / `bitmask-inplace`
    first compute the mask of rule `mask` (`le(x, 0)`) / `bitmask` (`pack_zero_bits`) from x, so the step holds
    x (then the output in its storage) and the mask, as the simulator charges."""
    head, spec = step.head, step.spec
    if head.target is not aten.relu.default:
        raise VariantError(f"variant {spec.name!r} of node {spec.node} ({head.name}) runs {head.target}, which is "
                           f"not ReLU; the graph's variants do not match its captured program.")
    x = step.resolve(head.args[0])
    made = {}
    masks = {s.outputs[-1]: s.rule for s in step.variants.specs[spec.node].values() if s.rule in ("mask", "bitmask")}
    for v in spec.outputs[1:]:
        if masks.get(v) == "mask":
            made[v] = step.call(aten.le.Scalar, x, 0)
        elif masks.get(v) == "bitmask":
            made[v] = step.call(pack_zero_bits, x, 0, None, _bit_order(step, head))
        else:
            raise VariantError(f"variant {spec.name!r} of node {spec.node} ({head.name}) allocates value {v}, which "
                               f"is neither its `mask` nor its `bitmask`; the graph's variants do not match.")
    step.copy_group(lambda: step.call(aten.relu_.default, x))
    return made


def _graph_value(step: VariantStep, value: int) -> fx.Node:
    """The FX node (in `g`) of graph value `value`, which the step reads."""
    return step.resolve(step.graph.program.primary[value])


def _norm_output(step: VariantStep) -> dict[int, fx.Node]:
    """Rule `output` (runtime.variants): the normalization backward reads the forward's output, not its input."""
    head, graph = step.head, step.graph
    if head.target is aten.native_batch_norm_backward.default:
        invstd = head.args[6]
        if not _arg(head, 7):
            raise VariantError(f"node {step.spec.node} ({head.name}) is an evaluation-mode BatchNorm backward; the "
                               f"output-activated variant needs batch statistics. Run it as the default variant.")
    elif head.target is aten.native_layer_norm_backward.default:
        invstd = head.args[4]
    else:
        raise VariantError(f"variant 'output' of node {step.spec.node} ({head.name}) runs {head.target}, which is "
                           f"not a BatchNorm or LayerNorm backward; the graph's variants do not match its program.")
    forward = graph.values[graph.program.value_of[invstd]].producer
    f = head_node(graph, forward)
    y = _graph_value(step, graph.nodes[forward].outputs[0])
    if head.target is aten.native_batch_norm_backward.default:
        weight, bias = _arg(f, 1), _arg(f, 2)
        call = lambda: step.call(batch_norm_backward_from_output, step.resolve(head.args[0]), y,  # noqa: E731
                                 _maybe(step, weight), _maybe(step, bias), step.resolve(invstd), _arg(head, 9))
    else:
        call = lambda: step.call(layer_norm_backward_from_output, step.resolve(head.args[0]), y,  # noqa: E731
                                 _arg(head, 2), step.resolve(invstd), _maybe(step, _arg(head, 5)),
                                 _maybe(step, _arg(head, 6)), _arg(head, 7))
    step.copy_group(call)
    return {}


def _maybe(step: VariantStep, a):
    return step.resolve(a) if isinstance(a, fx.Node) else a


def _pair(v, n: int = 2) -> list[int]:
    return list(v) * (n // len(v)) if isinstance(v, (list, tuple)) else [v] * n


def _pool_args(head: fx.Node) -> tuple[list[int], list[int], list[int], list[int]]:
    """kernel, stride, padding, dilation of a max_pool2d_with_indices(_backward) call, as pairs."""
    offset = 1 if head.target is aten.max_pool2d_with_indices.default else 2
    kernel = _pair(_arg(head, offset))
    stride = _pair(_arg(head, offset + 1)) if _arg(head, offset + 1) else kernel
    return kernel, stride, _pair(_arg(head, offset + 2)), _pair(_arg(head, offset + 3))


def _compact(step: VariantStep) -> dict[int, fx.Node]:
    """Rule `compact` (runtime.variants): max-pool indices kept as uint8 window positions."""
    head, graph = step.head, step.graph
    kernel, stride, padding, dilation = _pool_args(head)
    if kernel[0] * kernel[1] > 256:
        raise VariantError(f"node {step.spec.node} ({head.name}) pools {kernel} windows, more positions than one "
                           f"byte holds; run it as the default variant.")
    if head.target is aten.max_pool2d_with_indices.default:
        step.copy_group()
        indices = step.env[graph.program.primary[graph.nodes[step.spec.node].outputs[1]]]
        width = head.args[0].meta["val"].shape[-1]
        return {step.spec.outputs[-1]: step.call(window_positions, indices, width, kernel, stride, padding, dilation)}
    if head.target is aten.max_pool2d_with_indices_backward.default:
        windows = step.values[next(v for v in step.spec.inputs if v >= step.variants.num_graph_values)]
        shape = list(head.args[1].meta["val"].shape)
        step.copy_group(lambda: step.call(max_pool_backward_from_windows, step.resolve(head.args[0]), windows, shape,
                                          kernel, stride, padding, dilation, _arg(head, 6)))
        return {}
    raise VariantError(f"variant 'compact' of node {step.spec.node} ({head.name}) runs {head.target}, which is not "
                       f"a 2-d max-pool or its backward; the graph's variants do not match its program.")


def _math(step: VariantStep) -> dict[int, fx.Node]:
    """Rule `math` (runtime.variants): attention by the math backend instead of the fused flash kernel."""
    head = step.head
    if _arg(head, 3 if "backward" not in head.target.name() else 6) != 0:
        raise VariantError(f"node {step.spec.node} ({head.name}) runs attention with dropout; the math variant "
                           f"would draw another dropout mask. Run it as the default variant.")
    if head.target is aten._scaled_dot_product_flash_attention_for_cpu.default:
        probs_value = step.variants.value(step.graph, step.spec.outputs[-1])
        made = {}

        def forward():
            made["call"] = step.call(attention_math_forward, *(step.resolve(a) for a in head.args[:3]), _arg(head, 4),
                                     _maybe(step, _arg(head, 5)), _arg(head, 6),
                                     list(head.meta["val"][0].stride()), list(probs_value.shape))
            return made["call"]
        step.copy_group(forward)
        return {probs_value.id: step.call(operator.getitem, made["call"], 1)}
    if head.target is aten._scaled_dot_product_flash_attention_for_cpu_backward.default:
        probs = step.values[next(v for v in step.spec.inputs if v >= step.variants.num_graph_values)]
        step.copy_group(lambda: step.call(attention_math_backward, *(step.resolve(a) for a in head.args[:4]), probs,
                                          _arg(head, 9), [list(t.stride()) for t in head.meta["val"]]))
        return {}
    raise VariantError(f"variant 'math' of node {step.spec.node} ({head.name}) runs {head.target}, which is not "
                       f"the CPU flash attention or its backward; the graph's variants do not match its program.")


def _sigmoid(step: VariantStep) -> dict[int, fx.Node]:
    """Rule `sigmoid` (runtime.variants): a tanh, or the fused GELU's, as `2 sigmoid(2 z) - 1`."""
    head = step.head
    code = {aten.tanh.default: tanh_by_sigmoid,
            torch.ops.memplan.gelu_tanh_inner.default: gelu_tanh_inner_by_sigmoid}.get(head.target)
    if code is None:
        raise VariantError(f"variant 'sigmoid' of node {step.spec.node} ({head.name}) runs {head.target}, which is "
                           f"neither aten.tanh nor memplan's fused GELU tanh; the graph's variants do not match its "
                           f"program.")
    step.copy_group(lambda: step.call(code, *fx.node.map_arg(head.args, step.resolve)))
    return {}


RULES: dict[str, Callable[[VariantStep], dict[int, fx.Node]]] = {"mask": _mask, "output": _norm_output,
                                                                 "compact": _compact, "math": _math,
                                                                 "bitmask": _bitmask, "inplace": _in_place,
                                                                 "sigmoid": _sigmoid}
