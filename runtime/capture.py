"""Capture one training step as a joint ATen graph (AOTAutograd) and fold it into an operator graph.

Folding (docs/graph-format.md): every FX node that allocates a new storage starts an operator node;
`getitem`s of its tuple result and every view of its storage (transitively) join that node. Views of
graph inputs and module constants allocate nothing and belong to no producer: they are replicated into
each node that reads them. Each value is one storage, so its bytes are counted once. Ops that return nothing (metadata
assertions such as `aten._assert_tensor_metadata`) are dropped: they compute no value and check
shapes and dtypes that the fingerprint already fixes.

Before folding, concatenations are chained (`_chain_concatenations`): a `cat` whose list extends the
list of an earlier `cat` along the same dimension reads that result instead of the pieces again. The
value is the same; the graph becomes the one the ACG paper's DenseNet has (cat(x, new) per layer), and
each piece is needed only until the next concatenation. Each convolution backward is split into its
weight- and input-gradient halves (`_split_convolution_backward`), and cross-entropy is fused into ops
that hold fewer logits-sized tensors (`_fuse_cross_entropy`, runtime/fused_loss.py), and the written-out
tanh GELU into ops that keep two of its four saved tensors (`_fuse_tanh_gelu`, runtime/fused_gelu.py), and
each training dropout is split into its mask's draw and its product (`_split_dropout`, runtime/dropout.py);
all bit-identical. The two fusions apply to CPU graphs only: their ops run block by block, a few small
kernels per block, and on a GPU those launches cost more than the memory saves (measured on an H200, GPT-2
of bench/peers.py: eager 13 ms a step, the fused graph's no-recomputation schedule 28 ms, the captured
one's 0.88x eager's time). So does the dropout split: CUDA's fused kernel draws in an order no separate
draw reproduces.
"""

from __future__ import annotations

import math
import operator
import os
import sys
import traceback
import types
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import fx, nn
from torch._functorch.aot_autograd import aot_export_module
from torch._subclasses.fake_tensor import DataDependentOutputException, DynamicOutputShapeException

from runtime import dropout, fused_gelu, fused_loss  # noqa: F401  (register the memplan:: ops rewritten into)
from runtime.graph import Node, OpGraph, Value
from runtime.modules import META_KEY, boundary_hooks, strip_boundaries

# Ops whose schema declares a fresh result but whose kernel returns a view of the input.
_VIEW_LIKE = {torch.ops.aten._unsafe_view.default}
_MODEL_PREFIX = "model."


class CaptureError(RuntimeError):
    """The training step cannot be captured or folded into an operator graph."""


@dataclass(eq=False)
class Program:
    """The captured FX joint graph and its mapping onto the operator graph (never serialized)."""

    gm: fx.GraphModule
    placeholders: list[fx.Node]
    params: list[str]                    # FQN per parameter placeholder, in placeholder order
    buffers: list[str]                   # FQN per buffer placeholder
    outputs: list[fx.Node]               # FX graph outputs, in FX order
    mutated_buffers: list[str]           # FQN of the buffer updated by each leading FX output
    grad_params: list[str]               # FQN of the parameter of each trailing gradient output
    groups: list[list[fx.Node]]          # per operator node: its FX nodes in execution order
    value_of: dict[fx.Node, int]         # tensor-valued FX node -> value (storage) id
    primary: list[Any]                   # value id -> FX node holding it, or (tuple node, index)
    random_devices: dict[int, str] = field(default_factory=dict)  # node id -> device of its RNG
    batch_signature: tuple = ()


class _LossStep(nn.Module):
    """`loss_fn(model, *batch)` as a module returning a 1-tuple, the form `aot_export_module` needs."""

    def __init__(self, model: nn.Module, loss_fn: Callable[..., torch.Tensor]):
        super().__init__()
        self.model = model
        self.loss_fn = loss_fn

    def forward(self, *batch: torch.Tensor) -> tuple[torch.Tensor]:
        loss = self.loss_fn(self.model, *batch)
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise CaptureError(f"loss_fn must return a scalar tensor, got {type(loss).__name__} "
                               f"{tuple(getattr(loss, 'shape', ()))}.")
        return (loss,)


def batch_signature(model: nn.Module, batch: tuple) -> tuple:
    """What a captured graph depends on besides the model's structure: batch shapes, dtypes, devices
    and the training flag."""
    return (model.training,) + tuple((tuple(t.shape), t.dtype, t.device) for t in batch)


