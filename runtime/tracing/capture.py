"""Capture one training step as a joint ATen graph (AOTAutograd) and fold it into an operator graph
(runtime/tracing/fold.py; the nodes' callables are runtime/tracing/node_functions.py).

First the backward ops that the trace decomposes and eager autograd does not (SiLU's and Mish's, whose
CompositeImplicitAutograd form rounds each of its steps in a bfloat16 or float16 step) are put back as the
one kernel eager runs (runtime/tracing/composite_backward.py; issue #53: EfficientNet-B0 under bfloat16 autocast).

Before folding, concatenations are chained (`_chain_concatenations`): a `cat` whose list extends the
list of an earlier `cat` along the same dimension reads that result instead of the pieces again. The
value is the same; the graph becomes the one the ACG paper's DenseNet has (cat(x, new) per layer), and
each piece is needed only until the next concatenation. Then the rewrite passes of runtime/tracing/rewrites.py
run (`PASSES`): each convolution backward is split into its weight- and input-gradient halves (a pointwise
one's input gradient a matrix product), a language model's head and cross-entropy whose logits are large become
chunked ops that never hold the logits (checked within tolerance, not bit for bit), cross-entropy and the
written-out tanh GELU are fused into ops that keep fewer tensors, and each training dropout is split into its
mask's draw and its product. Which
instances a capture applies is its rewrite selection: by default the default instances (every instance; the
matrix product only where ATen takes its GEMM path at this thread count) that runtime/tracing/rewrite_check.py finds
bit-identical on this step's real values on this device and thread count; an explicit one (`rewrites=`, as a
plan records it); or, with `verify=False`, every default instance unchecked (a kernel's algorithm differs per
CPU and thread count: unchecked, regnet_x_400mf's `stem.0.weight` gradient was 3.2e-4 from eager's on the host
of issue #53). The graph records it in `meta["rewrites"]`. The
fusions and the dropout split apply to CPU graphs only: their ops run block by block, a few small kernels
per block, and on a GPU those launches cost more than the memory saves (measured on an H200, GPT-2 of
bench/peers.py: eager 13 ms a step, the fused graph's no-recomputation schedule 28 ms, the captured one's
0.88x eager's time); CUDA's fused dropout kernel draws in an order no separate draw reproduces.
"""

from __future__ import annotations

import contextvars
import operator
import os
import platform
import sys
import traceback
import types
from contextlib import contextmanager, nullcontext
from typing import Any, Callable, Mapping, Sequence

import torch
from torch import fx, nn
from torch._functorch.aot_autograd import aot_export_module
from torch._subclasses.fake_tensor import DataDependentOutputException, DynamicOutputShapeException, FakeTensorMode
from torch.nn.utils.stateless import _reparametrize_module

from memplan.runtime.tracing.composite_backward import restore_backward_kernels
from memplan.runtime.tracing.fold import fold, storage_bytes, strip_prefix, view_base
from memplan.runtime.format.graph import OpGraph
from memplan.runtime.tracing.program import CaptureError
from memplan.runtime.tracing.modules import boundary_hooks, strip_boundaries
from memplan.runtime.tracing.rewrite_check import exact_instances
from memplan.runtime.tracing.rewrites import PASSES, WITHIN_TOLERANCE, Rewriter

