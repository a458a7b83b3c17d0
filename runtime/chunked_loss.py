"""A language model's head and cross-entropy a chunk of tokens at a time: the full logits never exist.

At real size the largest tensors of a language model's training step are the logits (tokens x vocabulary) and the
loss's own logits-sized tensors (log-probabilities, their gradient). `chunked_linear_cross_entropy(hidden, weight,
target)` computes `F.cross_entropy(F.linear(hidden, weight, bias), target)` and its gradients for `chunk_tokens`
tokens at a time, in the manner of Liger Kernel's fused linear cross-entropy and torchtune's chunked cross-entropy
(this is an implementation of its own):

- forward, per chunk: the chunk's logits (in fp32), optionally soft-capped (`cap * tanh(logits / cap)`, Gemma 2's
  final logit soft-capping), their logsumexp and the target's logit. Only the per-token logsumexp (fp32, one
  number a token) is kept for the backward; the chunk's logits are dropped before the next chunk.
- backward, per chunk: the chunk's logits again (one more matrix product than the unchunked loss), the softmax
  minus the one-hot target, times the loss gradient's scale (1 / the number of non-ignored tokens for
  `reduction="mean"`), zero on `ignore_index` rows, through the soft-cap's derivative `1 - tanh^2`; then the
  chunk's rows of the hidden gradient and the chunk's contribution to the weight (and bias) gradient, summed
  across chunks in fp32. A chunk whose tokens are all ignored is skipped.

At most one chunk's logits-sized tensor is alive at a time (two with soft-capping: the softmax and the tanh), so
the loss's memory is `chunk_tokens x vocabulary x 4` bytes instead of several times `tokens x vocabulary x
element size`. bf16 and fp16 inputs are computed in fp32 (the weight is converted to fp32 once per call, one fp32
copy of the head's weight alive during the loss's forward and backward) and their gradients returned in the input
dtype. A weight tied to the input embedding is an ordinary autograd input: its gradient from this loss and the
embedding's add up as autograd adds any two uses of a tensor.

`causal_lm_chunked_loss(hidden, weight, input_ids)` shifts the labels as transformers' `ForCausalLMLoss` does, and
`chunked_causal_lm_loss(model, input_ids)` (or `ChunkedCausalLMLoss(model)`) runs a transformers `*ForCausalLM` /
`GPT2LMHeadModel`'s base model to its hidden states and applies the chunked loss with its `lm_head`: the value of
`model(input_ids, labels=input_ids).loss`, without the logits. `forward_chunks` and `backward_chunks` are also the
arithmetic of the ops `runtime.capture` rewrites a large head and loss into in CPU graphs
(runtime/tracing/chunked_head.py), so executor plans of such a step hold no logits without this function.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.nn.functional as F

DEFAULT_CHUNK_TOKENS = 1024
"""Tokens per chunk by default: 1024 x a 50k vocabulary is 200 MiB of fp32 logits a chunk."""


def _chunk_logits(hidden: torch.Tensor, weight32: torch.Tensor, bias32: Optional[torch.Tensor],
                  softcap: Optional[float]) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """fp32 logits of a chunk of `hidden`; with `softcap`, (capped logits, tanh) else (logits, None)."""
    h = hidden.float()
    logits = torch.addmm(bias32, h, weight32.t()) if bias32 is not None else h @ weight32.t()
    if softcap is None:
        return logits, None
    tanh = logits.div_(softcap).tanh_()
    return tanh * softcap, tanh


def forward_chunks(hidden: torch.Tensor, weight32: torch.Tensor, bias32: Optional[torch.Tensor],
                   target: torch.Tensor, lse: torch.Tensor, chunk_tokens: int, ignore_index: int,
                   softcap: Optional[float]) -> tuple[torch.Tensor, torch.Tensor]:
    """The loss's forward, `chunk_tokens` tokens of `hidden` (tokens x hidden size) at a time: fills `lse` (fp32,
    one per token) and returns (the fp32 sum of the non-ignored tokens' losses, their count)."""
    tokens = hidden.shape[0]
    total = torch.zeros((), dtype=torch.float32, device=hidden.device)
    valid = target != ignore_index
    for start in range(0, tokens, chunk_tokens):
        end = min(start + chunk_tokens, tokens)
        ok = valid[start:end]
        if not bool(ok.any()):
            lse[start:end] = 0.0                       # never read: the rows' gradients are zero
            continue
        logits, tanh = _chunk_logits(hidden[start:end], weight32, bias32, softcap)
        del tanh
        chunk_lse = torch.logsumexp(logits, dim=-1)
        lse[start:end] = chunk_lse
        picked = logits.gather(1, torch.where(ok, target[start:end], 0).unsqueeze(1)).squeeze(1)
        del logits
        total += torch.where(ok, chunk_lse - picked, 0.0).sum()
    return total, valid.sum()


def backward_chunks(hidden: torch.Tensor, weight32: torch.Tensor, bias32: Optional[torch.Tensor],
                    target: torch.Tensor, lse: torch.Tensor, scale: torch.Tensor, chunk_tokens: int,
                    ignore_index: int, softcap: Optional[float], grad_hidden: Optional[torch.Tensor],
                    grad_weight: Optional[torch.Tensor], grad_bias: Optional[torch.Tensor]) -> None:
    """The loss's backward for the loss gradient `scale` per non-ignored token, a chunk at a time (each chunk's
    logits computed again): writes `grad_hidden`'s rows and adds into `grad_weight` (fp32, the weight's shape; a
    transposed view works) and `grad_bias` (fp32); any may be None."""
    valid = target != ignore_index
    for start in range(0, hidden.shape[0], chunk_tokens):
        end = min(start + chunk_tokens, hidden.shape[0])
        ok = valid[start:end]
        if not bool(ok.any()):
            continue
        h = hidden[start:end].float()
        logits, tanh = _chunk_logits(h, weight32, bias32, softcap)
        grad = logits.sub_(lse[start:end].unsqueeze(1)).exp_()          # softmax, in place over the logits
        rows = ok.nonzero().squeeze(1)
        grad[rows, target[start:end][rows]] -= 1.0                      # minus the one-hot target
        grad.mul_((ok.float() * scale).unsqueeze(1))                     # the loss's scale; ignored rows 0
        if tanh is not None:                                             # d(cap tanh(z / cap)) / dz
            grad.mul_(tanh.mul_(tanh).neg_().add_(1.0))
            del tanh
        if grad_hidden is not None:
            grad_hidden[start:end] = (grad @ weight32).to(hidden.dtype)
        if grad_weight is not None:
            grad_weight.addmm_(grad.t(), h)
        if grad_bias is not None:
            grad_bias += grad.sum(0)
        del grad, logits


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, hidden: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                target: torch.Tensor, chunk_tokens: int, ignore_index: int, reduction: str,
                softcap: Optional[float]) -> torch.Tensor:
        lse = torch.empty(hidden.shape[0], dtype=torch.float32, device=hidden.device)
        total, count = forward_chunks(hidden, weight.float(), bias.float() if bias is not None else None, target,
                                      lse, chunk_tokens, ignore_index, softcap)
        loss = total / count if reduction == "mean" else total
        ctx.save_for_backward(hidden, weight, bias, target, lse, count)
        ctx.has_bias = bias is not None
        ctx.settings = (chunk_tokens, ignore_index, reduction, softcap)
        return loss

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, grad_loss: torch.Tensor):
        hidden, weight, bias, target, lse, count = ctx.saved_tensors
        chunk_tokens, ignore_index, reduction, softcap = ctx.settings
        need_hidden, need_weight, need_bias = ctx.needs_input_grad[:3]
        scale = grad_loss.float() / count if reduction == "mean" else grad_loss.float()
        grad_hidden = torch.zeros_like(hidden) if need_hidden else None
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_weight else None
        grad_bias = (torch.zeros(bias.shape, dtype=torch.float32, device=bias.device)
                     if need_bias and bias is not None else None)
        backward_chunks(hidden, weight.float(), bias.float() if bias is not None else None, target, lse, scale,
                        chunk_tokens, ignore_index, softcap, grad_hidden, grad_weight, grad_bias)
        return (grad_hidden,
                grad_weight.to(weight.dtype) if grad_weight is not None else None,
                grad_bias.to(bias.dtype) if grad_bias is not None else None,
                None, None, None, None, None)


