"""The cross-entropy backward as one op: `memplan::log_softmax_nll_backward`.

AOTAutograd differentiates `cross_entropy = nll_loss(log_softmax(x))` into two ops, each allocating a
tensor the size of the logits: `nll_loss_backward` (the loss gradient scattered into zeros) and
`_log_softmax_backward_data` reading it. With the forward's log-probabilities still live, the step holds
three logits-sized tensors: the peak of an eager training step of a language model. This op runs the same
two ATen kernels into one result tensor, the second in place over the first's output: the log-softmax
backward reads each element of the loss gradient before it writes that element (a row's sum first, then
element by element), so the result is bit-identical (tested) and the step holds two such tensors, not
three. `runtime.capture` rewrites the pair into it.
"""

from __future__ import annotations

from typing import Optional

import torch

aten = torch.ops.aten


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