class _LossStep(nn.Module):
    """`loss_fn(model, *batch)` as a module returning a 1-tuple, the form `aot_export_module` needs.

    `aot_export_module` lifts every parameter name (`named_parameters(remove_duplicate=False)`) to a graph input
    and asserts that each input requiring grad receives a gradient. A name through which the loss has none fails
    that: the alias of a tied weight that the model reads under its other names (T5's `shared.weight`, read as
    `encoder.embed_tokens`, `decoder.embed_tokens` and `lm_head`; BERT's `cls.predictions.bias`, read as
    `decoder.bias`), or a parameter the loss does not depend on (BertModel's pooler under a loss on
    `last_hidden_state`). `unread` names those (`model.`-prefixed, as this module names them): they are lifted
    as inputs that do not require grad, so the graph reads them as the model does and has no gradient output for
    them, as eager's `loss.backward()` gives such a name none (a tied tensor gets the sum of its other names'
    gradients; an unused parameter keeps `.grad` None)."""

    def __init__(self, model: nn.Module, loss_fn: Callable[..., torch.Tensor], unread: frozenset[str] = frozenset()):
        super().__init__()
        self.model = model
        self.loss_fn = loss_fn
        self.unread = unread

    def named_parameters(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True):
        for name, p in super().named_parameters(prefix, recurse, remove_duplicate):
            yield name, p.detach() if name.removeprefix(f"{prefix}." if prefix else "") in self.unread else p

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
            record_modules: bool = True, record_parts: bool = False,
            rewrites: Mapping[str, Sequence[int]] | None = None,
            verify: bool | None = None) -> OpGraph:
    """Trace one training step (forward, loss, backward) with `aot_export_module(trace_joint=True)` and
    fold it into an operator graph. The returned graph carries the FX program in `.program`. With
    `record_modules`, `meta["node_modules"]` names, per operator node, the repeated module
    (runtime/tracing/modules.py) whose forward computed it, or None; with `record_parts` too, `meta["node_parts"]` the
    child of it (what the policy form splits layers by; each marker costs tracing time: ResNet-50's 3.1 s
    capture takes 4.9 s with its parts marked). `rewrites` (`{pass: [instance, ...]}`, a
    graph's or plan's `rewrites["applied"]`) applies exactly those rewrite instances; otherwise capture applies
    the default instances that are bit-identical on this step's values on this device and thread count
    (runtime/tracing/rewrite_check.py: one extra step on real values per pass that has instances), or with
    `verify=False` every default instance unchecked. `meta["rewrites"]` records the selection
    (docs/graph-format.md). A parameter name the step never reads (an alias of a tied weight read under its
    other names, an unused parameter) has no gradient output, as eager's backward gives it none (`_LossStep`)."""
    if rewrites is not None and verify:
        raise ValueError("capture takes a rewrite selection or verify=True, not both: a recorded selection "
                         "was verified where it was made.")
    verify = rewrites is None if verify is None else verify
    if isinstance(model, nn.parallel.DistributedDataParallel):
        raise CaptureError("capture got a DistributedDataParallel wrapper, whose forward (bucket bookkeeping, "
                           "record_function calls) is not part of the training step's graph. Capture its .module "
                           "(runtime.capture(ddp.module, ...)); runtime.load takes the DDP object itself, captures its "
                           ".module and all-reduces the gradients as DDP does.")
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
    with torch.random.fork_rng(devices=cuda):
        # Names without a gradient (`_LossStep`): a tied weight's are looked for before the export (a forward
        # on fake tensors, a fraction of the export's time), an untied unused parameter once the export fails on it.
        unread = _unread_parameters(model, loss_fn, batch) if _tied(model) else []
        try:
            gm, sig = _export(model, loss_fn, batch, unread, record_modules, record_parts)
        except AssertionError as exc:                      # a parameter name without a gradient
            if "did not receive a gradient" not in str(exc):
                raise
            if unread or not (unread := _unread_parameters(model, loss_fn, batch)):
                raise _no_gradient(exc) from exc
            gm, sig = _export(model, loss_fn, batch, unread, record_modules, record_parts)
    strip_boundaries(gm.graph)
    calls = sum(1 for n in gm.graph.nodes if n.op == "call_function")
    restore_backward_kernels(gm.graph)
    gm.graph.eliminate_dead_code()
    _drop_empty_concatenations(gm.graph)
    _chain_concatenations(gm.graph)
    inputs = _step_inputs(gm, sig, model, batch) if verify else None
    try:
        record = _rewrite(gm, _cpu_graph(model, batch), rewrites, inputs)
    except torch.OutOfMemoryError as exc:
        raise CaptureError(
            "capture checks its rewrites on the device by running the step once unplanned on the real parameters "
            "and batch (verify, the default), and that step does not fit this device's memory. Capture it with "
            "verify=False (the default rewrite instances, unchecked), or on a host where the step fits, and load "
            "plans with the selection recorded there (`rewrites=`).") from exc
    graph = fold(gm, sig, model, batch)
    gm.recompile()
    graph.meta["rewrites"] = record
    graph.meta["aten_call_nodes"] = calls                  # as exported, before dead-code removal
    graph.program.batch_signature = batch_signature(model, batch)
    return graph


def _export(model: nn.Module, loss_fn: Callable[..., torch.Tensor], batch: tuple, unread: Sequence[str],
            record_modules: bool, record_parts: bool) -> tuple[fx.GraphModule, Any]:
    """`aot_export_module` of the joint step on fake tensors, the parameter names `unread` lifted as inputs that
    do not require grad (`_LossStep`); its failures as CaptureErrors that say what to do."""
    step = _LossStep(model, loss_fn, frozenset(f"model.{name}" for name in unread))
    hooks = boundary_hooks(model, record_parts) if record_modules else nullcontext()
    with hooks, fake_tensors(model, batch) as fake_batch:
        try:
            return aot_export_module(step, fake_batch, trace_joint=True, output_loss_index=0)
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
                "step. (transformers' own checks of this kind, whether an attention mask can be skipped, take "
                "the path they take under torch.export while capture traces: `_transformers_traces`.)") from exc


