"""Capture's rewrite passes: each replaces instances of an ATen pattern in the joint FX graph by ops that
compute the same values (runtime/tracing/capture.py runs them in `PASSES` order, before folding).

A pass numbers its candidate instances in graph order and asks its `Rewriter` whether to apply each: by
default (no selection) every candidate, except that the pointwise input gradient is taken only where ATen's
CPU convolution backward would take its native GEMM path on this host; with a selection (`{pass: [index,
...]}`, as a graph or plan records it) exactly the listed instances. Applied with `record`, the rewriter
keeps each instance's region (the nodes it inserted, the values they replace, the random node whose draws
they repeat) for runtime/tracing/rewrite_check.py, which runs each region on one step's real values and keeps only
the instances that are bit-identical on the device and thread count capture runs on. Nothing here claims
bit-identity beyond what that check finds; docs/graph-format.md says why each pass should be exact.
"""

from __future__ import annotations

import math
import operator
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any, Callable, Collection, Union

import torch
from torch import fx

from memplan.runtime.tracing import chunked_head, dropout, fused_gelu, fused_loss  # noqa: F401  (register the memplan:: ops rewritten into)

Ref = Union[fx.Node, tuple]
"""A value of the rewritten graph: a node, or (multi-output node, index)."""

_INPUT_GRADIENT = "memplan_input_gradient"
"""Node meta key marking the input-gradient convolution `split_convolution_backward` inserted."""


@dataclass(eq=False)
class Instance:
    """One applied rewrite: its candidate index, the (original node, replacement) pairs whose values must
    be equal, the nodes it inserted (graph order), and the original random node it draws like (or None)."""

    index: int
    outputs: list[tuple[fx.Node, Ref]]
    new: list[fx.Node]
    random: fx.Node | None = None


class Rewriter:
    """Numbers one pass's candidates and decides which to apply: `selection` lists the indices to apply
    (None: each candidate's default). With `record`, keeps each applied `Instance`."""

    def __init__(self, graph: fx.Graph, selection: Collection[int] | None, record: bool = False):
        self.graph, self.selection, self.record = graph, selection, record
        self.found = self.defaults = 0                     # candidates, and those the default applies
        self.applied: list[int] = []
        self.instances: list[Instance] = []
        self._before: set[fx.Node] = set()

    def take(self, default: bool = True) -> bool:
        """Count the next candidate; whether to rewrite it."""
        index, self.found, self.defaults = self.found, self.found + 1, self.defaults + default
        chosen = default if self.selection is None else index in self.selection
        if chosen:
            self.applied.append(index)
            if self.record:
                self._before = set(self.graph.nodes)
        return chosen

    def done(self, outputs: list[tuple[fx.Node, Ref]], random: fx.Node | None = None) -> None:
        """Report the instance just rewritten: which original values its replacements stand for."""
        if self.record:
            new = [m for m in self.graph.nodes if m not in self._before]
            self.instances.append(Instance(self.applied[-1], outputs, new, random))


