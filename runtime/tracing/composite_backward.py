"""Backward kernels that tracing decomposes and eager autograd does not: capture puts them back.

`aten.silu_backward` and `aten.mish_backward` have a CompositeImplicitAutograd kernel (`math_silu_backward`,
`math_mish_backward`) besides their CPU and CUDA kernels. Eager autograd calls the op and gets the device's
kernel, which computes in float32 for a bfloat16 or float16 input and rounds once; AOTAutograd's trace has
no device kernel to dispatch to and records the composite's pointwise ops instead (sigmoid, `1 - s` as
`empty_like` + `fill` + `sub`, three products and a sum for SiLU), each rounded to the input's dtype. Under
`torch.autocast("cpu", dtype=torch.bfloat16)` that is six bfloat16 roundings where eager has one, in every
SiLU of the model: EfficientNet-B0's captured gradients were up to 1.36 from eager's (largest 60.5) with the
same loss (issue #53), each block's BatchNorm backward amplifying the difference of the one after it. In
float32 the composite is within 2e-7 of the kernel, not bit-identical. It also allocates intermediates the
kernel does not.

`restore_backward_kernels` finds each composite's ops, exactly as the trace writes them, and replaces their
result by one call of the op: the captured step then runs the kernel eager runs (bit-identical, tested in
tests/runtime/test_autocast_capture.py). The ops that become unread are left for dead-code elimination.
(torch's own list of ops with both kernels: `_dispatch_has_kernel_for_dispatch_key(op,
"CompositeImplicitAutograd")` and "CPU" or "CUDA"; besides these two backward ops it holds `_fused_rms_norm`
and `native_channel_shuffle`, forward ops that the trace reaches through their composite callers.)
"""

from __future__ import annotations

from typing import Any, Mapping

import torch
from torch import fx

_aten = torch.ops.aten

_Pattern = Mapping[str, tuple]
"""Named nodes: name -> (op, argument, ...), an argument being a name (a node: of the pattern if it names
one, else a free input) or a constant. A name stands for one node wherever it occurs. "out" is the result."""

_SILU: _Pattern = {                      # grad * (s * (1 + x * (1 - s))), s = sigmoid(x)
    "out": (_aten.mul.Tensor, "grad", "ds"),
    "ds": (_aten.mul.Tensor, "s", "inner"),
    "inner": (_aten.add.Scalar, "x_one_minus_s", 1),
    "x_one_minus_s": (_aten.mul.Tensor, "x", "one_minus_s"),
    "one_minus_s": (_aten.sub.Tensor, "ones", "s"),
    "ones": (_aten.fill.Scalar, "empty", 1),
    "empty": (_aten.empty_like.default, "s"),
    "s": (_aten.sigmoid.default, "x"),
}

_MISH: _Pattern = {                      # grad * (t + x * sigmoid(x) * (1 - t * t)), t = tanh(softplus(x))
    "out": (_aten.mul.Tensor, "grad", "d"),
    "d": (_aten.add.Tensor, "t", "rest"),
    "rest": (_aten.mul.Tensor, "x_s", "one_minus_tt"),
    "x_s": (_aten.mul.Tensor, "x", "s"),
    "s": (_aten.sigmoid.default, "x"),
    "one_minus_tt": (_aten.sub.Tensor, "ones", "tt"),
    "ones": (_aten.fill.Scalar, "empty", 1),
    "empty": (_aten.empty_like.default, "tt"),
    "tt": (_aten.mul.Tensor, "t", "t"),
    "t": (_aten.tanh.default, "softplus"),
    "softplus": (_aten.softplus.default, "x"),
}

KERNELS: list[tuple[Any, _Pattern]] = [
    (_aten.silu_backward.default, _SILU),
    (_aten.mish_backward.default, _MISH),
]
"""(the op eager's autograd calls, its composite as the trace records it)."""


def restore_backward_kernels(graph: fx.Graph) -> int:
    """Replace each traced composite of `KERNELS` by one call of its op, `op(grad, x)`, where the gradient,
    the input and the result have one shape, dtype and device (as autograd calls it). Returns how many."""
    restored = 0
    for n in list(graph.nodes):
        if n.op != "call_function" or n.target is not _aten.mul.Tensor:
            continue
        for op, pattern in KERNELS:
            bound = _match(pattern, n)
            if bound is None or not _same_kind(bound["grad"], bound["x"], n):
                continue
            with graph.inserting_before(n):
                kernel = graph.call_function(op, (bound["grad"], bound["x"]))
            kernel.meta = dict(n.meta)
            n.replace_all_uses_with(kernel)
            graph.erase_node(n)
            restored += 1
            break
    return restored


_ABSENT = object()
_DEFAULT_KWARGS = {"memory_format": torch.preserve_format}
"""Keyword arguments a pattern's op may carry with these values (their defaults): `empty_like`'s."""


def _match(pattern: _Pattern, out: fx.Node) -> dict[str, fx.Node] | None:
    """The nodes `pattern`'s names stand for, with "out" at `out`, or None where the graph differs."""
    bound: dict[str, fx.Node] = {}

    def matches(name: str, node: Any) -> bool:
        if not isinstance(node, fx.Node):
            return False
        if name in bound:
            return bound[name] is node
        bound[name] = node
        if name not in pattern:                        # a free input
            return True
        target, *args = pattern[name]
        if node.op != "call_function" or node.target is not target or len(node.args) != len(args) \
                or any(_DEFAULT_KWARGS.get(k, _ABSENT) != v for k, v in node.kwargs.items()):
            return False
        return all(matches(a, b) if isinstance(a, str) else (not isinstance(b, fx.Node) and a == b)
                   for a, b in zip(args, node.args))

    return bound if matches("out", out) else None


def _same_kind(*nodes: fx.Node) -> bool:
    vals = [n.meta.get("val") for n in nodes]
    if not all(isinstance(v, torch.Tensor) for v in vals):
        return False
    return len({(tuple(v.shape), v.dtype, v.device) for v in vals}) == 1