def capture(model: nn.Module, loss_fn: Callable[..., torch.Tensor], batch: tuple | list, *,
            record_modules: bool = True) -> OpGraph:
    """Trace one training step (forward, loss, backward) with `aot_export_module(trace_joint=True)` and
    fold it into an operator graph. The returned graph carries the FX program in `.program`. With
    `record_modules`, `meta["node_modules"]` names, per operator node, the repeated module
    (runtime/modules.py) whose forward computed it, or None."""
    batch = tuple(batch)
    for i, t in enumerate(batch):
        if not isinstance(t, torch.Tensor):
            raise CaptureError(f"batch[{i}] is a {type(t).__name__}; every batch element must be a tensor "
                               f"(pass other settings through loss_fn).")
        if t.requires_grad:
            raise CaptureError(f"batch[{i}] requires grad; batch tensors must be plain data (detach them).")
    frozen = [name for name, p in model.named_parameters() if not p.requires_grad]
    if frozen:
        raise CaptureError(f"parameters {frozen[:5]} do not require grad; memplan captures full training "
                           f"steps, so every parameter must require grad.")
    cuda = sorted({torch.cuda.current_device() if t.device.index is None else t.device.index
                   for t in [*batch, *model.parameters()] if t.device.type == "cuda"})
    hooks = boundary_hooks(model) if record_modules else nullcontext()
    with torch.random.fork_rng(devices=cuda), hooks:       # tracing must not move the generators
        try:
            gm, sig = aot_export_module(_LossStep(model, loss_fn), batch, trace_joint=True, output_loss_index=0)
        except AssertionError as exc:                      # its output-name bookkeeping (torch 2.14)
            if "gradients_to_parameters" not in str(exc):
                raise
            raise CaptureError(
                "torch's aot_export_module cannot export this training step: two parameters receive the very "
                "same gradient tensor (parameters that enter the model only through their sum, such as "
                "`x @ (a + b)`), and the export names gradients by tensor. Make them one parameter, or give "
                "one of them an op of its own (`a + b * 1`).") from exc
        except (DataDependentOutputException, DynamicOutputShapeException) as exc:
            raise CaptureError(
                f"the training step depends on a tensor's values at {_caller(exc)}, which capture cannot trace: "
                "it records one step's ops for every batch, so no Python branch may read a tensor (`if t`, "
                "`.item()`, `bool(t)`) and no op's output shape may depend on the data (`nonzero`, "
                "`masked_select`). Compute the branch with tensor ops (`torch.where`) or move it out of the "
                "step. transformers language models take such a branch when run with neither a key/value "
                "cache nor an attention mask (a check for packed sequences): run them with `use_cache=True` "
                "or pass `attention_mask`, as memplan's `causal_lm` loss does.") from exc
    strip_boundaries(gm.graph)
    calls = sum(1 for n in gm.graph.nodes if n.op == "call_function")
    gm.graph.eliminate_dead_code()
    _drop_empty_concatenations(gm.graph)
    _chain_concatenations(gm.graph)
    on_cpu = _cpu_graph(model, batch)
    _split_convolution_backward(gm.graph, grouped=on_cpu)
    if on_cpu:                                             # CPU graphs only (module docstring)
        _fuse_cross_entropy(gm.graph)
        _fuse_tanh_gelu(gm.graph)
        _split_dropout(gm.graph)
    graph = _fold(gm, sig, model, batch)
    gm.recompile()
    graph.meta["aten_call_nodes"] = calls                  # as exported, before dead-code removal
    graph.program.batch_signature = batch_signature(model, batch)
    return graph


def _caller(exc: BaseException) -> str:
    """`file:line in function` of the innermost frame of `exc`'s traceback outside torch: the model's or
    the loss's line that read a tensor's value."""
    torch_dir = os.path.dirname(torch.__file__)
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if not f.filename.startswith(torch_dir)]
    return f"{frames[-1].filename}:{frames[-1].lineno} in {frames[-1].name}" if frames else "an unknown line"


def _drop_empty_concatenations(graph: fx.Graph) -> None:
    """Replace `cat([e, ..., x, ...], d)` whose pieces other than `x` are empty by `x` itself. Transformers'
    key/value cache starts each layer's keys and values as `cat([tensor([]), k], -2)`: a copy of `k`, which
    attention's backward then saves beside the projection `k` is a view of (GPT-2: 2 of the 5 MiB a layer's
    attention saves here; attention then reads the keys and values `use_cache=False` gives it). The copy is
    dropped where `x` has the result's strides or every reader reads its operands through their strides
    (`_STRIDED_READERS`), and where `x` pins no larger storage than the copy did (`_pins_more`)."""
    cat = torch.ops.aten.cat.default
    for n in list(graph.nodes):
        if n.op != "call_function" or n.target is not cat:
            continue
        pieces = [p for p in n.args[0] if p.meta["val"].numel() > 0]
        if len(pieces) != 1 or any(u.op == "output" for u in n.users):
            continue
        x, val = pieces[0].meta["val"], n.meta["val"]
        if (x.shape, x.dtype, x.device) != (val.shape, val.dtype, val.device):
            continue
        if x.stride() != val.stride() and any(u.target not in _STRIDED_READERS for u in n.users):
            continue
        if _pins_more(pieces[0], n):
            continue
        n.replace_all_uses_with(pieces[0])
        graph.erase_node(n)