def split_convolution_backward(graph: fx.Graph, rw: Rewriter, on_cpu: bool) -> None:
    """Split each `convolution_backward` that computes both the input and the weight gradient into a
    weight-gradient node followed by an input-gradient node (MONeT appendix D): the weight gradient
    (`convolution_backward` with output mask `[False, True, bias]`) reads the forward input; the input
    gradient, the transposed convolution of the output gradient with the weight, does not. Once the
    weight gradient is computed the forward input can be freed, before the input gradient is allocated.
    Transposed convolutions stay joint, and so do grouped ones in GPU graphs (on an H200, ATen's depthwise
    input gradient and the grouped transposed convolution round differently: MobileNet-V2, 4.4e-5 on a
    weight gradient downstream). Each half should equal the joint call's result (ATen's joint kernel runs
    the same two computations), but kernels pick their algorithm per CPU and thread count, so the pipeline
    checks every instance on its device (runtime/tracing/rewrite_check.py)."""
    aten = torch.ops.aten
    for n in list(graph.nodes):
        if n.op != "call_function" or n.target is not aten.convolution_backward.default:
            continue
        (grad, x, weight, bias_sizes, stride, padding, dilation, transposed, output_padding, groups,
         mask) = n.args
        if transposed or not (mask[0] and mask[1]) or (groups != 1 and not on_cpu) or not rw.take():
            continue
        val = n.meta["val"]
        out_size, in_size, k = grad.meta["val"].shape[2:], x.meta["val"].shape[2:], weight.meta["val"].shape[2:]
        # output_padding that makes the transposed convolution's output the forward input's size
        pad = [i - ((o - 1) * s - 2 * p + d * (kk - 1) + 1)
               for i, o, s, p, d, kk in zip(in_size, out_size, stride, padding, dilation, k)]
        with graph.inserting_before(n):
            weight_grad = graph.call_function(n.target, (*n.args[:-1], [False, True, mask[2]]))
            weight_grad.meta = {**n.meta, "val": (None, *val[1:])}
            input_grad = graph.call_function(aten.convolution.default,
                                             (grad, weight, None, stride, padding, dilation, True, pad, groups))
            input_grad.meta = {**n.meta, "val": val[0], _INPUT_GRADIENT: True}
        outputs: list[tuple[fx.Node, Ref]] = []
        for user in list(n.users):                         # getitems of the joint result
            if user.args[1] == 0:
                outputs.append((user, input_grad))
                user.replace_all_uses_with(input_grad)
                graph.erase_node(user)
            else:
                outputs.append((user, (weight_grad, user.args[1])))
                user.args = (weight_grad, user.args[1])
        graph.erase_node(n)
        rw.done(outputs)


def pointwise_input_gradient(graph: fx.Graph, rw: Rewriter, on_cpu: bool) -> None:
    """Rewrite the input gradient `split_convolution_backward` made of a pointwise convolution (1x1 kernel,
    stride 1, no padding, one group; contiguous output gradient, weight and input gradient) as a batched
    matrix product (`_pointwise_input_gradient`), where the transposed convolution is up to 2x slower on
    CPU. By default only where ATen's CPU `convolution_backward` takes its native GEMM path rather than
    oneDNN's (`_native_gemm`: float64, or float32 below 16 images on one thread), the one case where the
    product computes what the joint call does; a recorded selection fixes the choice regardless of the
    host's thread count."""
    for n in list(graph.nodes):
        if not n.meta.get(_INPUT_GRADIENT):
            continue
        grad, weight, _, stride, padding, _, _, _, groups = n.args
        if not _pointwise(grad, weight, n.meta["val"], stride, padding, groups) or not rw.take(_native_gemm(grad)):
            continue
        with graph.inserting_before(n):
            product = _pointwise_input_gradient(graph, grad, weight, n.meta["val"])
        product.meta = {k: v for k, v in n.meta.items() if k != _INPUT_GRADIENT}
        n.replace_all_uses_with(product)
        graph.erase_node(n)
        rw.done([(n, product)])


def _pointwise(grad: fx.Node, weight: fx.Node, input_grad: torch.Tensor, stride, padding, groups) -> bool:
    """Whether a convolution's input gradient can be a matrix product: 1x1 kernel, stride 1, no padding,
    one group, on the CPU, contiguous output gradient, weight and input gradient."""
    w, g = weight.meta["val"], grad.meta["val"]
    return (g.device.type == "cpu" and groups == 1 and all(k == 1 for k in w.shape[2:])
            and all(s == 1 for s in stride) and all(p == 0 for p in padding) and w.is_contiguous()
            and g.is_contiguous() and input_grad.is_contiguous())


def _native_gemm(grad: fx.Node) -> bool:
    """Whether ATen's CPU `convolution_backward` takes its native GEMM path for this output gradient now:
    float64, or float32 below 16 images on one thread (ATen's `use_mkldnn`, which reads the thread count).
    Only the default selection reads it; a recorded selection does not."""
    g = grad.meta["val"]
    return g.dtype == torch.float64 or (g.dtype == torch.float32 and g.shape[0] < 16 and torch.get_num_threads() == 1)


CHUNK_LOGITS_BYTES = 1 << 26
"""`chunk_cross_entropy` applies by default where the logits take at least this many bytes (64 MiB) ..."""
CHUNKS = 16
"""... in this many chunks of rows: one chunk's logits is the ops' workspace."""


