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
each piece is needed only until the next concatenation. Then the rewrite passes of runtime/rewrites.py
run (`PASSES`): each convolution backward is split into its weight- and input-gradient halves (a pointwise
one's input gradient a matrix product), cross-entropy and the written-out tanh GELU are fused into ops that
keep fewer tensors, and each training dropout is split into its mask's draw and its product. Which
instances a capture applies is its rewrite selection: the default (every instance; the matrix product only
where ATen takes its GEMM path at this thread count), an explicit one (`rewrites=`, as a plan records it),
or, with `verify=True`, the default instances that runtime/rewrite_check.py finds bit-identical on this
step's real values on this device and thread count. The graph records it in `meta["rewrites"]`. The
fusions and the dropout split apply to CPU graphs only: their ops run block by block, a few small kernels
per block, and on a GPU those launches cost more than the memory saves (measured on an H200, GPT-2 of
bench/peers.py: eager 13 ms a step, the fused graph's no-recomputation schedule 28 ms, the captured one's
0.88x eager's time); CUDA's fused dropout kernel draws in an order no separate draw reproduces.
"""

from __future__ import annotations

import operator
import os
import platform
import sys
import traceback
import types
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

import torch
from torch import fx, nn
from torch._functorch.aot_autograd import aot_export_module
from torch._subclasses.fake_tensor import DataDependentOutputException, DynamicOutputShapeException

from runtime.graph import Node, OpGraph, Value
from runtime.facts import graph_facts
from runtime.modules import META_KEY, boundary_hooks, strip_boundaries
from runtime.rewrite_check import exact_instances
from runtime.rewrites import PASSES, Rewriter

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
            record_modules: bool = True, rewrites: Mapping[str, Sequence[int]] | None = None,
            verify: bool = False) -> OpGraph:
    """Trace one training step (forward, loss, backward) with `aot_export_module(trace_joint=True)` and
    fold it into an operator graph. The returned graph carries the FX program in `.program`. With
    `record_modules`, `meta["node_modules"]` names, per operator node, the repeated module
    (runtime/modules.py) whose forward computed it, or None. `rewrites` (`{pass: [instance, ...]}`, a
    graph's or plan's `rewrites["applied"]`) applies exactly those rewrite instances; `verify` applies the
    default instances that are bit-identical on this step's values here (runtime/rewrite_check.py);
    neither: the default instances. `meta["rewrites"]` records the selection (docs/graph-format.md)."""
    if rewrites is not None and verify:
        raise ValueError("capture takes a rewrite selection or verify=True, not both: a recorded selection "
                         "was verified where it was made.")
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
    inputs = _step_inputs(gm, sig, model, batch) if verify else None
    record = _rewrite(gm, _cpu_graph(model, batch), rewrites, inputs)
    graph = _fold(gm, sig, model, batch)
    gm.recompile()
    graph.meta["rewrites"] = record
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
            out.append(params[_strip(sig.inputs_to_parameters[ph.name])].detach())
        elif ph.name in sig.inputs_to_buffers:
            out.append(buffers[_strip(sig.inputs_to_buffers[ph.name])])
        else:
            out.append(next(rest))
    return out


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
    graph = OpGraph(value_objs, nodes, graph_outputs, meta, program=program)
    meta.update(graph_facts(graph))
    return graph


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