def _no_gradient(exc: AssertionError) -> CaptureError:
    return CaptureError(
        "torch's aot_export_module found a parameter without a gradient although the loss's autograd graph reaches "
        "every parameter name that capture lifts as requiring grad (an op whose derivative torch does not trace, "
        f"or a parameter read under two names by one module). Eager's loss.backward() tells which: ({exc})")


def _unread_parameters(model: nn.Module, loss_fn: Callable[..., torch.Tensor], batch: tuple) -> list[str]:
    """The parameter names (`named_parameters(remove_duplicate=False)`) through which the loss has no gradient:
    the step's forward run once on fake tensors with a leaf of its own per name, and the loss's autograd graph
    walked for the leaves it accumulates into. Random state is restored; nothing is allocated."""
    names = [name for name, _ in model.named_parameters(remove_duplicate=False)]
    with torch.random.fork_rng(devices=[]), fake_tensors(model, batch) as fake_batch:
        current = dict(model.named_parameters(remove_duplicate=False))
        leaves = {name: current[name].detach().requires_grad_() for name in names}
        try:
            with _reparametrize_module(model, leaves, stack_weights=True), torch.enable_grad():
                loss = loss_fn(model, *fake_batch)
        except Exception:                                  # the export reports it, as a CaptureError where it can
            return []
        reached: set[int] = set()
        seen: set[Any] = set()
        stack = [loss.grad_fn] if isinstance(loss, torch.Tensor) and loss.grad_fn is not None else []
        while stack:
            fn = stack.pop()
            if fn is None or fn in seen:
                continue
            seen.add(fn)
            if hasattr(fn, "variable"):
                reached.add(id(fn.variable))
            stack.extend(next_fn for next_fn, _ in fn.next_functions)
    return [name for name in names if id(leaves[name]) not in reached]


def _tied(model: nn.Module) -> bool:
    """Whether the model holds a parameter under more than one name."""
    return len(list(model.named_parameters(remove_duplicate=False))) > len(list(model.parameters()))


_CAPTURING = contextvars.ContextVar("memplan_capturing", default=False)


def capturing() -> bool:
    """Whether memplan is tracing a training step on fake tensors in this thread (`capture`, and `capture_eager`'s
    labelling of the backward): a loss may then skip a check that reads a tensor's value, which capture cannot
    trace, where the batch is known to pass it (tasks/models.py: transformers' check for packed sequences)."""
    return _CAPTURING.get()


@contextmanager
def fake_tensors(model: nn.Module, batch: tuple):
    """The model's parameters and buffers swapped for fake tensors (shapes, dtypes and devices, no storage) for
    the block, and the batch as fake tensors (the block's value): tracing allocates nothing.
    (`aot_export_module` traces the joint graph again on the tensors it is given; on real ones that ran the
    whole step, as much memory as eager's step: a step that needs planning to fit could not be captured on its
    device.) Tied parameters stay tied: one fake per tensor. `capturing()` is true in the block."""
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    state = [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]
    _transformers_traces()
    token = _CAPTURING.set(True)
    try:
        with _reparametrize_module(model, {name: mode.from_tensor(t) for name, t in state}, stack_weights=True):
            yield tuple(mode.from_tensor(t) for t in batch)
    finally:
        _CAPTURING.reset(token)


def _transformers_traces() -> None:
    """Make transformers see capture as the tracing it is (installed once; outside `capturing()` nothing changes).

    transformers guards each check that reads a tensor's values with `is_tracing(t)` (masking_utils: whether an
    all-ones attention mask can be skipped, `_ignore_bidirectional_mask_sdpa` / `_ignore_causal_mask_sdpa`; the
    packed-sequence check; the padding warning) and, tracing, takes the path that holds for every batch (the mask
    is built from the tensor, as under torch.export). Its test counts FakeTensors, but AOTAutograd hands the model
    FunctionalTensors wrapping them, so BERT with an attention mask, or BART, read a fake value and capture
    stopped. While memplan captures in this thread, a FunctionalTensor counts as fake too. Eager attention
    adds the all-ones mask as zeros (the same values); SDPA may take another kernel with a mask (float rounding)."""
    utils = sys.modules.get("transformers.utils.import_utils")
    check = getattr(utils, "is_fake_tensor", None)
    if check is None or getattr(check, "memplan_capture", False):
        return
    from torch._subclasses.functional_tensor import FunctionalTensor

    def is_fake_tensor(x: Any) -> bool:
        return check(x) or (_CAPTURING.get() and isinstance(x, FunctionalTensor))

    is_fake_tensor.memplan_capture = True                  # type: ignore[attr-defined]
    utils.is_fake_tensor = is_fake_tensor


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
            storage_bytes(base.meta["val"]) <= storage_bytes(copy.meta["val"]):
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
        if not isinstance(view.target, torch._ops.OpOverload) or (base := view_base(view)) is None:
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


