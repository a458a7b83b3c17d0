"""Cross-entropy's logits-sized tensors, fewer: two ops `runtime.capture` rewrites the loss into.

AOTAutograd captures `cross_entropy(x @ W^T, target)` as a forward `mm` (the logits), `_log_softmax`
(the log-probabilities, kept for the backward) and `nll_loss_forward`, and a backward `nll_loss_backward`
(the loss gradient: zeros with one entry per row) read by `_log_softmax_backward_data` (the logits'
gradient). Four logits-sized tensors, three of them live at once around the loss's backward: the peak of
an eager language-model step. Both ops below run those same ATen kernels, so their results are
bit-identical (tested); they only reuse storage:

- `memplan::log_softmax_nll_backward` (the backward pair): the loss gradient goes into the result, and the
  log-softmax backward runs over it in place (each element is read before it is written: a row's sum
  first, then element by element). One logits-sized tensor fewer.
- `memplan::linear_cross_entropy` (the whole loss, where the seed of the backward is `ones_like(loss)`):
  the logits, then the log-probabilities in place over them, the loss, and then, a block of rows at a
  time, the gradient in place over the log-probabilities, each block's loss gradient written into scratch
  rows that share the result's storage (one block: `max(BLOCK_BYTES, 1/BLOCKS)` of the logits, so every
  byte the op allocates is in its results, where planners and the meter count it). The gradient is
  computed in the loss step (the seed is known), so one logits-sized tensor lives from the loss step to
  the backward's matrix products, where there were three.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

aten = torch.ops.aten

BLOCKS = 16
"""`linear_cross_entropy` computes the gradient in at most this many blocks of rows, ..."""
BLOCK_BYTES = 1 << 16
"""... each of at least this many bytes of loss gradient (one row at least), so small losses take one."""
ALIGN = 512
"""A result with scratch ahead of it (the logits, `scratch_ahead`) starts where an allocation of its own
would (CUDA's caching allocator rounds blocks to 512 bytes, the CPU allocator aligns to 64): a BLAS kernel
may choose its path by the output's alignment (a 37 x 11 product on this CPU differs in its last bits 4
bytes off), and results must be bit-identical."""


def block_rows(rows: int, row_bytes: int) -> int:
    """Rows per gradient block of a rows x classes loss whose rows take `row_bytes` each."""
    return min(rows, max(math.ceil(rows / BLOCKS), math.ceil(BLOCK_BYTES / max(row_bytes, 1))))


@torch.library.custom_op("memplan::log_softmax_nll_backward", mutates_args=())
def log_softmax_nll_backward(grad_loss: torch.Tensor, log_probs: torch.Tensor, target: torch.Tensor,
                             weight: Optional[torch.Tensor], reduction: int, ignore_index: int,
                             total_weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`_log_softmax_backward_data(nll_loss_backward(grad_loss, log_probs, target, weight, reduction,
    ignore_index, total_weight), log_probs, 1, dtype)` for a contiguous rows x classes `log_probs` of dtype
    `dtype`, without a second result-sized tensor (module docstring)."""
    out = torch.empty_like(log_probs)
    aten.nll_loss_backward.grad_input(grad_loss, log_probs, target, weight, reduction, ignore_index, total_weight,
                                      grad_input=out)
    return aten._log_softmax_backward_data.out(out, log_probs, 1, dtype, out=out)


@log_softmax_nll_backward.register_fake
def _(grad_loss, log_probs, target, weight, reduction, ignore_index, total_weight, dtype):
    return torch.empty_like(log_probs)


@torch.library.custom_op("memplan::linear_cross_entropy", mutates_args=())
def linear_cross_entropy(bias: Optional[torch.Tensor], input: torch.Tensor, weight_t: torch.Tensor,
                         target: torch.Tensor, weight: Optional[torch.Tensor], reduction: int,
                         ignore_index: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(loss, total weight, gradient of the loss with respect to the logits) of `nll_loss(log_softmax(
    addmm(bias, input, weight_t) or mm(input, weight_t), 1), target, weight, reduction, ignore_index)`,
    the gradient for the seed `ones_like(loss)`, in one logits-sized tensor (module docstring). The
    gradient is a view of one storage that also holds the blocks' scratch rows, ahead of it."""
    scratch, grad = _buffer(input, weight_t)
    if bias is None:
        aten.mm.out(input, weight_t, out=grad)
    else:
        aten.addmm.out(bias, input, weight_t, out=grad)
    aten._log_softmax.out(grad, 1, False, out=grad)
    loss, total_weight = aten.nll_loss_forward(grad, target, weight, reduction, ignore_index)
    seed = torch.ones_like(loss)
    step = scratch.shape[0]
    for start in range(0, grad.shape[0], step):
        block = slice(start, start + step)
        loss_grad = scratch[:grad[block].shape[0]]
        aten.nll_loss_backward.grad_input(seed[block] if reduction == 0 else seed, grad[block], target[block],
                                          weight, reduction, ignore_index, total_weight, grad_input=loss_grad)
        aten._log_softmax_backward_data.out(loss_grad, grad[block], 1, grad.dtype, out=grad[block])
    return loss, total_weight, grad


def scratch_ahead(like: torch.Tensor, scratch: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(`scratch` flat elements, then `n` flat elements starting ALIGN bytes into the storage or a multiple
    of that) of one new storage of `like`'s dtype and device: an op's result with its scratch ahead of it,
    so that every byte the op allocates is in its result."""
    size = like.element_size()
    start = -(-scratch * size // ALIGN) * ALIGN // size
    flat = like.new_empty(start + n)
    return flat[:scratch], flat[start:]


def _buffer(input: torch.Tensor, weight_t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(scratch rows for one block's loss gradient, the logits' rows) of one new storage (`scratch_ahead`)."""
    rows, classes = input.shape[0], weight_t.shape[1]
    step = block_rows(rows, classes * input.element_size())
    scratch, logits = scratch_ahead(input, step * classes, rows * classes)
    return scratch.view(step, classes), logits.view(rows, classes)


@linear_cross_entropy.register_fake
def _(bias, input, weight_t, target, weight, reduction, ignore_index):
    grad = _buffer(input, weight_t)[1]
    return grad.new_empty((input.shape[0],) if reduction == 0 else ()), grad.new_empty(()), grad