def _pins_more(piece: fx.Node, copy: fx.Node) -> bool:
    """Whether the copy's readers, reading `piece` instead, would keep a larger storage alive: `piece` views
    an activation larger than the copy that some reader does not read already."""
    base = _storage_root(piece)
    if base is piece or base.op in ("placeholder", "get_attr") or \
            _storage_bytes(base.meta["val"]) <= _storage_bytes(copy.meta["val"]):
        return False
    return any(base not in {_storage_root(a) for a in u.all_input_nodes} for u in copy.users)


_STRIDED_READERS = {torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
                    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default}
"""Ops whose results are bit-identical on strided and contiguous operands (tested)."""


def _storage_root(node: fx.Node) -> fx.Node:
    """The node that allocated the storage `node` views (`node` itself if it allocates; an element of an
    allocating multi-output op is its `getitem`)."""
    while node.op == "call_function":
        view = node.args[0] if node.target is operator.getitem else node    # an element of split's list views
        if not isinstance(view.target, torch._ops.OpOverload) or (base := _view_base(view)) is None:
            return node
        node = base
    return node


def _chain_concatenations(graph: fx.Graph) -> None:
    """Rewrite `cat([a, ..., k, l, ...], d)` as `cat([c, l, ...], d)` where `c = cat([a, ..., k], d)` is an
    earlier node of the graph (the longest such prefix). Torchvision's DenseNet concatenates every earlier
    feature map in each layer; chained, each concatenation reads only the previous one and the newest
    features, which frees the pieces early and gives checkpointing solvers a chain to split."""
    cat = torch.ops.aten.cat.default
    seen: dict[tuple, fx.Node] = {}                # (dim, pieces) -> the earlier cat computing them
    for n in graph.nodes:
        if n.op != "call_function" or n.target is not cat:
            continue
        pieces = tuple(n.args[0])
        dim = n.args[1] if len(n.args) > 1 else n.kwargs.get("dim", 0)
        for cut in range(len(pieces) - 1, 0, -1):
            prefix = seen.get((dim, pieces[:cut]))
            if prefix is not None and prefix.meta["val"].dtype == n.meta["val"].dtype:
                n.args = ([prefix, *pieces[cut:]], *n.args[1:])
                break
        seen.setdefault((dim, pieces), n)


def _cpu_graph(model: nn.Module, batch: tuple) -> bool:
    """Whether the step's parameters and batch are all on the CPU: every rewrite of capture applies to such
    a graph, and on a GPU those that cost time or change rounding there do not (module docstring)."""
    return all(t.device.type == "cpu" for t in [*batch, *model.parameters()])


def _split_convolution_backward(graph: fx.Graph, grouped: bool) -> None:
    """Split each `convolution_backward` that computes both the input and the weight gradient into a
    weight-gradient node followed by an input-gradient node (MONeT appendix D): the weight gradient
    (`convolution_backward` with output mask `[False, True, bias]`) reads the forward input; the input
    gradient, the transposed convolution of the output gradient with the weight, does not. Once the
    weight gradient is computed the forward input can be freed, before the input gradient is allocated.
    A pointwise convolution's input gradient (`_pointwise_input_gradient`) is a batched matrix product.
    On CPU both halves are bit-identical to the joint call (tested); transposed convolutions stay joint,
    and so do grouped ones unless `grouped` (CPU graphs): on CUDA, ATen's depthwise input gradient and the
    grouped transposed convolution round differently (an H200, MobileNet-V2: 4.4e-5 on a weight gradient
    downstream), where ungrouped convolutions split bit-identically there too (ResNet-18 validated with
    gradient error 0)."""
    aten = torch.ops.aten
    for n in list(graph.nodes):
        if n.op != "call_function" or n.target is not aten.convolution_backward.default:
            continue
        (grad, x, weight, bias_sizes, stride, padding, dilation, transposed, output_padding, groups,
         mask) = n.args
        if transposed or not (mask[0] and mask[1]) or (groups != 1 and not grouped):
            continue
        val = n.meta["val"]
        out_size, in_size, k = grad.meta["val"].shape[2:], x.meta["val"].shape[2:], weight.meta["val"].shape[2:]
        # output_padding that makes the transposed convolution's output the forward input's size
        pad = [i - ((o - 1) * s - 2 * p + d * (kk - 1) + 1)
               for i, o, s, p, d, kk in zip(in_size, out_size, stride, padding, dilation, k)]
        with graph.inserting_before(n):
            weight_grad = graph.call_function(n.target, (*n.args[:-1], [False, True, mask[2]]))
            weight_grad.meta = {**n.meta, "val": (None, *val[1:])}
            if _pointwise(grad, weight, val[0], stride, padding, groups):
                input_grad = _pointwise_input_gradient(graph, grad, weight, val[0])
            else:
                input_grad = graph.call_function(aten.convolution.default,
                                                 (grad, weight, None, stride, padding, dilation, True, pad, groups))
            input_grad.meta = {**n.meta, "val": val[0]}
        for user in list(n.users):                         # getitems of the joint result
            if user.args[1] == 0:
                user.replace_all_uses_with(input_grad)
                graph.erase_node(user)
            else:
                user.args = (weight_grad, user.args[1])
        graph.erase_node(n)


