"""A language model's head and cross-entropy a chunk of tokens at a time, as two ops `runtime.capture` rewrites the
loss into (`chunk_cross_entropy`, runtime/tracing/rewrites.py): the whole logits never exist.

- `memplan::chunked_cross_entropy` (the loss step): the loss, the total weight (the count of non-ignored rows, as
  `nll_loss_forward` returns it) and the per-token logsumexp (fp32, one number a token), computed a chunk of
  rows at a time (`runtime.chunked_loss.forward_chunks`).
- `memplan::chunked_cross_entropy_backward` (the backward): recomputes each chunk's logits and emits the head
  input's gradient, the weight's gradient (classes x hidden, as the captured `mm(t(grad), x)` computes it) and
  the bias gradient (`runtime.chunked_loss.backward_chunks`).

Both run runtime/chunked_loss.py's math: another summation order than the captured ops, so within the validation
tolerance, not bit-identical. One chunk's logits (and its logsumexp's temporary) is the ops' workspace, which the
profile measures per node. float32 only; the backward's seed is `ones_like(loss)` (the fused loss's condition).
"""

from __future__ import annotations

from typing import Optional

import torch

from memplan.runtime.chunked_loss import backward_chunks, forward_chunks

MEAN, SUM = 1, 2
"""`nll_loss`'s reductions the ops compute (ATen's numbering)."""


@torch.library.custom_op("memplan::chunked_cross_entropy", mutates_args=())
def chunked_cross_entropy(bias: Optional[torch.Tensor], input: torch.Tensor, weight_t: torch.Tensor,
                          target: torch.Tensor, reduction: int, ignore_index: int,
                          chunk_tokens: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(loss, total weight, per-token logsumexp) of `nll_loss_forward(log_softmax(addmm(bias, input, weight_t) or
    mm(input, weight_t), 1), target, None, reduction, ignore_index)`, `chunk_tokens` rows at a time."""
    lse = input.new_empty(input.shape[0], dtype=torch.float32)
    total, count = forward_chunks(input, weight_t.t(), bias, target, lse, chunk_tokens, ignore_index, None)
    total_weight = count.to(input.dtype)
    return (total / total_weight if reduction == MEAN else total).to(input.dtype), total_weight, lse


@chunked_cross_entropy.register_fake
def _(bias, input, weight_t, target, reduction, ignore_index, chunk_tokens):
    return input.new_empty(()), input.new_empty(()), input.new_empty(input.shape[0], dtype=torch.float32)


@torch.library.custom_op("memplan::chunked_cross_entropy_backward", mutates_args=())
def chunked_cross_entropy_backward(bias: Optional[torch.Tensor], input: torch.Tensor, weight_t: torch.Tensor,
                                   target: torch.Tensor, lse: torch.Tensor, total_weight: torch.Tensor,
                                   reduction: int, ignore_index: int, chunk_tokens: int, need_input: bool,
                                   need_weight: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(input gradient, weight gradient (classes x hidden), bias gradient (1 x classes)) of `chunked_cross_entropy`'s loss
    for the seed `ones_like(loss)`; a gradient not asked for (`need_input`, `need_weight`, no bias) is empty."""
    grad_input = torch.zeros_like(input) if need_input else input.new_empty(0)
    grad_weight = weight_t.new_zeros(weight_t.shape[1], weight_t.shape[0]) if need_weight else weight_t.new_empty(0)
    grad_bias = torch.zeros(1, bias.shape[0], dtype=bias.dtype, device=bias.device) if bias is not None \
        else input.new_empty(0)
    scale = 1.0 / total_weight if reduction == MEAN else torch.ones_like(total_weight)
    backward_chunks(input, weight_t.t(), bias, target, lse, scale, chunk_tokens, ignore_index, None,
                    grad_input if need_input else None, grad_weight if need_weight else None,
                    grad_bias[0] if bias is not None else None)
    return grad_input, grad_weight, grad_bias


@chunked_cross_entropy_backward.register_fake
def _(bias, input, weight_t, target, lse, total_weight, reduction, ignore_index, chunk_tokens, need_input,
      need_weight):
    return (torch.empty_like(input) if need_input else input.new_empty(0),
            weight_t.new_empty(weight_t.shape[1], weight_t.shape[0]) if need_weight else weight_t.new_empty(0),
            input.new_empty(1, bias.shape[0]) if bias is not None else input.new_empty(0))
