"""Code of the implementation variants of `runtime.variants`: the FX nodes a variant step emits.

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


def dense_order(shape, stride) -> list[int] | None:
    """The dimensions of a tensor of `shape` and `stride` from outermost to innermost in memory, if its
    elements fill their storage span without gaps or overlaps (then `t.permute(order).view(-1)` lists them
    in memory order); None otherwise."""
    order = sorted(range(len(shape)), key=lambda d: -stride[d])
    expected = 1
    for d in reversed(order):
        if shape[d] != 1 and stride[d] != expected:
            return None
        expected *= shape[d]
    return order


def pack_zero_bits(x: torch.Tensor, low: float, high: float | None, order: list[int]) -> torch.Tensor:
    """Rule `bitmask`'s forward: the zero-gradient mask `x <= low` (or `x <= low or x >= high`) packed 1 bit per
    element: element j (in memory order, `order` from `dense_order`) is bit j % 8 of byte j // 8, ceil(n / 8)
    bytes. Bit k of every byte comes from the strided slice `flat[k::8]`, compared into one packed-size
    temporary (hardtanh: two) and added in with weight 2^k, so no full-size mask is ever allocated."""
    flat = x.permute(order).view(-1)
    size = (flat.numel() + 7) // 8
    packed = torch.empty(size, dtype=torch.uint8, device=x.device)
    bits = torch.empty(size, dtype=torch.uint8, device=x.device)
    upper = torch.empty(size, dtype=torch.bool, device=x.device) if high is not None else None
    for k in range(8):
        part = flat[k::8]
        n = part.numel()                       # ceil((numel - k) / 8): the first slice fills every byte
        into = (packed if k == 0 else bits)[:n].view(torch.bool)
        torch.le(part, low, out=into)
        if upper is not None:
            into.logical_or_(torch.ge(part, high, out=upper[:n]))
        if k:
            packed[:n].add_(bits[:n], alpha=1 << k)
    return packed


def unpack_zero_bits(packed: torch.Tensor, shape: list[int], stride: list[int], order: list[int]) -> torch.Tensor:
    """Rule `bitmask`'s backward: the bool mask of `pack_zero_bits`, laid out as the forward input (`shape`,
    `stride`); the one temporary of the backward (numel bytes), each bit shifted straight into its bytes."""
    mask = torch.empty_strided(shape, stride, dtype=torch.bool, device=packed.device)
    flat = mask.permute(order).view(-1).view(torch.uint8)
    for k in range(8):
        part = flat[k::8]
        torch.bitwise_right_shift(packed[:part.numel()], k, out=part)
        part.bitwise_and_(1)
    return mask


def masked_fill_holding(grad: torch.Tensor, mask: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    """`masked_fill(grad, mask, 0.0)`, holding the packed mask until the gradient is allocated: a step's
    inputs stay live through the step in the memory model (the executor would otherwise free the packed
    mask right after unpacking it, at its last read, and the step's peak would fall below the simulated one)."""
    return aten.masked_fill.Scalar(grad, mask, 0.0)


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


def _nonzero_scale(weight: torch.Tensor) -> None:
    torch._assert_async(weight.ne(0).all(), "an output-activated normalization backward needs every weight "
                                            "(gamma) nonzero to reconstruct its normalized input; run it as default")


def batch_norm_backward_from_output(grad: torch.Tensor, y: torch.Tensor, weight: torch.Tensor | None,
                                    bias: torch.Tensor | None, invstd: torch.Tensor, output_mask: list[bool]):
    """Training BatchNorm backward from its output y (in-place activated BatchNorm, Bulo et al. 2018):
    with x_hat = (y - beta) / gamma and per-channel sums over the n elements of a channel,
        d_beta = sum(dy),  d_gamma = sum(dy * x_hat) = (sum(dy * y) - beta * d_beta) / gamma,
        dx = gamma * invstd * (dy - d_beta / n - x_hat * d_gamma / n),
    computed as dx = a * dy + b * y + c with per-channel a, b, c: no full-size temporary besides dx."""
    c = y.shape[1]
    n = y.numel() // c
    shape = [1, c] + [1] * (y.dim() - 2)
    g3, y3 = grad.reshape(grad.shape[0], c, -1), y.reshape(y.shape[0], c, -1)
    sum_dy = g3.sum((0, 2))
    dot = torch.matmul(g3.unsqueeze(2), y3.unsqueeze(3)).sum((0, 2, 3))        # sum(dy * y) per channel
    w = torch.ones_like(sum_dy) if weight is None else weight
    b = torch.zeros_like(sum_dy) if bias is None else bias
    _nonzero_scale(w)
    sum_dy_xhat = (dot - b * sum_dy) / w
    grad_input = None
    if output_mask[0]:
        scale = invstd * w
        k = sum_dy_xhat / n
        grad_input = torch.mul(grad, scale.view(shape))
        grad_input.addcmul_(y, (-scale * k / w).view(shape))
        grad_input.add_((scale * (k * b / w - sum_dy / n)).view(shape))
    return (grad_input, sum_dy_xhat if output_mask[1] else None, sum_dy if output_mask[2] else None)


def layer_norm_backward_from_output(grad: torch.Tensor, y: torch.Tensor, normalized_shape: list[int],
                                    rstd: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
                                    output_mask: list[bool]):
    """LayerNorm backward from its output y: with x_hat = (y - beta) / gamma and per-row means over the D
    normalized elements, m1 = mean(dy * gamma), m2 = mean(dy * gamma * x_hat) = mean(dy * (y - beta)):
        dx = rstd * (dy * gamma - m1 - x_hat * m2),  d_gamma = sum_rows(dy * x_hat),  d_beta = sum_rows(dy).
    dx is built in its own buffer (x_hat first, then in place); row sums of products are matrix products and
    the column sums run over row blocks, so no other full-size temporary is made."""
    d = 1
    for s in normalized_shape:
        d *= s
    rows = y.numel() // d
    g2, y2 = grad.reshape(rows, d), y.reshape(rows, d)
    w = y.new_ones(d) if weight is None else weight.reshape(d)
    b = y.new_zeros(d) if bias is None else bias.reshape(d)
    _nonzero_scale(w)
    grad_input = grad_weight = None
    if output_mask[0]:
        m1 = torch.mv(g2, w).div_(d)
        m2 = torch.matmul(g2.unsqueeze(1), y2.unsqueeze(2)).view(rows).sub_(torch.mv(g2, b)).div_(d)
        grad_input = torch.sub(y2, b).div_(w)
        grad_input.mul_(m2.neg_().unsqueeze(1)).addcmul_(g2, w).sub_(m1.unsqueeze(1))
        grad_input.mul_(rstd.reshape(rows, 1))
        grad_input = grad_input.view(y.shape)
    sum_dy = g2.sum(0) if output_mask[1] or output_mask[2] else None
    if output_mask[1]:
        block = max(1, 65536 // d)
        dot = torch.zeros_like(w)
        for start in range(0, rows, block):
            dot += (g2[start:start + block] * y2[start:start + block]).sum(0)
        grad_weight = ((dot - b * sum_dy) / w).view(weight.shape)
    return grad_input, grad_weight, (sum_dy.view(bias.shape) if output_mask[2] else None)


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


def window_positions(indices: torch.Tensor, width: int, kernel: list[int], stride: list[int],
                     padding: list[int], dilation: list[int]) -> torch.Tensor:
    """Max-pool indices (flat positions h * W + w in the input plane) as 1-byte positions in the pooling
    window: ((h - h0) / dh) * kw + (w - w0) / dw, with (h0, w0) = output position * stride - padding.
    Overwrites `indices` (a temporary of the variant); one more int64 temporary."""
    oh, ow = indices.shape[-2:]
    h = torch.div(indices, width, rounding_mode="floor")
    w = indices.sub_(h, alpha=width)
    h.sub_((torch.arange(oh, device=h.device) * stride[0] - padding[0]).view(oh, 1))
    w.sub_(torch.arange(ow, device=w.device) * stride[1] - padding[1])
    if dilation[0] > 1:
        h.div_(dilation[0], rounding_mode="floor")
    if dilation[1] > 1:
        w.div_(dilation[1], rounding_mode="floor")
    return h.mul_(kernel[1]).add_(w).to(torch.uint8)


def max_pool_backward_from_windows(grad: torch.Tensor, windows: torch.Tensor, input_shape: list[int],
                                   kernel: list[int], stride: list[int], padding: list[int], dilation: list[int],
                                   ceil_mode: bool) -> torch.Tensor:
    """ATen's max-pool backward on the flat indices rebuilt from window positions (`window_positions`) in one
    int64 buffer; the input is passed as a zero-stride tensor of its shape (the kernel reads only its shape)."""
    oh, ow = windows.shape[-2:]
    width = input_shape[-1]
    rows = torch.div(windows, kernel[1], rounding_mode="floor")               # uint8
    indices = windows.to(torch.int64).sub_(rows, alpha=kernel[1])             # column in the window
    indices.mul_(dilation[1]).add_(torch.arange(ow, device=windows.device) * stride[1] - padding[1])
    indices.add_(rows, alpha=dilation[0] * width)
    del rows
    indices.add_(((torch.arange(oh, device=windows.device) * stride[0] - padding[0]) * width).view(oh, 1))
    shape_only = grad.new_zeros(()).expand(input_shape)
    return aten.max_pool2d_with_indices_backward(grad, shape_only, kernel, stride, padding, dilation, ceil_mode,
                                                 indices)


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


def _strided_like(t: torch.Tensor, stride: list[int]) -> torch.Tensor:
    """`t` with the strides the captured op's result had (later views of it depend on them)."""
    if list(t.stride()) == list(stride):
        return t
    return torch.empty_strided(t.shape, stride, dtype=t.dtype, device=t.device).copy_(t)


def _grouped(t: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """A (batch, heads, rows, d) query-side tensor as (batch, kv_heads, groups * rows, d): the heads that
    share one key/value head stacked along the rows (grouped-query attention: query head h reads key/value
    head h // groups, as ATen's `enable_gqa` repeats them). A view where the strides allow, else a copy."""
    b, heads, rows, d = t.shape
    return t.reshape(b, kv_heads, heads // kv_heads * rows, d)


def _kv_heads(q: torch.Tensor, k: torch.Tensor) -> int:
    """The key/value head count of attention over `q` and `k`: it must divide the query head count."""
    heads, kv_heads = q.shape[-3], k.shape[-3]
    if q.dim() != 4 or k.dim() != 4 or heads % kv_heads:
        raise VariantError(f"attention over a query of shape {list(q.shape)} and a key of shape {list(k.shape)}: "
                           f"the math variant needs 4-d (batch, heads, length, dim) operands whose key/value head "
                           f"count divides the query's; run attention as the default variant.")
    return kv_heads


def attention_math_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool,
                           attn_mask: torch.Tensor | None, scale: float | None, out_stride: list[int],
                           probs_shape: list[int]):
    """Scaled dot-product attention as P = softmax(q k^T * scale + mask), out = P v; returns (out, P).
    With fewer key/value heads than query heads (grouped-query or multi-query attention), each key/value
    head serves its group of query heads (`_grouped`), without repeating keys and values."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    kv_heads = _kv_heads(q, k)
    scores = torch.matmul(_grouped(q, kv_heads), k.transpose(-2, -1)).mul_(scale)
    scores = scores.view(*q.shape[:-1], k.shape[-2])
    if list(scores.shape) != list(probs_shape):
        raise VariantError(f"the attention probabilities have shape {list(scores.shape)}, the graph's variant "
                           f"declares {list(probs_shape)}; run attention as the default variant.")
    if is_causal:
        length, keys = scores.shape[-2:]
        scores.masked_fill_(torch.ones(length, keys, dtype=torch.bool, device=q.device).triu_(1), float("-inf"))
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            scores.masked_fill_(attn_mask.logical_not(), float("-inf"))
        else:
            scores.add_(attn_mask)
    probs = torch.softmax(scores, -1)
    del scores
    out = torch.matmul(_grouped(probs, kv_heads), v).view(*q.shape[:-1], v.shape[-1])
    return _strided_like(out, out_stride), probs


def attention_math_backward(grad: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                            probs: torch.Tensor, scale: float | None, strides: list[list[int]]):
    """Backward of `attention_math_forward` from P: dV = P^T dO, dP = dO V^T,
    dS = P * (dP - rowsum(dP * P)) * scale, dQ = dS K, dK = dS^T Q; with grouped key/value heads the
    products over a group's stacked rows sum dK and dV over the query heads sharing each key/value head."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    kv_heads = _kv_heads(q, k)
    grad_g, probs_g = _grouped(grad, kv_heads), _grouped(probs, kv_heads)
    grad_v = _strided_like(torch.matmul(probs_g.transpose(-2, -1), grad_g), strides[2])
    ds = torch.matmul(grad_g, v.transpose(-2, -1))
    del grad_g
    ds.sub_(torch.matmul(ds.unsqueeze(-2), probs_g.unsqueeze(-1)).squeeze(-1)).mul_(probs_g).mul_(scale)
    grad_q = _strided_like(torch.matmul(ds, k).view(q.shape), strides[0])
    grad_k = _strided_like(torch.matmul(ds.transpose(-2, -1), _grouped(q, kv_heads)), strides[1])
    return grad_q, grad_k, grad_v


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