def _fuse_cross_entropy(graph: fx.Graph) -> None:
    """Rewrite each cross-entropy loss into the ops of runtime/fused_loss.py (bit-identical, fewer
    logits-sized tensors): the whole loss, from the logits' `mm` / `addmm` to the logits' gradient, into
    `memplan::linear_cross_entropy` where the logits and log-probabilities feed nothing else and the
    backward's seed is `ones_like(loss)`; else the backward pair into `memplan::log_softmax_nll_backward`.
    Either needs a contiguous rows x classes `_log_softmax` over dimension 1 whose loss gradient has no
    other reader."""
    aten = torch.ops.aten
    for n in list(graph.nodes):
        if n.op != "call_function" or n.target is not aten._log_softmax_backward_data.default:
            continue
        nll, saved, dim, dtype = n.args
        log_probs = _alias_base(saved)
        if not (isinstance(nll, fx.Node) and nll.target is aten.nll_loss_backward.default and len(nll.users) == 1
                and len(nll.args) == 7 and nll.args[1] is log_probs):
            continue
        lp = log_probs.meta["val"]
        if lp.dim() != 2 or dim not in (1, -1) or lp.dtype != dtype or not lp.is_contiguous():
            continue
        whole = _whole_loss(log_probs, nll, n)
        if whole is None:
            with graph.inserting_before(n):
                fused = graph.call_function(torch.ops.memplan.log_softmax_nll_backward.default, (*nll.args, dtype))
            fused.meta = {**n.meta}
            n.replace_all_uses_with(fused)
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
            for item in list(forward.users):             # the loss and its total weight keep their nodes
                item.args = (fused, item.args[1])
            n.replace_all_uses_with(grad)
            replaced = [n, nll, nll.args[0], saved, forward, *chain]
        _erase_replaced(graph, replaced)


def _fuse_tanh_gelu(graph: fx.Graph) -> None:
    """Rewrite each written-out tanh GELU, `(x * h) * (tanh((x + x ** p * k) * c) + 1)` (transformers'
    `gelu_new`), and its backward into the ops of runtime/fused_gelu.py (bit-identical; the backward keeps
    `x` and the tanh where it kept four tensors). Only where the graph holds exactly the ops autograd
    writes for it, every intermediate feeds only the GELU and its backward, and `x`, the output gradient
    and every intermediate are non-empty, contiguous and of one shape, dtype and device."""
    for tb in list(graph.nodes):
        if tb.op != "call_function" or tb.target is not torch.ops.aten.tanh_backward.default:
            continue
        match = _tanh_gelu(tb)
        if match is None:
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


