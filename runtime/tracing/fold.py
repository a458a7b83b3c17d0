"""Folding a joint ATen graph into an operator graph (docs/graph-format.md).

Every FX node that allocates a new storage starts an operator node; `getitem`s of its tuple result and
every view of its storage (transitively) join that node. Views of graph inputs and module constants
allocate nothing and belong to no producer: they are replicated into each node that reads them. Each
value is one storage, so its bytes are counted once. Ops that return nothing (metadata assertions such as
`aten._assert_tensor_metadata`) are dropped: they compute no value and check shapes and dtypes that the
fingerprint already fixes.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
from torch import fx, nn

from memplan.runtime.tracing.facts import graph_facts
from memplan.runtime.format.graph import Node, OpGraph, Value
from memplan.runtime.tracing.modules import META_KEY, PART_KEY
from memplan.runtime.tracing.program import CaptureError, Program

# Ops whose schema declares a fresh result but whose kernel returns a view of the input.
_VIEW_LIKE = {torch.ops.aten._unsafe_view.default}
_MODEL_PREFIX = "model."


def strip_prefix(fqn: str) -> str:
    """A parameter or buffer name without the prefix of the module that wraps the model for export."""
    return fqn[len(_MODEL_PREFIX):] if fqn.startswith(_MODEL_PREFIX) else fqn


def dtype_name(dtype: torch.dtype) -> str:
    """The dtype as the graph JSON writes it (`float32`)."""
    return str(dtype).removeprefix("torch.")


def storage_bytes(t: torch.Tensor) -> int:
    """Bytes of the storage a fresh result needs: the extent its sizes and strides reach."""
    if t.numel() == 0:
        return 0
    extent = t.storage_offset() + 1 + sum((s - 1) * st for s, st in zip(t.shape, t.stride()))
    return int(extent) * t.element_size()


def view_base(node: fx.Node) -> fx.Node | None:
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


def fold(gm: fx.GraphModule, sig: Any, model: nn.Module, batch: tuple) -> OpGraph:
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
        values.append({"bytes": storage_bytes(t), "shape": tuple(int(s) for s in t.shape),
                       "dtype": dtype_name(t.dtype), "kind": kind, "name": name})
        primary.append(where)
        if group is not None:
            owner[vid] = group
        return vid

    # Graph inputs: parameters, buffers, batch (placeholder order).
    params, buffers = [], []
    for i, ph in enumerate(placeholders):
        if ph.name in sig.inputs_to_parameters:
            kind, name = "param", strip_prefix(sig.inputs_to_parameters[ph.name])
            params.append(name)
        elif ph.name in sig.inputs_to_buffers:
            kind, name = "buffer", strip_prefix(sig.inputs_to_buffers[ph.name])
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
        base = view_base(n)
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
    grad_params = [strip_prefix(grads[o.name]) for o in fx_outputs[n_mut + 1:]]
    graph_outputs = [value_of[loss_fx]] + [value_of[o] for o in fx_outputs[n_mut + 1:]] + \
                    [value_of[o] for o in fx_outputs[:n_mut]]
    random_devices = {gid: str(_device_of(m)) for gid, group in enumerate(groups) for m in group if _draws(m)}
    program = Program(gm=gm, placeholders=placeholders, params=params, buffers=buffers,
                      outputs=fx_outputs,
                      mutated_buffers=[strip_prefix(sig.buffers_to_mutate[o.name]) for o in fx_outputs[:n_mut]],
                      grad_params=grad_params, groups=groups, value_of=value_of, primary=primary,
                      random_devices=random_devices)
    meta = {"model": type(model).__name__, "torch": torch.__version__,
            "batch": [{"shape": list(t.shape), "dtype": dtype_name(t.dtype)} for t in batch],
            "grad_params": grad_params, "tied_params": _tied_parameters(model)}
    modules = [head.meta.get(META_KEY) if phase != "backward" else None for head, phase in zip(heads, phases)]
    if any(modules):
        meta["node_modules"] = modules
        parts = [head.meta.get(PART_KEY) if module else None for head, module in zip(heads, modules)]
        if any(parts):
            meta["node_parts"] = parts
    graph = OpGraph(value_objs, nodes, graph_outputs, meta, program=program)
    meta.update(graph_facts(graph))
    return graph


def _tied_parameters(model: nn.Module) -> list[list[str]]:
    """The names of each parameter that the model holds under more than one name (tied weights)."""
    names: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    return [group for group in names.values() if len(group) > 1]


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
