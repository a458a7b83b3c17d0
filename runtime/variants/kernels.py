"""Kernels of the implementation variants of `runtime.variants.offered`: the torch functions that the code
`runtime.variants.ops` emits calls (packing and unpacking ReLU bit masks, normalization backwards from the
output, max-pool window positions, math-backend attention, a convolution backward without oneDNN). Plain
eager functions of tensors; what they compute and why it matches ATen is in docs/plan-format.md.
"""

from __future__ import annotations

import torch

aten = torch.ops.aten


class VariantError(ValueError):
    """A plan's implementation variant that cannot run on the captured program."""


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


def convolution_backward_native(*args):
    """`aten.convolution_backward(*args)` with oneDNN disabled for this call (rule `native`): ATen's CPU
    backend then runs its native kernel; the flag is restored even if the call raises."""
    enabled = torch._C._get_mkldnn_enabled()
    torch._C._set_mkldnn_enabled(False)
    try:
        return aten.convolution_backward.default(*args)
    finally:
        torch._C._set_mkldnn_enabled(enabled)