def _split_dropout(graph: fx.Graph) -> None:
    """Rewrite each training `native_dropout(x, p, True)` (0 < p < 1, x contiguous and floating) whose results
    are read through `getitem`s into `memplan::dropout_mask(x, p)` and `memplan::dropout_apply(x, mask, p)`
    (runtime/dropout.py; the same draws, bit-identical output): the output can then be recomputed from the
    kept mask without drawing again."""
    for n in list(graph.nodes):
        if n.op != "call_function" or n.target is not torch.ops.aten.native_dropout.default:
            continue
        args = {**dict(zip(("input", "p", "train"), n.args)), **n.kwargs}
        x, p = args["input"], args["p"]
        out_val, mask_val = n.meta["val"]
        if (args.get("train") is False or not isinstance(p, float) or not 0 < p < 1
                or not out_val.is_floating_point() or not x.meta["val"].is_contiguous()
                or not all(u.target is operator.getitem for u in n.users)):
            continue
        with graph.inserting_before(n):
            mask = graph.call_function(torch.ops.memplan.dropout_mask.default, (x, p))
            out = graph.call_function(torch.ops.memplan.dropout_apply.default, (x, mask, p))
        mask.meta, out.meta = {**n.meta, "val": mask_val}, {**n.meta, "val": out_val}
        for item in list(n.users):
            item.replace_all_uses_with(out if item.args[1] == 0 else mask)
            graph.erase_node(item)
        graph.erase_node(n)


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
    if not (isinstance(seed, fx.Node) and seed.target is aten.ones_like.default and len(seed.users) == 1
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


def _pointwise(grad: fx.Node, weight: fx.Node, input_grad: torch.Tensor, stride, padding, groups) -> bool:
    """Whether a convolution is pointwise (1x1 kernel, stride 1, no padding, one group; contiguous output
    gradient, weight and input gradient) and ATen's CPU `convolution_backward` takes its native GEMM path
    for it rather than oneDNN's: float64, or float32 below 16 images on one thread (ATen's `use_mkldnn`
    at capture time). Its input gradient is then best computed as a matrix product."""
    w, g = weight.meta["val"], grad.meta["val"]
    native = g.device.type == "cpu" and (g.dtype == torch.float64 or (
        g.dtype == torch.float32 and g.shape[0] < 16 and torch.get_num_threads() == 1))
    return (native and groups == 1 and all(k == 1 for k in w.shape[2:]) and all(s == 1 for s in stride)
            and all(p == 0 for p in padding) and w.is_contiguous() and g.is_contiguous()
            and input_grad.is_contiguous())


def _pointwise_input_gradient(graph: fx.Graph, grad: fx.Node, weight: fx.Node, input_grad: torch.Tensor) -> fx.Node:
    """Insert dx = W^T dy of a pointwise convolution as `bmm(expand(W^T), dy)` over (N, C_out, HW) views,
    viewed back to (N, C_in, H, W), and return that view: one GEMM per image, as ATen's native path
    computes it (bit-identical, tested), where the transposed convolution is up to 2x slower on CPU."""
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


def _strip(fqn: str) -> str:
    return fqn[len(_MODEL_PREFIX):] if fqn.startswith(_MODEL_PREFIX) else fqn


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _storage_bytes(t: torch.Tensor) -> int:
    """Bytes of the storage a fresh result needs: the extent its sizes and strides reach."""
    if t.numel() == 0:
        return 0
    extent = t.storage_offset() + 1 + sum((s - 1) * st for s, st in zip(t.shape, t.stride()))
    return int(extent) * t.element_size()


def _view_base(node: fx.Node) -> fx.Node | None:
    """The argument whose storage `node` aliases, or None if `node` allocates."""
    op = node.target
    if op in _VIEW_LIKE:
        return node.args[0]
    schema = op._schema
    aliased = [r.alias_info for r in schema.returns if r.alias_info is not None]
    if not aliased:
        return None
    if any(a.is_write for a in aliased):
        raise CaptureError(f"FX node {node.name} runs the in-place op {op}; the joint graph should be "
                           f"functional. Is the model mutating a tensor in a way AOTAutograd cannot remove?")
    sets = aliased[0].before_set  # empty for list results such as split's `Tensor(a)[]`
    for arg, value in zip(schema.arguments, node.args):
        info = arg.alias_info
        if info is not None and not info.is_write and (not sets or info.before_set & sets) \
                and isinstance(value, fx.Node):
            return value
    raise CaptureError(f"cannot find the aliased argument of view op {op} at FX node {node.name}.")


def _fold(gm: fx.GraphModule, sig: Any, model: nn.Module, batch: tuple) -> OpGraph:
    fx_nodes = list(gm.graph.nodes)
    position = {n: i for i, n in enumerate(fx_nodes)}
    placeholders = [n for n in fx_nodes if n.op == "placeholder"]
    output_node = next(n for n in fx_nodes if n.op == "output")
    fx_outputs = list(output_node.args[0])

    values: list[dict[str, Any]] = []
    primary: list[Any] = []
    value_of: dict[fx.Node, int] = {}
    owner: dict[int, int] = {}                 # value id -> group index (absent for graph inputs)
    constants: set[fx.Node] = set()            # get_attr nodes and views of graph inputs / constants
    group_of: dict[fx.Node, int] = {}
    groups: list[list[fx.Node]] = []
    heads: list[fx.Node] = []                  # the allocating FX node of each group
    tuple_values: dict[fx.Node, list[int | None]] = {}
    dropped: list[fx.Node] = []                # ops returning nothing (assertions)

    def new_value(t: torch.Tensor, kind: str, name: str, where: Any, group: int | None) -> int:
        vid = len(values)
        values.append({"bytes": _storage_bytes(t), "shape": tuple(int(s) for s in t.shape),
                       "dtype": _dtype_name(t.dtype), "kind": kind, "name": name})
        primary.append(where)
        if group is not None:
            owner[vid] = group
        return vid

    # Graph inputs: parameters, buffers, batch (placeholder order).
    params, buffers = [], []
    for i, ph in enumerate(placeholders):
        if ph.name in sig.inputs_to_parameters:
            kind, name = "param", _strip(sig.inputs_to_parameters[ph.name])
            params.append(name)
        elif ph.name in sig.inputs_to_buffers:
            kind, name = "buffer", _strip(sig.inputs_to_buffers[ph.name])
            buffers.append(name)
        else:
            kind, name = "input", f"input{i - len(params) - len(buffers)}"
        value_of[ph] = new_value(ph.meta["val"], kind, name, ph, None)

    for n in fx_nodes:
        if n.op in ("placeholder", "output"):
            continue
        if n.op == "get_attr":
            constants.add(n)
            continue
        if n.op != "call_function":
            raise CaptureError(f"FX node {n.name} has op {n.op!r}; only call_function nodes are supported.")
        if n.target is operator.getitem:
            src, idx = n.args
            if src in tuple_values:                        # element of an allocating multi-output op
                vid = tuple_values[src][idx]
                if vid is None:
                    raise CaptureError(f"FX node {n.name} reads element {idx} of {src.name}, which is not a tensor.")
                if not isinstance(primary[vid], fx.Node):
                    primary[vid] = n
                value_of[n] = vid
                group_of[n] = group_of[src]
                groups[group_of[n]].append(n)
            else:                                          # element of a view op's list result
                _join_alias(n, src, value_of, owner, constants, group_of, groups)
            continue
        if not isinstance(n.target, torch._ops.OpOverload):
            raise CaptureError(f"FX node {n.name} calls {n.target!r}, which is not an ATen op overload.")
        if not n.target._schema.returns:                   # metadata assertion: computes nothing
            if n.users:
                raise CaptureError(f"FX node {n.name} ({n.target}) returns nothing but has users.")
            dropped.append(n)
            continue
        base = _view_base(n)
        if base is not None:
            _join_alias(n, base, value_of, owner, constants, group_of, groups)
            continue
        gid = len(groups)
        groups.append([n])
        heads.append(n)
        group_of[n] = gid
        val = n.meta.get("val")
        if isinstance(val, torch.Tensor):
            value_of[n] = new_value(val, "activation", n.name, n, gid)
        elif isinstance(val, (tuple, list)):
            tuple_values[n] = [new_value(t, "activation", f"{n.name}.{i}", (n, i), gid)
                               if isinstance(t, torch.Tensor) else None for i, t in enumerate(val)]
        else:
            raise CaptureError(f"FX node {n.name} ({n.target}) returns {type(val).__name__}, not tensors.")

    for n in dropped:
        gm.graph.erase_node(n)

    # Graph outputs: buffer updates, the loss, parameter gradients (FX order).
    n_mut, n_user = len(sig.buffers_to_mutate), len(sig.user_outputs)
    grads = sig.backward_signature.gradients_to_parameters
    if len(fx_outputs) != n_mut + n_user + len(grads) or n_user != 1:
        raise CaptureError(f"unexpected joint graph outputs: {len(fx_outputs)} outputs for {n_mut} buffer "
                           f"updates, {n_user} user outputs and {len(grads)} gradients.")
    if any(isinstance(o, fx.Node) and o.name != name for o, name in zip(fx_outputs[:n_mut], sig.buffers_to_mutate)):
        raise CaptureError("joint graph outputs do not start with the buffer updates the signature names.")
    for o in fx_outputs:
        if not isinstance(o, fx.Node) or value_of.get(o) not in owner:
            raise CaptureError(f"joint graph output {o} is not a tensor computed by the step (it is None or "
                               f"aliases an input); every parameter must receive a gradient.")
    loss_fx = fx_outputs[n_mut]
    out_kinds = [(o, "output") for o in fx_outputs[:n_mut + 1]] + [(o, "gradient") for o in fx_outputs[n_mut + 1:]]
    for o, kind in out_kinds:
        values[value_of[o]]["kind"] = kind

    for gid, group in enumerate(groups):
        groups[gid] = sorted(set(group) | _constant_ancestors(group, constants), key=position.__getitem__)
    phases = _phases(groups, owner, value_of, values, loss_group=owner[value_of[loss_fx]])
    nodes = _nodes(groups, heads, phases, value_of, owner)

    value_objs = [Value(i, v["bytes"], v["shape"], v["dtype"], v["kind"], v["name"], owner.get(i))
                  for i, v in enumerate(values)]
    grad_params = [_strip(grads[o.name]) for o in fx_outputs[n_mut + 1:]]
    graph_outputs = [value_of[loss_fx]] + [value_of[o] for o in fx_outputs[n_mut + 1:]] + \
                    [value_of[o] for o in fx_outputs[:n_mut]]
    random_devices = {gid: str(_device_of(m)) for gid, group in enumerate(groups) for m in group if _draws(m)}
    program = Program(gm=gm, placeholders=placeholders, params=params, buffers=buffers,
                      outputs=fx_outputs,
                      mutated_buffers=[_strip(sig.buffers_to_mutate[o.name]) for o in fx_outputs[:n_mut]],
                      grad_params=grad_params, groups=groups, value_of=value_of, primary=primary,
                      random_devices=random_devices)
    meta = {"model": type(model).__name__, "torch": torch.__version__,
            "batch": [{"shape": list(t.shape), "dtype": _dtype_name(t.dtype)} for t in batch]}
    modules = [head.meta.get(META_KEY) if phase != "backward" else None for head, phase in zip(heads, phases)]
    if any(modules):
        meta["node_modules"] = modules
    return OpGraph(value_objs, nodes, graph_outputs, meta, program=program)


def _constant_ancestors(group: list[fx.Node], constants: set[fx.Node]) -> set[fx.Node]:
    """The views of graph inputs and the constants that `group` reads, transitively: they are
    replicated into every group that reads them."""
    needed: set[fx.Node] = set()
    stack = [a for m in group for a in m.all_input_nodes if a in constants]
    while stack:
        c = stack.pop()
        if c not in needed:
            needed.add(c)
            stack.extend(a for a in c.all_input_nodes if a in constants)
    return needed


def _nodes(groups: list, heads: list, phases: list[str], value_of: dict, owner: dict) -> list[Node]:
    """One operator node per group: values read (in order of first use) and allocated (ascending).
    Values were numbered in FX order, so every produced value follows its producer's inputs."""
    produced: list[list[int]] = [[] for _ in groups]
    for vid, gid in owner.items():
        produced[gid].append(vid)
    nodes = []
    for gid, (group, head) in enumerate(zip(groups, heads)):
        reads: dict[int, None] = {}
        for m in group:
            for a in m.all_input_nodes:
                v = value_of.get(a)
                if v is not None and owner.get(v) != gid:
                    reads.setdefault(v)
        targets = [str(head.target)] + [str(m.target) for m in group
                                         if m is not head and isinstance(m.target, torch._ops.OpOverload)]
        nodes.append(Node(gid, head.name, tuple(targets), phases[gid], tuple(reads), tuple(sorted(produced[gid]))))
    return nodes


def op_of(target: str) -> torch._ops.OpOverload | None:
    """The op a node target of a graph (JSON included) names, ATen's or memplan's (`aten.mm.default`,
    `memplan.dropout_mask.default`); None for any other target."""
    namespace, _, name = target.partition(".")
    packet, _, overload = name.partition(".")
    if namespace not in ("aten", "memplan"):
        return None
    op = getattr(getattr(getattr(torch.ops, namespace), packet, None), overload, None)
    return op if isinstance(op, torch._ops.OpOverload) else None


def _draws(m: fx.Node) -> bool:
    """Whether `m` draws from a random generator: an ATen op tagged `nondeterministic_seeded`, unless its
    `dropout_p` argument is 0 (attention without dropout, e.g. `_scaled_dot_product_flash_attention`)."""
    if not (isinstance(m.target, torch._ops.OpOverload) and torch.Tag.nondeterministic_seeded in m.target.tags):
        return False
    for i, arg in enumerate(m.target._schema.arguments):
        if arg.name == "dropout_p":
            return (m.kwargs["dropout_p"] if "dropout_p" in m.kwargs else
                    m.args[i] if i < len(m.args) else arg.default_value) != 0
    return True


def _device_of(m: fx.Node) -> torch.device:
    val = m.meta.get("val")
    t = val if isinstance(val, torch.Tensor) else next(x for x in val if isinstance(x, torch.Tensor))
    return t.device


def _join_alias(n: fx.Node, base: fx.Node, value_of: dict, owner: dict, constants: set,
                group_of: dict, groups: list) -> None:
    """Fold the view `n` of `base`: into the group owning the storage, or mark it a constant view."""
    if base in constants:
        constants.add(n)
        return
    vid = value_of[base]
    gid = owner.get(vid)
    value_of[n] = vid
    if gid is None:                                        # aliases a graph input
        constants.add(n)
        return
    group_of[n] = gid
    groups[gid].append(n)


def _phases(groups: list, owner: dict, value_of: dict, values: list, loss_group: int) -> list[str]:
    """Phase per group: `backward` after the loss node (AOTAutograd traces the whole forward first);
    `loss` for the loss node and the forward nodes after the last one reading a parameter (the loss
    function's own ops); `forward` for the rest."""
    reads_param = [any(values[value_of[a]]["kind"] == "param" for m in g for a in m.all_input_nodes
                       if a in value_of and value_of[a] not in owner) for g in groups]
    last_param = max((i for i in range(loss_group) if reads_param[i]), default=-1)
    return ["backward" if i > loss_group else "loss" if i > last_param else "forward"
            for i in range(len(groups))]


def _program(graph: OpGraph) -> Program:
    if not isinstance(graph.program, Program):
        raise CaptureError("this graph has no captured program (it was loaded from JSON); run "
                           "runtime.capture(model, loss_fn, batch) to get an executable graph.")
    return graph.program


def node_function(graph: OpGraph, node_id: int) -> fx.GraphModule:
    """A callable `f(*inputs) -> tuple(outputs)` running operator node `node_id` alone: inputs are the
    tensors of `nodes[node_id].inputs` (graph values, in order), outputs those of `.outputs`. Views of
    another node's value that the node reads are re-derived from the value passed in."""
    program = _program(graph)
    _check_node(graph, node_id)
    node = graph.nodes[node_id]
    g = fx.Graph()
    placeholder = {v: g.placeholder(f"v{v}") for v in node.inputs}
    env: dict[fx.Node, fx.Node] = {}
    resolve = _replayer(program, g, placeholder, env)
    for m in program.groups[node_id]:
        env[m] = g.node_copy(m, resolve)
    g.output(tuple(_value_node(program, g, env, v) for v in node.outputs))
    return fx.GraphModule(program.gm, g)


def variant_function(graph: OpGraph, node_id: int, impl: str) -> fx.GraphModule:
    """Like `node_function`, for node `node_id` run as implementation variant `impl` (runtime.variants):
    `f(*inputs) -> tuple(outputs)` with the tensors of the variant spec's `inputs` and `outputs` (variant
    values such as a mask included). The default variant is `node_function`."""
    from runtime.variant_ops import emit_variant
    from runtime.variants import graph_variants

    program = _program(graph)
    _check_node(graph, node_id)
    variants = graph_variants(graph)
    spec = variants.spec(node_id, impl)
    if spec is None:
        return node_function(graph, node_id)
    g = fx.Graph()
    placeholder = {v: g.placeholder(f"v{v}") for v in spec.inputs}
    env: dict[fx.Node, fx.Node] = {}
    made = emit_variant(g, graph, variants, spec, env, _replayer(program, g, placeholder, env), placeholder)
    g.output(tuple(made[v] if v in made else _value_node(program, g, env, v) for v in spec.outputs))
    return fx.GraphModule(program.gm, g)


def _check_node(graph: OpGraph, node_id: int) -> None:
    if not 0 <= node_id < len(graph.nodes):
        raise IndexError(f"node id {node_id} is out of range 0..{len(graph.nodes) - 1}.")


def _replayer(program: Program, g: fx.Graph, placeholder: dict[int, fx.Node],
              env: dict[fx.Node, fx.Node]) -> Callable[[fx.Node], fx.Node]:
    """Resolve a captured FX node read by a lone node: its value's placeholder, or a view of another
    node's value replayed from its base."""
    def resolve(a: fx.Node) -> fx.Node:
        if a not in env:
            v = program.value_of.get(a)
            if v in placeholder and program.primary[v] is a:
                env[a] = placeholder[v]
            else:                                          # a view: replay it from its base
                env[a] = g.node_copy(a, resolve)
        return env[a]
    return resolve


def _value_node(program: Program, g: fx.Graph, env: dict[fx.Node, fx.Node], v: int) -> fx.Node:
    """The node of `g` holding graph value `v` of a group copied into `env`."""
    where = program.primary[v]
    if isinstance(where, fx.Node):
        return env[where]
    tup, idx = where
    return g.call_function(operator.getitem, (env[tup], idx))


class _CallableModule(types.ModuleType):
    """Importing the submodule `runtime.capture` rebinds the package attribute `runtime.capture` to the
    module; making the module callable keeps `runtime.capture(model, loss_fn, batch)` working."""

    def __call__(self, model: nn.Module, loss_fn: Callable[..., torch.Tensor], batch: tuple | list,
                 **options: Any) -> OpGraph:
        return capture(model, loss_fn, batch, **options)


sys.modules[__name__].__class__ = _CallableModule
