"""Which backward operator nodes of a captured graph one autograd Node runs (`meta["autograd_nodes"]`).

The joint graph frees each value after its last reading op. Autograd runs a Node's backward formula as a
whole: it holds the Node's saved tensors and incoming gradients until the formula's last op has run
(sin's backward is `grad * cos(x)`: `x` lives through the `mul`, not only through the `cos`). When the
model's own `loss.backward()` runs the step (the policy form, runtime/policy/apply.py), the simulator must count
those longer lifetimes: `Problem.from_graph` makes the last op of each Node read what its earlier ops read
from outside the Node (`runtime.policy.form.held_reads`).

`label_backward` learns the Nodes from one eager step of the model on fake tensors (`runtime.capture.fake_tensors`:
it allocates nothing, so a step larger than its device is labelled there too): a dispatch mode records each
backward ATen call with `torch._C._current_autograd_node()` (not the fake tensors' own `prim` queries), and the
calls are aligned with the graph's backward ops by their names (views left out on both sides; `match_nodes`).
Random state is restored afterwards; the model is not touched.
"""

from __future__ import annotations

import difflib
from typing import Any, Callable, Sequence

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from memplan.runtime.tracing.capture import fake_tensors
from memplan.runtime.format.graph import OpGraph
from memplan.runtime.tracing.ops import allocating_calls, is_view, op_name


class _BackwardCalls(TorchDispatchMode):
    """Records (op name, autograd Node) of each non-view ATen call made while a Node runs."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[str, int]] = []
        self._nodes: list[Any] = []                  # keeps each Node's wrapper alive, so ids stay unique

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        node = torch._C._current_autograd_node()
        if node is not None and func.namespace != "prim" and not is_view(func) and "AccumulateGrad" not in node.name():
            self._nodes.append(node)
            self.calls.append((op_name(func), id(node)))
        return func(*args, **(kwargs or {}))


def _graph_backward_ops(graph: OpGraph) -> list[tuple[str, int]]:
    """(op name, operator node id) of each non-view ATen call of the graph's backward, in order."""
    return [(op_name(op), node) for _, op, node in allocating_calls(graph) if graph.nodes[node].phase == "backward"]


def match_nodes(graph_ops: Sequence[tuple[str, int]], calls: Sequence[tuple[str, int]]) -> dict[int, int]:
    """Operator node id -> autograd Node of the first eager call aligned with one of its ops: the longest
    matching blocks of the two sequences of op names (`difflib.SequenceMatcher`), so a run of ops one side
    has and the other lacks (another decomposition, AccumulateGrad's) shifts nothing after it."""
    matcher = difflib.SequenceMatcher(None, [name for name, _ in graph_ops], [name for name, _ in calls],
                                      autojunk=False)
    node_of: dict[int, int] = {}
    for block in matcher.get_matching_blocks():
        for k in range(block.size):
            node_of.setdefault(graph_ops[block.a + k][1], calls[block.b + k][1])
    return node_of


def label_backward(graph: OpGraph, model: nn.Module, loss_fn: Callable[..., torch.Tensor], batch: tuple) -> None:
    """Set `graph.meta["autograd_nodes"]`: per operator node, a number shared by the consecutive backward
    nodes one autograd Node runs, None elsewhere (module docstring)."""
    devices = sorted({t.device.index or 0 for t in (*batch, *model.parameters()) if t.device.type == "cuda"})
    with torch.random.fork_rng(devices=devices), fake_tensors(model, batch) as fake_batch:
        loss = loss_fn(model, *fake_batch)
        with _BackwardCalls() as recorder:
            loss.backward()
    node_of = match_nodes(_graph_backward_ops(graph), recorder.calls)
    numbers: dict[int, int] = {}
    graph.meta["autograd_nodes"] = [numbers.setdefault(node_of[n.id], len(numbers)) if n.id in node_of else None
                                    for n in graph.nodes]