def chunked_linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, *,
                                 bias: Optional[torch.Tensor] = None, chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
                                 ignore_index: int = -100, reduction: str = "mean",
                                 softcap: Optional[float] = None) -> torch.Tensor:
    """`F.cross_entropy(F.linear(hidden, weight, bias), target, ignore_index=..., reduction=...)` (with
    `softcap`: of `softcap * tanh(logits / softcap)`), forward and backward `chunk_tokens` tokens at a time,
    never holding the full logits (module docstring). `hidden` is (..., hidden size) and `target` (...) of the
    same leading shape; `reduction` is "mean" (over the tokens not equal to `ignore_index`; nan if none) or
    "sum". The loss is fp32 whatever `hidden`'s dtype (as transformers' `ForCausalLMLoss`, which upcasts the
    logits); the gradients have their inputs' dtypes."""
    if reduction not in ("mean", "sum"):
        raise ValueError(f"reduction must be 'mean' or 'sum', not {reduction!r}")
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be at least 1, not {chunk_tokens}")
    if hidden.shape[:-1] != target.shape:
        raise ValueError(f"hidden {tuple(hidden.shape)} and target {tuple(target.shape)} differ in their tokens")
    if softcap is not None and softcap <= 0:
        raise ValueError(f"softcap must be positive, not {softcap}")
    flat = hidden.reshape(-1, hidden.shape[-1])
    return _ChunkedLinearCrossEntropy.apply(flat, weight, bias, target.reshape(-1), int(chunk_tokens),
                                            int(ignore_index), reduction,
                                            None if softcap is None else float(softcap))


