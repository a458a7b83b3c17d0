"""Reading a joint forward+backward graph of torch.compile into the torch-free record the planner reads."""

from __future__ import annotations

import operator

import torch
from torch import fx

from memplan.runtime.compiled.records import JointGraph, JointNode
from memplan.runtime.tracing.fold import storage_bytes, view_base

MATMULS = {"aten.mm.default", "aten.addmm.default", "aten.bmm.default", "aten.baddbmm.default"}
"""Matrix products, costed by their multiply-adds (`_flops`, as attention and convolution are)."""


def _items(value: object) -> list[torch.Tensor | None]:
    """A result's items in position (a tuple result's, else the one value), None where not a tensor."""
    return [t if isinstance(t, torch.Tensor) else None for t in (value if isinstance(value, (tuple, list)) else [value])]


def _flops(target: str, node: fx.Node) -> int:
    """Multiply-adds times two of a matmul (2 M N K, batched: times the batch), an attention (4 B H T S D, its
    backward twice that) or a convolution (2 x output x weight's fan-in, its backward twice that); 0 for any
    other op, whose cost is the bytes it moves."""
    tensors = [a.meta["val"] for a in node.args if isinstance(a, fx.Node) and isinstance(a.meta.get("val"), torch.Tensor)]
    backward = 2 if target.endswith("_backward.default") else 1
    if target in MATMULS:
        return 2 * int(node.meta["val"].numel()) * int(tensors[-1].shape[-2])
    if "scaled_dot_product" in target and len(tensors) >= 2:
        return backward * 4 * int(tensors[0].numel()) * int(tensors[1].shape[-2])
    if target.startswith("aten.convolution") and len(tensors) >= 2:
        out = _items(node.meta["val"])[0]
        return backward * 2 * int(out.numel()) * int(tensors[1][0].numel())
    return 0


def read_joint(graph: fx.Graph) -> tuple[JointGraph, dict[str, tuple[int, ...]]]:
    """The allocating ops of a joint graph (`node.meta["val"]` set, `partitioner_tag` marking forward nodes),
    and the values each FX node's result is or aliases, by node name: views and tuple items join the value
    they alias."""
    value_of: dict[fx.Node, list[int | None]] = {}
    value_bytes: list[int] = []
    inputs: list[str] = []
    nodes: list[JointNode] = []
    outputs: tuple[int, ...] = ()

    def new(t: torch.Tensor | None) -> int | None:
        if t is None:
            return None
        value_bytes.append(storage_bytes(t))
        return len(value_bytes) - 1

    def values(n: fx.Node) -> list[int]:
        return [v for v in value_of.get(n, ()) if v is not None]

    for n in graph.nodes:
        if n.op == "placeholder":
            value_of[n] = [new(t) for t in _items(n.meta.get("val"))]
            inputs.append(n.name)
        elif n.op == "output":
            outputs = tuple(v for a in n.args[0] if isinstance(a, fx.Node) for v in values(a))
        elif n.op == "call_function":
            reads = tuple(dict.fromkeys(v for a in n.all_input_nodes for v in values(a)))
            if n.target is operator.getitem:
                items = value_of.get(n.args[0], [])
                value_of[n] = [items[n.args[1]]] if n.args[1] < len(items) else []
                continue
            base = view_base(n) if isinstance(n.target, torch._ops.OpOverload) else None
            if base is not None:
                value_of[n] = value_of.get(base, [])
                continue
            value_of[n] = [new(t) for t in _items(n.meta.get("val"))]
            made = values(n)
            if not made:
                continue
            target = str(n.target)
            phase = "forward" if n.meta.get("partitioner_tag") == "is_forward" else "backward"
            nodes.append(JointNode(n.name, target, phase, reads, tuple(made), _flops(target, n)))
    joint = JointGraph(tuple(nodes), tuple(value_bytes), tuple(inputs), outputs)
    return joint, {n.name: tuple(values(n)) for n in value_of}
