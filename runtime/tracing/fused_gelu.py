"""The tanh GELU, fewer saved tensors: three ops `runtime.capture` rewrites the written-out GELU into.

transformers' GPT-2 family computes its GELU as `0.5 * x * (1 + tanh(c * (x + k * x ** 3)))`
(`gelu_new`). AOTAutograd captures eight forward ops, four of whose results the backward keeps (`x`,
`0.5 x`, `tanh`, `1 + tanh`), and eleven backward ops. The ops below run those same ATen kernels on the
same operands, so their results are bit-identical (tested); they only keep fewer values and reuse
storage:

- `memplan::gelu_tanh_inner(x)` is the tanh: its argument is built in the result's storage and the tanh
  runs in place over it.
- `memplan::gelu_tanh_outer(x, tanh)` is the GELU's output. It is an op of its own so that a planner can
  keep the tanh and recompute the output cheaply (one pass), or the other way round.
- `gelu_tanh_inner_by_sigmoid` (not an op of its own: the code of implementation variant `sigmoid`,
  runtime/variants/offered.py) computes the same tanh as `2 sigmoid(2 z) - 1` (`tanh_by_sigmoid`, which the
  variant also runs for a plain `aten.tanh`). ATen's CPU tanh takes about 3 ns
  an element here, its sigmoid about 1 ns, so this runs about 2.4x faster; it is within 2.5e-7 of the tanh,
  not bit-identical.
- `memplan::gelu_tanh_backward(grad, x, tanh)` is the input gradient, in one x-sized result. It recomputes
  `0.5 x` and `1 + tanh` (one cheap op each), so the backward keeps `x` and the tanh only: two x-sized
  tensors fewer from the forward to the backward. The whole-tensor steps (`grad * 0.5 x`,
  `tanh_backward`, the scale) run over the result in place; the rest runs a block at a time.

Blockwise steps run through scratch blocks of a multiple of `BLOCK_ELEMENTS` elements, so every element
takes the kernels' vectorized or scalar path as it does over the whole tensor; only exactly rounded
multiplications and additions run blockwise (the tanh and its derivative, where a compiler may fuse a
multiply-add in one path and not the other, run over the whole tensor). Every byte an op allocates is
in its result, where planners and the meter count it: the scratch blocks lead the storage of the
output (one block) and of the input gradient (two), as runtime/tracing/fused_loss.py's `scratch_ahead` lays out.
"""

from __future__ import annotations

import torch

from memplan.runtime.tracing.fused_loss import scratch_ahead

aten = torch.ops.aten

BLOCKS = 16
"""Blockwise steps run in at most this many blocks ..."""
BLOCK_ELEMENTS = 256
"""... of a multiple of this many elements (a multiple of every CPU vector loop's stride)."""


