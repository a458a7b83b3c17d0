"""The computation graph ACG plans on, cut out of a `Problem`, and the schedule its checkpoints give.

Feng & Huang (2021, sec. 4) plan on the forward graph with vertex = tensor, cost l(v) = its bytes. Here
a vertex is a forward operator node (its outputs are one tensor or a few, e.g. batch norm's output and
saved statistics; the node is the unit the runtime recomputes) with l(v) = the bytes it allocates.
The vertices are the forward nodes the loss depends on; a virtual source of cost 0 stands for the
batch and feeds every vertex that reads no other vertex, and the loss node is the target. Forward nodes
the loss does not depend on (batch-norm running-stat updates) are no vertices: they run once in the
forward pass and are never recomputed.

The schedule (sec. 3, Fig. 1b): the forward pass runs every forward node once in the default order and
keeps only the checkpoints (a value lives until its last read, so the others die inside the forward
pass); the backward pass runs the backward nodes in the default order, and before the first one that
reads a value of a segment (a component of the non-checkpoint vertices) re-forwards that segment once
from its checkpoints. The re-forward computes the segment's vertices whose outputs its gradients read,
and the vertices inside the segment those depend on; its values live until their last backward read.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Iterable

import networkx as nx
import numpy as np

from memplan.tasks.solve.acg.dag import TensorDag
from memplan.tasks.solve.acg.division import pieces
from memplan.tasks.solve.core.checkpoints import recompute_closure
from memplan.tasks.solve.core.problem import Problem, ProblemError

SOURCE = "source"


@dataclass(frozen=True, eq=False)
class ForwardGraph:
    """The ACG computation graph of `problem`: `dag.labels` are node ids, `SOURCE` first."""

    problem: Problem
    dag: TensorDag
    target: int

    @cached_property
    def time(self) -> np.ndarray:
        """Compute cost of each dag vertex (0 for the source): what recomputing it costs."""
        return np.array([0.0 if label == SOURCE else float(self.problem.cost[label]) for label in self.dag.labels])

    def nodes_of(self, mask: int) -> list[int]:
        """Node ids of the vertices in a bitset (the source left out)."""
        return [label for label in self.dag.labels_of(mask) if label != SOURCE]


def forward_graph(problem: Problem, keep: Iterable[int] = ()) -> ForwardGraph:
    """The computation graph of sec. 4 for `problem` (module docstring). The target is the loss: the
    forward node no other forward node reads that depends on the most forward nodes (running-stat
    updates are such sinks too, but depend on a prefix of the network only). Vertices of the nodes in
    `keep` must be checkpoints."""
    forward = [int(n) for n in problem.order if problem.is_recomputable[n]]
    if not forward:
        raise ProblemError(f"problem {problem.name!r} has no forward nodes: there is nothing to checkpoint.")
    graph = nx.DiGraph()
    graph.add_nodes_from(forward)
    producer = problem.value_producer
    for node in forward:
        for v in problem.node_inputs[node]:
            p = int(producer[v])
            if p >= 0 and problem.is_recomputable[p]:
                graph.add_edge(p, node)
    sinks = {node: nx.ancestors(graph, node) for node in forward if graph.out_degree(node) == 0}
    target = max(sinks, key=lambda node: (len(sinks[node]), problem.position[node]))
    loss_inputs = sinks[target] | {target}
    dag = nx.DiGraph()
    dag.add_node(SOURCE, cost=0)
    for node in forward:
        if node in loss_inputs:
            dag.add_node(node, cost=int(problem.node_bytes[node]))
    dag.add_edges_from((a, b) for a, b in graph.edges if a in loss_inputs and b in loss_inputs)
    dag.add_edges_from((SOURCE, node) for node in list(dag) if node != SOURCE and dag.in_degree(node) == 0)
    keep = list(keep)
    outside = [node for node in keep if node not in dag or node == SOURCE]
    if outside:
        raise ProblemError(f"acg parameter keep names nodes {outside[:10]}, which are not forward nodes the loss "
                           f"depends on; name forward node ids of problem {problem.name!r}.")
    return ForwardGraph(problem, TensorDag.from_networkx(dag, forced=keep), target)


def reforward_schedule(fg: ForwardGraph, checkpoints: int) -> list[tuple[str, int]]:
    """The schedule of a checkpoint set (bitset over `fg.dag`'s vertices; module docstring)."""
    problem = fg.problem
    segment_of: dict[int, int] = {}
    segments = [p.interior for p in pieces(fg.dag, checkpoints)]
    for s, interior in enumerate(segments):
        for node in fg.nodes_of(interior):
            segment_of[node] = s
    order = problem.order.tolist()
    backward = [n for n in order if not problem.is_recomputable[n]]
    needed = {int(problem.value_producer[v]) for n in backward for v in problem.node_inputs[n]}
    value_segment = np.array([segment_of.get(int(p), -1) for p in problem.value_producer])
    reforward = [recompute_closure(problem, [n for n in fg.nodes_of(interior) if n in needed], value_segment != s)
                 for s, interior in enumerate(segments)]
    schedule = [("compute", n) for n in order if problem.is_recomputable[n]]
    done: set[int] = set()
    for node in backward:
        for v in problem.node_inputs[node]:
            s = segment_of.get(int(problem.value_producer[v]))
            if s is not None and s not in done:
                done.add(s)
                schedule.extend(("compute", n) for n in reforward[s])
        schedule.append(("compute", node))
    return schedule


def all_vertices(fg: ForwardGraph) -> int:
    """The checkpoint set keeping every vertex (no recomputation)."""
    return (1 << fg.dag.n) - 1