def shift_labels(labels: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
    """transformers' `ForCausalLMLoss` shift: position t predicts label t + 1, the last position `ignore_index`
    (the hidden states keep every position, so no copy of them is sliced)."""
    return F.pad(labels, (0, 1), value=ignore_index)[..., 1:]


def causal_lm_chunked_loss(hidden: torch.Tensor, weight: torch.Tensor, input_ids: torch.Tensor, *,
                           labels: Optional[torch.Tensor] = None, bias: Optional[torch.Tensor] = None,
                           chunk_tokens: int = DEFAULT_CHUNK_TOKENS, ignore_index: int = -100,
                           softcap: Optional[float] = None,
                           num_items_in_batch: Optional[torch.Tensor | int] = None) -> torch.Tensor:
    """A causal language model's loss from its final hidden states (batch, sequence, hidden size): the labels
    (`input_ids` unless `labels` is given) shifted one to the left as transformers' `ForCausalLMLoss` shifts them,
    the mean over the non-ignored tokens, or with `num_items_in_batch` (as the Trainer passes for gradient
    accumulation) the sum divided by it."""
    target = shift_labels(input_ids if labels is None else labels, ignore_index)
    if num_items_in_batch is None:
        return chunked_linear_cross_entropy(hidden, weight, target, bias=bias, chunk_tokens=chunk_tokens,
                                            ignore_index=ignore_index, reduction="mean", softcap=softcap)
    total = chunked_linear_cross_entropy(hidden, weight, target, bias=bias, chunk_tokens=chunk_tokens,
                                         ignore_index=ignore_index, reduction="sum", softcap=softcap)
    if torch.is_tensor(num_items_in_batch):
        num_items_in_batch = num_items_in_batch.to(total.device)
    return total / num_items_in_batch


class ChunkedLossUnsupported(NotImplementedError):
    """A model `chunked_causal_lm_loss` cannot compute the loss of (logit scaling, a head that is not a Linear, no
    base model), with the fix."""


FIX = ("train it with its own loss, or compute its last hidden states yourself and call "
       "chunked_linear_cross_entropy(hidden, head_weight, labels).")


def chunked_causal_lm_loss(model: torch.nn.Module, input_ids: torch.Tensor, labels: Optional[torch.Tensor] = None,
                           *, attention_mask: Optional[torch.Tensor] = None,
                           chunk_tokens: int = DEFAULT_CHUNK_TOKENS, ignore_index: int = -100,
                           num_items_in_batch: Optional[torch.Tensor | int] = None, **model_kwargs) -> torch.Tensor:
    """`model(input_ids, labels=labels or input_ids).loss` for a transformers causal language model
    (`*ForCausalLM`, `GPT2LMHeadModel`) without its logits: its base model (`model.base_model`:
    `model.transformer`, `model.model`) runs to the final hidden states with `use_cache=False`, then
    `causal_lm_chunked_loss` with the output embedding's weight and bias, soft-capped by the config's
    `final_logit_softcapping` where it has one. Its signature is a memplan `loss_fn(model, *batch)`."""
    head = model.get_output_embeddings()
    config = model.config
    for unsupported in ("logit_scale", "logits_scaling", "output_multiplier_scale"):
        if getattr(config, unsupported, None) not in (None, 1, 1.0):
            raise ChunkedLossUnsupported(f"{type(model).__name__} scales its logits ({unsupported}), which "
                                         f"chunked_causal_lm_loss does not: {FIX}")
    if not isinstance(head, torch.nn.Linear):
        raise ChunkedLossUnsupported(f"{type(model).__name__}'s output embedding is a {type(head).__name__}, not "
                                     f"an nn.Linear: {FIX}")
    base = model.base_model
    if base is model:
        raise ChunkedLossUnsupported(f"{type(model).__name__} has no base model to run to its hidden states: {FIX}")
    out = base(input_ids=input_ids, attention_mask=attention_mask, use_cache=False, **model_kwargs)
    hidden = out[0] if isinstance(out, tuple) else out.last_hidden_state
    return causal_lm_chunked_loss(hidden, head.weight, input_ids, labels=labels, bias=head.bias,
                                  chunk_tokens=chunk_tokens, ignore_index=ignore_index,
                                  softcap=getattr(config, "final_logit_softcapping", None),
                                  num_items_in_batch=num_items_in_batch)


class ChunkedCausalLMLoss:
    """`loss = ChunkedCausalLMLoss(model, chunk_tokens=1024)(input_ids)`: `chunked_causal_lm_loss` bound to a
    model, for training loops that call a loss object."""

    def __init__(self, model: torch.nn.Module, chunk_tokens: int = DEFAULT_CHUNK_TOKENS, ignore_index: int = -100):
        self.model, self.chunk_tokens, self.ignore_index = model, chunk_tokens, ignore_index

    def __call__(self, input_ids: torch.Tensor, labels: Optional[torch.Tensor] = None, **kwargs) -> torch.Tensor:
        return chunked_causal_lm_loss(self.model, input_ids, labels, chunk_tokens=self.chunk_tokens,
                                      ignore_index=self.ignore_index, **kwargs)