def block_elements(n: int) -> int:
    """Elements per block of a blockwise step over `n` elements."""
    return max(BLOCK_ELEMENTS, -(-n // BLOCKS // BLOCK_ELEMENTS) * BLOCK_ELEMENTS)


def _with_scratch(x: torch.Tensor, blocks: int) -> tuple[list[torch.Tensor], torch.Tensor]:
    """(`blocks` flat scratch blocks, an x-shaped contiguous result) of one new storage (`scratch_ahead`)."""
    n = x.numel()
    step = min(block_elements(n), n)
    scratch, result = scratch_ahead(x, blocks * step, n)
    return list(scratch.split(step)), result.view(x.shape)


def _blocks(*tensors: torch.Tensor) -> list[tuple[torch.Tensor, ...]]:
    """Per tensor (contiguous, of one size), its flat blocks for a blockwise step."""
    return [flat.split(block_elements(flat.numel())) for flat in (t.view(-1) for t in tensors)]


@torch.library.custom_op("memplan::gelu_tanh_inner", mutates_args=())
def gelu_tanh_inner(x: torch.Tensor, power: float, coeff: float, scale: float) -> torch.Tensor:
    """`tanh((x + x ** power * coeff) * scale)` of a contiguous `x`, each step in the result's storage."""
    t = torch.pow(x, power)
    torch.mul(t, coeff, out=t)
    torch.add(x, t, out=t)
    torch.mul(t, scale, out=t)
    return torch.tanh(t, out=t)


@gelu_tanh_inner.register_fake
def _(x, power, coeff, scale):
    return torch.empty_like(x)


def tanh_by_sigmoid(z: torch.Tensor, scale: float = 1.0, out: torch.Tensor | None = None) -> torch.Tensor:
    """tanh(scale z) by the identity tanh(y) = 2 sigmoid(2 y) - 1, each step in the result's storage (`out`,
    which may be `z` itself; a new tensor when None)."""
    t = torch.mul(z, 2.0 * scale) if out is None else torch.mul(z, 2.0 * scale, out=out)
    torch.sigmoid(t, out=t)
    torch.mul(t, 2.0, out=t)
    return torch.sub(t, 1.0, out=t)


def gelu_tanh_inner_by_sigmoid(x: torch.Tensor, power: float, coeff: float, scale: float) -> torch.Tensor:
    """`gelu_tanh_inner`'s value, `tanh((x + x ** power * coeff) * scale)`, with the tanh by `tanh_by_sigmoid`;
    each step in the result's storage."""
    t = torch.pow(x, power)
    torch.mul(t, coeff, out=t)
    torch.add(x, t, out=t)
    return tanh_by_sigmoid(t, scale, out=t)


@torch.library.custom_op("memplan::gelu_tanh_outer", mutates_args=())
def gelu_tanh_outer(x: torch.Tensor, t: torch.Tensor, half: float, one: float) -> torch.Tensor:
    """`(x * half) * (t + one)`: `t + one` into the result, then a block at a time `x * half` into the
    scratch block and the product into the result."""
    (scratch,), y = _with_scratch(x, 1)
    torch.add(t, one, out=y)
    for x_b, y_b in zip(*_blocks(x, y)):
        half_x = scratch[:x_b.shape[0]]
        torch.mul(x_b, half, out=half_x)
        torch.mul(half_x, y_b, out=y_b)
    return y


@gelu_tanh_outer.register_fake
def _(x, t, half, one):
    return _with_scratch(x, 1)[1]


@torch.library.custom_op("memplan::gelu_tanh_backward", mutates_args=())
def gelu_tanh_backward(grad: torch.Tensor, x: torch.Tensor, t: torch.Tensor, half: float, power: float,
                       coeff: float, scale: float, one: float) -> torch.Tensor:
    """The gradient of `gelu_tanh_outer(x, gelu_tanh_inner(x, ...), ...)` for output gradient `grad`, given
    the tanh `t`, each step the ATen op autograd's backward of the written-out GELU runs: `a = grad *
    (x * half)`, `d = tanh_backward(a, t) * scale`, then `d + (d * coeff) * (x ** (power - 1) * power)`
    plus `(grad * (t + one)) * half`."""
    (s, u), r = _with_scratch(x, 2)
    torch.mul(x, half, out=r)
    torch.mul(grad, r, out=r)
    aten.tanh_backward.grad_input(r, t, grad_input=r)
    torch.mul(r, scale, out=r)
    for r_b, x_b, t_b, g_b in zip(*_blocks(r, x, t, grad)):
        s_b, u_b = s[:r_b.shape[0]], u[:r_b.shape[0]]
        torch.mul(r_b, coeff, out=s_b)
        torch.pow(x_b, power - 1, out=u_b)
        torch.mul(u_b, power, out=u_b)
        torch.mul(s_b, u_b, out=s_b)
        torch.add(r_b, s_b, out=r_b)
        torch.add(t_b, one, out=s_b)
        torch.mul(g_b, s_b, out=s_b)
        torch.mul(s_b, half, out=s_b)
        torch.add(r_b, s_b, out=r_b)
    return r


@gelu_tanh_backward.register_fake
def _(grad, x, t, half, power, coeff, scale, one):
    return _with_scratch(x, 2)[1]