def _rewrite(gm: fx.GraphModule, on_cpu: bool, selection: Mapping[str, Sequence[int]] | None,
             inputs: list[torch.Tensor] | None) -> dict[str, Any]:
    """Run the rewrite passes in order, each on the graph the previous ones left, applying `selection`'s
    instances, or with `inputs` (the step's real placeholder values) the default instances found exact on
    them, or else the default ones. Returns the record `meta["rewrites"]` keeps."""
    unknown = set(selection or ()) - {name for name, _ in PASSES}
    if unknown:
        raise CaptureError(f"the rewrite selection names passes {sorted(unknown)}, which this memplan does not "
                           f"have ({', '.join(name for name, _ in PASSES)}); the plan was made by another memplan "
                           f"version: make it again.")
    record: dict[str, Any] = {"applied": {}, "found": {}}
    for name, rewrite in PASSES:
        chosen = None if selection is None else [int(i) for i in selection.get(name, ())]
        if inputs is not None:
            chosen, inexact = exact_instances(gm, name, rewrite, on_cpu, inputs)
            record.setdefault("inexact", {})[name] = inexact
        rw = Rewriter(gm.graph, None if chosen is None else set(chosen))
        rewrite(gm.graph, rw, on_cpu)
        beyond = sorted(set(chosen or ()) - set(range(rw.found)))
        if beyond:
            raise CaptureError(f"the rewrite selection applies instances {beyond} of {name}, but this step has "
                               f"{rw.found}: the selection was recorded for another model, loss, batch shape or "
                               f"device. Load the plan with the model and batch it was made for.")
        record["applied"][name], record["found"][name] = rw.applied, rw.found
        if rw.applied and name in WITHIN_TOLERANCE:
            rtol, atol = WITHIN_TOLERANCE[name]
            record.setdefault("within_tolerance", {})[name] = {"rtol": rtol, "atol": atol}
    if inputs is not None:
        record["verified_on"] = verification_host(inputs)
    return record


def verification_host(inputs: Sequence[torch.Tensor]) -> dict[str, Any]:
    """Where a rewrite check ran: device (a GPU's name, or the CPU's model), torch's thread count, torch."""
    cuda = next((t.device for t in inputs if t.device.type == "cuda"), None)
    device = torch.cuda.get_device_name(cuda) if cuda is not None else _cpu_model()
    return {"device": device, "threads": torch.get_num_threads(), "torch": torch.__version__}


def _cpu_model() -> str:
    """The CPU's model name (Linux's /proc/cpuinfo), else what `platform` knows."""
    try:
        with open("/proc/cpuinfo") as f:
            names = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
    except OSError:
        names = []
    return names[0] if names else platform.processor() or platform.machine()


def _step_inputs(gm: fx.GraphModule, sig: Any, model: nn.Module, batch: tuple) -> list[torch.Tensor]:
    """The joint graph's placeholder values: the model's parameters and buffers, then the batch."""
    params = dict(model.named_parameters(remove_duplicate=False))
    buffers = dict(model.named_buffers(remove_duplicate=False))
    rest = iter(batch)
    out = []
    for ph in (n for n in gm.graph.nodes if n.op == "placeholder"):
        if ph.name in sig.inputs_to_parameters:
            out.append(params[strip_prefix(sig.inputs_to_parameters[ph.name])].detach())
        elif ph.name in sig.inputs_to_buffers:
            out.append(buffers[strip_prefix(sig.inputs_to_buffers[ph.name])])
        else:
            out.append(next(rest))
    return out


class _CallableModule(types.ModuleType):
    """Importing the submodule `runtime.capture` rebinds the package attribute `runtime.capture` to the
    module; making the module callable keeps `runtime.capture(model, loss_fn, batch)` working."""

    def __call__(self, model: nn.Module, loss_fn: Callable[..., torch.Tensor], batch: tuple | list,
                 **options: Any) -> OpGraph:
        return capture(model, loss_fn, batch, **options)


sys.modules[__name__].__class__ = _CallableModule