def chunk_cross_entropy(graph: fx.Graph, rw: Rewriter, on_cpu: bool) -> None:
    """Rewrite each language-model head and cross-entropy, from the logits' `mm` / `addmm` through the logits'
    gradient into the head's input, weight and bias gradients, into the ops of runtime/tracing/chunked_head.py:
    the loss a chunk of rows at a time, keeping the per-row logsumexp, and a backward that computes each chunk's
    logits again, so no logits-sized tensor exists. Where `fuse_cross_entropy` could fuse the whole loss (the
    same conditions: the logits and log-probabilities feed nothing else, the seed is `ones_like(loss)`), with no
    class weights, a mean or sum reduction, float32 logits, a contiguous head input, and the logits' gradient read
    only by the head's backward (`_head_backward`). Another summation order: checked within tolerance, not bit for bit
    (runtime/tracing/rewrite_check.py); by default only where the logits take `CHUNK_LOGITS_BYTES` or more. CPU
    graphs only (docs/graph-format.md)."""
    aten = torch.ops.aten
    for n in list(graph.nodes) if on_cpu else ():
        loss_backward = _loss_backward(n)
        if loss_backward is None or loss_backward[2].meta["val"].dtype != torch.float32:
            continue
        nll, saved, log_probs = loss_backward
        lp = log_probs.meta["val"]
        whole = _whole_loss(log_probs, nll, n)
        if whole is None:
            continue
        forward, product, chain = whole
        _, target, weight, reduction, ignore_index = forward.args
        backward = _head_backward(n, product)
        x = product.args[-2]
        if (weight is not None or reduction not in (chunked_head.MEAN, chunked_head.SUM) or backward is None
                or not x.meta["val"].is_contiguous()):
            continue
        if not rw.take(lp.numel() * lp.element_size() >= CHUNK_LOGITS_BYTES):
            continue
        grads, views = backward
        bias, x, weight_t = (None, *product.args) if product.target is aten.mm.default else product.args
        chunk = -(-lp.shape[0] // CHUNKS)
        with graph.inserting_before(forward):
            loss = graph.call_function(torch.ops.memplan.chunked_cross_entropy.default,
                                       (bias, x, weight_t, target, reduction, ignore_index, chunk))
            total_weight = graph.call_function(operator.getitem, (loss, 1))
            lse = graph.call_function(operator.getitem, (loss, 2))
        loss.meta = {"val": _fake_call(loss, lp)}
        total_weight.meta, lse.meta = {"val": loss.meta["val"][1]}, {"val": loss.meta["val"][2]}
        outputs: list[tuple[fx.Node, Ref]] = []
        for item in list(forward.users):             # the loss and its total weight keep their nodes
            outputs.append((item, (loss, item.args[1])))
            item.args = (loss, item.args[1])
        order = {m: i for i, m in enumerate(graph.nodes)}
        with graph.inserting_before(min(grads.values(), key=order.__getitem__)):
            grad = graph.call_function(torch.ops.memplan.chunked_cross_entropy_backward.default,
                                       (bias, x, weight_t, target, lse, total_weight, reduction, ignore_index, chunk,
                                        "input" in grads, "weight" in grads))
        grad.meta = {"val": _fake_call(grad, lp)}
        for index, which in enumerate(("input", "weight", "bias")):
            if which in grads:
                old = grads[which]
                with graph.inserting_before(old):
                    item = graph.call_function(operator.getitem, (grad, index))
                item.meta = {**old.meta, "val": grad.meta["val"][index]}
                outputs.append((old, item))
                old.replace_all_uses_with(item)
        _erase_replaced(graph, [*grads.values(), *views, n, nll, nll.args[0], saved, forward, *chain])
        rw.done(outputs)


def _loss_backward(n: fx.Node) -> tuple[fx.Node, fx.Node, fx.Node] | None:
    """(the `nll_loss_backward`, the saved log-probabilities as the backward reads them, the `_log_softmax`) where
    `n` is the `_log_softmax_backward_data` of a cross-entropy: over a contiguous rows x classes `_log_softmax` along
    dimension 1, of `n`'s dtype, reading a loss gradient no other node reads; None otherwise."""
    aten = torch.ops.aten
    if n.op != "call_function" or n.target is not aten._log_softmax_backward_data.default:
        return None
    nll, saved, dim, dtype = n.args
    log_probs = _alias_base(saved)
    if not (isinstance(nll, fx.Node) and nll.target is aten.nll_loss_backward.default and len(nll.users) == 1
            and len(nll.args) == 7 and nll.args[1] is log_probs):
        return None
    lp = log_probs.meta["val"]
    if lp.dim() != 2 or dim not in (1, -1) or lp.dtype != dtype or not lp.is_contiguous():
        return None
    return nll, saved, log_probs


def _head_backward(grad: fx.Node, product: fx.Node) -> tuple[dict[str, fx.Node], list[fx.Node]] | None:
    """({"input": ..., "weight": ..., "bias": ...}: the nodes computing the head's gradients from the logits'
    gradient `grad`, those present; the views and transposes of `grad` they read through) where the head is
    `product` (`mm(x, weight_t)` / `addmm(bias, x, weight_t)`) and nothing else reads `grad`: `mm(g, t(weight_t))`
    (the input's gradient), `mm(t(g), x)` (the weight's, classes x hidden) and `sum(g, [0], True)` (the bias's),
    `g` a view of `grad` of its shape; None otherwise."""
    aten = torch.ops.aten
    bias, x, weight_t = (None, *product.args) if product.target is aten.mm.default else product.args
    views: list[fx.Node] = []
    grads: dict[str, fx.Node] = {}
    frontier, shape = [grad], tuple(grad.meta["val"].shape)
    while frontier:
        g = frontier.pop()
        for user in g.users:
            if _is_check(user):
                continue
            if user.target in (aten.view.default, aten._unsafe_view.default) or _saving_alias(user):
                views.append(user)
                frontier.append(user)
                continue
            if tuple(g.meta["val"].shape) != shape:
                return None
            args = user.args
            if (user.target is aten.mm.default and args[0] is g and isinstance(args[1], fx.Node)
                    and args[1].target is aten.t.default and _alias_base(args[1].args[0]) is weight_t):
                which, read = "input", args[1]
            elif user.target is aten.t.default and len(user.users) == 1:
                which, read, user = "weight", user, next(iter(user.users))
                if not (user.target is aten.mm.default and user.args[0] is read and _alias_base(user.args[1]) is x):
                    return None
            elif (bias is not None and user.target is aten.sum.dim_IntList and len(args) == 3 and args[0] is g
                  and list(args[1]) == [0] and args[2] is True and not user.kwargs):
                which, read = "bias", None
            else:
                return None
            if which in grads:
                return None
            grads[which] = user
            views.extend([read] if read is not None else [])
    return (grads, views) if grads else None


def fuse_cross_entropy(graph: fx.Graph, rw: Rewriter, on_cpu: bool) -> None:
    """Rewrite each cross-entropy loss into the ops of runtime/tracing/fused_loss.py (the same ATen kernels, fewer
    logits-sized tensors): the whole loss, from the logits' `mm` / `addmm` to the logits' gradient, into
    `memplan::linear_cross_entropy` where the logits and log-probabilities feed nothing else and the
    backward's seed is `ones_like(loss)`; else the backward pair into `memplan::log_softmax_nll_backward`.
    Either needs a contiguous rows x classes `_log_softmax` over dimension 1 whose loss gradient has no
    other reader. CPU graphs only (docs/graph-format.md)."""
    aten = torch.ops.aten
    for n in list(graph.nodes) if on_cpu else ():
        loss_backward = _loss_backward(n)
        if loss_backward is None or not rw.take():
            continue
        nll, saved, log_probs = loss_backward
        dtype = n.args[3]
        whole = _whole_loss(log_probs, nll, n)
        if whole is None:
            with graph.inserting_before(n):
                fused = graph.call_function(torch.ops.memplan.log_softmax_nll_backward.default, (*nll.args, dtype))
            fused.meta = {**n.meta}
            n.replace_all_uses_with(fused)
            outputs: list[tuple[fx.Node, Ref]] = [(n, fused)]
            replaced = [n, nll, saved]
        else:
            forward, product, chain = whole
            bias, *factors = (None, *product.args) if product.target is aten.mm.default else product.args
            with graph.inserting_before(forward):
                fused = graph.call_function(torch.ops.memplan.linear_cross_entropy.default,
                                            (bias, *factors, *forward.args[1:5]))
                grad = graph.call_function(operator.getitem, (fused, 2))
            fused.meta = {"val": _fake_call(fused, n.meta["val"])}   # the gradient shares its scratch's storage
            grad.meta = {**n.meta, "val": fused.meta["val"][2]}
            outputs = [(n, grad)]
            for item in list(forward.users):             # the loss and its total weight keep their nodes
                outputs.append((item, (fused, item.args[1])))
                item.args = (fused, item.args[1])
            n.replace_all_uses_with(grad)
            replaced = [n, nll, nll.args[0], saved, forward, *chain]
        _erase_replaced(graph, replaced)
        rw.done(outputs)


def fuse_tanh_gelu(graph: fx.Graph, rw: Rewriter, on_cpu: bool) -> None:
    """Rewrite each written-out tanh GELU, `(x * h) * (tanh((x + x ** p * k) * c) + 1)` (transformers'
    `gelu_new`), and its backward into the ops of runtime/tracing/fused_gelu.py (the same ATen kernels on the same
    operands; the backward keeps `x` and the tanh where it kept four tensors). Only where the graph holds
    exactly the ops autograd writes for it, every intermediate feeds only the GELU and its backward, and
    `x`, the output gradient and every intermediate are non-empty, contiguous and of one shape, dtype and
    device. CPU graphs only (docs/graph-format.md)."""
    for tb in list(graph.nodes) if on_cpu else ():
        if tb.op != "call_function" or tb.target is not torch.ops.aten.tanh_backward.default:
            continue
        match = _tanh_gelu(tb)
        if match is None or not rw.take():
            continue
        x, g, consts, forward, backward = match
        y, grad_x = forward[-1], backward[-1]
        half, power, coeff, scale, one = consts
        with graph.inserting_before(y):
            t_new = graph.call_function(torch.ops.memplan.gelu_tanh_inner.default, (x, power, coeff, scale))
            y_new = graph.call_function(torch.ops.memplan.gelu_tanh_outer.default, (x, t_new, half, one))
        for node in (t_new, y_new):
            node.meta = {**y.meta, "val": _fake_call(node, y.meta["val"])}
        with graph.inserting_before(grad_x):
            fused_grad = graph.call_function(torch.ops.memplan.gelu_tanh_backward.default, (g, x, t_new, *consts))
        fused_grad.meta = {**grad_x.meta, "val": _fake_call(fused_grad, grad_x.meta["val"])}
        y.replace_all_uses_with(y_new)
        grad_x.replace_all_uses_with(fused_grad)
        _erase_replaced(graph, [*forward, *backward, tb.args[1]])
        rw.done([(y, y_new), (grad_x, fused_grad)])


def split_dropout(graph: fx.Graph, rw: Rewriter, on_cpu: bool) -> None:
    """Rewrite each training `native_dropout(x, p, True)` (0 < p < 1, x contiguous and floating) whose results
    are read through `getitem`s into `memplan::dropout_mask(x, p)` and `memplan::dropout_apply(x, mask, p)`
    (runtime/tracing/dropout.py; the same draws as ATen's CPU kernel): the output can then be recomputed from the
    kept mask without drawing again. CPU graphs only: CUDA's fused kernel draws in another order."""
    for n in list(graph.nodes) if on_cpu else ():
        if n.op != "call_function" or n.target is not torch.ops.aten.native_dropout.default:
            continue
        args = {**dict(zip(("input", "p", "train"), n.args)), **n.kwargs}
        x, p = args["input"], args["p"]
        out_val, mask_val = n.meta["val"]
        if (args.get("train") is False or not isinstance(p, float) or not 0 < p < 1
                or not out_val.is_floating_point() or not x.meta["val"].is_contiguous()
                or not all(u.target is operator.getitem for u in n.users) or not rw.take()):
            continue
        with graph.inserting_before(n):
            mask = graph.call_function(torch.ops.memplan.dropout_mask.default, (x, p))
            out = graph.call_function(torch.ops.memplan.dropout_apply.default, (x, mask, p))
        mask.meta, out.meta = {**n.meta, "val": mask_val}, {**n.meta, "val": out_val}
        outputs: list[tuple[fx.Node, Ref]] = []
        for item in list(n.users):
            replacement = out if item.args[1] == 0 else mask
            outputs.append((item, replacement))
            item.replace_all_uses_with(replacement)
            graph.erase_node(item)
        graph.erase_node(n)
        rw.done(outputs, random=n)


PASSES: list[tuple[str, Callable[[fx.Graph, Rewriter, bool], None]]] = [
    ("split_convolution_backward", split_convolution_backward),
    ("pointwise_input_gradient", pointwise_input_gradient),
    ("chunk_cross_entropy", chunk_cross_entropy),
    ("fuse_cross_entropy", fuse_cross_entropy),
    ("fuse_tanh_gelu", fuse_tanh_gelu),
    ("split_dropout", split_dropout),
]
"""Capture's rewrite passes in the order they run; the names key graph and plan records."""

WITHIN_TOLERANCE: dict[str, tuple[float, float]] = {"chunk_cross_entropy": (1e-4, 1e-5)}
"""Passes that compute in another summation order by design, and the (rtol, atol) (the validation's float32
defaults) their instances are checked and recorded within (`meta["rewrites"]["within_tolerance"]`)."""


def _tanh_gelu(tb: fx.Node) -> tuple[fx.Node, fx.Node, tuple, list[fx.Node], list[fx.Node]] | None:
    """(x, the output gradient, the constants (h, p, k, c, 1), the forward's nodes ending with its result,
    the backward's nodes ending with x's gradient) of the tanh GELU whose backward runs `tb`, the
    `tanh_backward`; None unless `_fuse_tanh_gelu` may rewrite it."""
    aten = torch.ops.aten

    def op(node, target, *args) -> bool:
        """Whether `node` is `target(*args)`; an argument `_NODE` matches any FX node, `_NUMBER` any number."""
        return (isinstance(node, fx.Node) and node.target is target and not node.kwargs
                and len(node.args) == len(args) and all(_argument_matches(b, a) for a, b in zip(args, node.args)))

    def only(nodes) -> fx.Node | None:
        nodes = list(nodes)
        return nodes[0] if len(nodes) == 1 else None

    g_half_x, saved = tb.args
    tanh = _alias_base(saved)
    if not op(tanh, aten.tanh.default, _NODE):
        return None
    arg = tanh.args[0]
    if not (op(arg, aten.mul.Tensor, _NODE, _NUMBER)
            and op(x_plus := arg.args[0], aten.add.Tensor, _NODE, _NODE)):
        return None
    x, cube_k = x_plus.args
    if not (op(cube_k, aten.mul.Tensor, _NODE, _NUMBER)
            and op(cube := cube_k.args[0], aten.pow.Tensor_Scalar, x, _NUMBER)):
        return None
    power, coeff, scale = cube.args[1], cube_k.args[1], arg.args[1]
    one_plus = only(u for u in tanh.users if op(u, aten.add.Tensor, tanh, _NUMBER))
    if one_plus is None or len(one_plus.users) != 2:
        return None
    one = one_plus.args[1]
    y = only(u for u in one_plus.users
             if op(u, aten.mul.Tensor, _NODE, one_plus) and op(u.args[0], aten.mul.Tensor, x, _NUMBER))
    if y is None or not op(g_half_x, aten.mul.Tensor, _NODE, y.args[0]):
        return None
    half_x, g = y.args[0], g_half_x.args[0]
    half = half_x.args[1]
    g_one_plus = only(u for u in one_plus.users if u is not y)
    d = only(tb.users)
    if not (op(g_one_plus, aten.mul.Tensor, g, one_plus) and op(d, aten.mul.Tensor, tb, scale)):
        return None
    d_k = only(u for u in d.users if op(u, aten.mul.Tensor, d, coeff))
    d_sum = only(u for u in d.users if u is not d_k)
    if not (d_k is not None and op(d_sum, aten.add.Tensor, d, _NODE)
            and op(d_k_sq := d_sum.args[1], aten.mul.Tensor, d_k, _NODE)
            and op(sq_p := d_k_sq.args[1], aten.mul.Scalar, _NODE, power)
            and op(sq := sq_p.args[0], aten.pow.Tensor_Scalar, x, power - 1)):
        return None
    grad_x, g_one_plus_half = only(d_sum.users), only(g_one_plus.users)
    if not (op(g_one_plus_half, aten.mul.Tensor, g_one_plus, half)
            and op(grad_x, aten.add.Tensor, d_sum, g_one_plus_half)):
        return None
    forward = [half_x, cube, cube_k, x_plus, arg, tanh, one_plus, y]
    backward = [g_half_x, g_one_plus, tb, d, d_k, sq, sq_p, d_k_sq, d_sum, g_one_plus_half, grad_x]
    readers = {half_x: {y, g_half_x}, cube: {cube_k}, cube_k: {x_plus}, x_plus: {arg}, arg: {tanh},
               tanh: {one_plus, tb}, one_plus: {y, g_one_plus}, g_half_x: {tb}, g_one_plus: {g_one_plus_half},
               tb: {d}, d: {d_k, d_sum}, d_k: {d_k_sq}, sq: {sq_p}, sq_p: {d_k_sq}, d_k_sq: {d_sum},
               d_sum: {grad_x}, g_one_plus_half: {grad_x}}
    vals = [n.meta["val"] for n in (x, g, *forward, *backward)]
    first = vals[0]
    if not (all(_only_users(n, allowed) for n, allowed in readers.items()) and first.numel() > 0
            and first.is_floating_point()
            and all((v.shape, v.dtype, v.device) == (first.shape, first.dtype, first.device) and v.is_contiguous()
                    for v in vals)):
        return None
    return x, g, (half, power, coeff, scale, one), forward, backward


_NODE, _NUMBER = object(), object()
"""Wildcards of `_tanh_gelu`'s pattern: any FX node, any number."""


def _argument_matches(value: Any, pattern: Any) -> bool:
    """Whether an FX argument `value` matches `pattern`: a wildcard, or a node or number equal to it."""
    if pattern is _NODE:
        return isinstance(value, fx.Node)
    if pattern is _NUMBER or not isinstance(pattern, fx.Node):
        number = isinstance(value, (int, float)) and not isinstance(value, bool)
        return number and (pattern is _NUMBER or value == pattern)
    return value is pattern


def _erase_replaced(graph: fx.Graph, replaced: list[fx.Node]) -> None:
    """Erase the `replaced` nodes that nothing but shape checks reads any more (and those checks), readers
    first, each with the chain of saving aliases (`_saving_alias`) left unread above it."""
    order = {m: i for i, m in enumerate(graph.nodes)}
    for m in sorted(dict.fromkeys(replaced), key=order.__getitem__, reverse=True):
        while _saving_alias(m) and not m.users:
            m, dead = m.args[0], m
            graph.erase_node(dead)
        if all(_is_check(u) for u in m.users):
            for check in list(m.users):
                graph.erase_node(check)
            graph.erase_node(m)


def _fake_call(node: fx.Node, like: torch.Tensor):
    """The result of `node`'s op on fake tensors shaped like its arguments' values, made in the fake mode
    of `like` (a value the trace computed: the placeholders' values may come from another mode)."""
    vals = [a.meta["val"] if isinstance(a, fx.Node) else a for a in node.args]
    with getattr(like, "fake_mode", None) or nullcontext():
        return node.target(*(torch.empty_strided(v.shape, v.stride(), dtype=v.dtype, device=v.device)
                             if isinstance(v, torch.Tensor) else v for v in vals))


def _is_check(node: fx.Node) -> bool:
    """A shape or dtype assertion: an op returning nothing."""
    return isinstance(node.target, torch._ops.OpOverload) and not node.target._schema.returns


def _alias_base(node: fx.Node) -> fx.Node:
    """`node` without the chain of saving aliases (`_saving_alias`) through which the joint graph saves
    tensors."""
    while _saving_alias(node):
        node = node.args[0]
    return node


def _whole_loss(log_probs: fx.Node, nll: fx.Node,
                backward: fx.Node) -> tuple[fx.Node, fx.Node, list[fx.Node]] | None:
    """(the `nll_loss_forward`, the logits' `mm` / `addmm`, the nodes from `log_probs` to the product) of
    the loss whose backward is `nll` then `backward`, where `memplan::linear_cross_entropy` can replace all
    of it: the seed is `ones_like(loss)`, the forward reads `log_probs` with the backward's target, weight,
    reduction and ignore index, and the product (viewed with its own shape) and `log_probs` feed nothing
    else."""
    aten = torch.ops.aten
    seed, _, target, weight, reduction, ignore_index, total_weight = nll.args
    # the seed may reach the backward through an alias: autograd's engine aliases a gradient it cannot steal,
    # which depends on the tensor's reference count at that moment, so the same step traces either way
    seed = _alias_base(seed) if isinstance(seed, fx.Node) else seed
    if not (isinstance(seed, fx.Node) and seed.target is aten.ones_like.default and _only_users(seed, {nll})
            and len(seed.args) == 1 and seed.args[0].target is operator.getitem and seed.args[0].args[1] == 0):
        return None
    forward = seed.args[0].args[0]
    if not (forward.target is aten.nll_loss_forward.default
            and tuple(forward.args) == (log_probs, target, weight, reduction, ignore_index)
            and isinstance(total_weight, fx.Node) and total_weight.target is operator.getitem
            and total_weight.args == (forward, 1) and set(total_weight.users) == {nll}
            and len(log_probs.args) == 3 and log_probs.args[1] in (1, -1) and log_probs.args[2] is False
            and _only_users(log_probs, {forward, nll, backward})):
        return None
    chain, product = [log_probs], log_probs.args[0]
    while product.target in (aten.view.default, aten._unsafe_view.default) and _only_users(product, {chain[-1]}):
        chain.append(product)
        product = product.args[0]
    mm = product.target is aten.mm.default and len(product.args) == 2
    addmm = product.target is aten.addmm.default and len(product.args) == 3 and not product.kwargs
    if not ((mm or addmm) and _only_users(product, {chain[-1]})
            and tuple(product.meta["val"].shape) == tuple(log_probs.meta["val"].shape)):
        return None
    return forward, product, [*chain, product]


def _only_users(node: fx.Node, allowed: set[fx.Node]) -> bool:
    """Whether every reader of `node` is in `allowed`, a shape check, or a saving alias of it
    (`_saving_alias`) that only such readers read."""
    return all(user in allowed or _is_check(user) or (_saving_alias(user) and _only_users(user, allowed))
               for user in node.users)


def _saving_alias(node: Any) -> bool:
    """Whether `node` is an identity op through which the joint graph saves a tensor for the backward:
    `aten.alias` (torch 2.14) or `aten.detach` (torch 2.11, seen on a GPU host)."""
    return isinstance(node, fx.Node) and node.target in (torch.ops.aten.alias.default, torch.ops.aten.detach.default)


def _pointwise_input_gradient(graph: fx.Graph, grad: fx.Node, weight: fx.Node, input_grad: torch.Tensor) -> fx.Node:
    """Insert dx = W^T dy of a pointwise convolution as `bmm(expand(W^T), dy)` over (N, C_out, HW) views,
    viewed back to (N, C_in, H, W), and return that view: one GEMM per image, as ATen's native path
    computes it."""
    aten = torch.ops.aten
    g, w = grad.meta["val"], weight.meta["val"]
    n, c_out, c_in = g.shape[0], w.shape[0], w.shape[1]
    steps = [(aten.view.default, [c_out, c_in]), (aten.t.default,), (aten.expand.default, [n, c_in, c_out])]

    def add(op, *args):
        node = graph.call_function(op, args)
        node.meta = {"val": _fake_call(node, g)}
        return node

    w_t = weight
    for op, *rest in steps:
        w_t = add(op, w_t, *rest)
    product = add(aten.bmm.default, w_t, add(aten.view.default, grad, [n, c_out, math.prod(g.shape[2:])]))
    return add(aten.view.default, product, list(input_grad.shape))

