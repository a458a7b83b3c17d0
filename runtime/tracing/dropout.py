"""Dropout split into its draw and its product: two ops `runtime.capture` rewrites `native_dropout` into.

AOTAutograd captures a training dropout as one `aten.native_dropout(x, p, True)`, which draws a bool keep
mask and returns it with the output `x * mask / (1 - p)`; the backward reads the mask only. As one node,
a planner that frees the output and computes it again must draw the mask again (the executor replays the
generator for that), and ATen's CPU op takes about 14 ms for 1M elements where its draw takes 8 and the
product 1. Split, the mask is a value of its own (1 byte an element, which the backward keeps anyway), and
the output can be recomputed from it in one pass, without the generator.

- `memplan::dropout_mask(x, p)` draws the mask as ATen's CPU kernel does: bernoulli(1 - p) over a
  contiguous bool tensor of x's shape. The same draws, and the generator ends where ATen's leaves it
  (tested). Tagged `nondeterministic_seeded`, like the op it replaces, so planners and the executor treat it
  as random.
- `memplan::dropout_apply(x, mask, p)` is the output as ATen's CPU kernel computes it: `x * mask`, then
  times the scale `1 / (1 - p)` rounded to x's dtype. Bit-identical (tested, fp64 to bf16).

CPU graphs only: CUDA's fused dropout kernel draws in its own order, so there the mask cannot be drawn
apart from the output.
"""

from __future__ import annotations

import torch


def dropout_mask(x: torch.Tensor, p: float) -> torch.Tensor:
    """The keep mask `aten.native_dropout(x, p, True)` draws on CPU: bernoulli(1 - p) per element."""
    return _like(x, torch.bool).bernoulli_(1 - p)


_LIBRARY = torch.library.Library("memplan", "FRAGMENT")    # Library.define takes tags on older torch too
_LIBRARY.define("dropout_mask(Tensor x, float p) -> Tensor", tags=(torch.Tag.nondeterministic_seeded,))
_LIBRARY.impl("dropout_mask", dropout_mask, "CompositeExplicitAutograd")
torch.library.register_fake("memplan::dropout_mask", lambda x, p: _like(x, torch.bool), lib=_LIBRARY)


@torch.library.custom_op("memplan::dropout_apply", mutates_args=())
def dropout_apply(x: torch.Tensor, mask: torch.Tensor, p: float) -> torch.Tensor:
    """`aten.native_dropout(x, p, True)`'s output for its mask: `x * mask * s`, s = 1 / (1 - p) in x's dtype."""
    return x.mul(mask).mul_(torch.tensor(1 / (1 - p), dtype=x.dtype).item())


@dropout_apply.register_fake
def _(x, mask, p):
    return _like(x, x.dtype)


def _like(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return torch.empty_like(x, dtype=dtype, memory_format=torch.contiguous_format)
