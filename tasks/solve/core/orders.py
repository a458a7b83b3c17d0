"""Topological orders several solvers start from (moccasin, dtr, olla): a low-peak greedy order, an order
that lets the optimizer inside the step update each parameter right after its gradient, and the check that an
order keeps the random nodes in their default relative order."""

from __future__ import annotations

import numpy as np

from memplan.tasks.solve.core.problem import Problem


def memory_order(problem: Problem) -> np.ndarray:
    """A topological order that runs, among ready nodes, the one allocating the fewest net bytes (its
    outputs minus the inputs it reads last); ties by default position."""
    n, producer, users = problem.num_nodes, problem.value_producer, problem.value_users
    remaining = np.array([len(u) for u in users])
    preds = [{int(producer[w]) for w in problem.node_inputs[v] if producer[w] >= 0} for v in range(n)]
    succs: list[list[int]] = [[] for _ in range(n)]
    for v in range(n):
        for u in preds[v]:
            succs[u].append(v)
    missing = np.array([len(x) for x in preds])
    kept = np.array([bool(users[w]) or bool(problem.is_output[w]) for w in range(problem.num_values)])
    alloc = [sum(int(problem.value_bytes[w]) for w in problem.node_outputs[v] if kept[w]) for v in range(n)]
    pos = problem.position

    def net(v: int) -> tuple[int, int]:
        last = sum(int(problem.value_bytes[w]) for w in problem.node_inputs[v]
                   if producer[w] >= 0 and remaining[w] == 1 and not problem.is_output[w])
        return alloc[v] - last, int(pos[v])

    ready, order = set(np.flatnonzero(missing == 0).tolist()), []
    while ready:
        v = min(ready, key=net)
        ready.remove(v)
        order.append(v)
        for w in problem.node_inputs[v]:
            remaining[w] -= 1
        for s in succs[v]:
            missing[s] -= 1
            if missing[s] == 0:
                ready.add(s)
    return np.asarray(order, dtype=np.int64)


def update_order(problem: Problem) -> np.ndarray:
    """The default order with each parameter's later readers moved to just before the node that makes its
    gradient, where the graph allows (every value such a reader reads, in any of its implementations, is made
    earlier; random nodes stay put). With the optimizer inside the step a parameter is updated after its last
    read (`runtime.format.schedule.update_steps`): a convolution's input gradient, which reads the weight, then runs
    before its weight gradient, and the weight is updated, and its gradient freed, right after the gradient is
    made. Equal to the default order for a problem without updates."""
    order = [int(v) for v in problem.order]
    producer, randoms = problem.value_producer, set(problem.random_nodes)
    readers: dict[int, list[int]] = {}
    for node in order:
        for impl in problem.impls(node):
            for v in problem.variant(node, impl).inputs:
                readers.setdefault(int(v), []).append(node)
    for update in problem.updates:
        position = {node: k for k, node in enumerate(order)}
        makers = [int(producer[g]) for g in update.grads if producer[g] >= 0]
        if not makers:
            continue
        gradient = max(makers, key=position.__getitem__)
        later = sorted({r for p in update.params for r in readers.get(p, ()) if position[r] > position[gradient]
                        and r not in randoms}, key=position.__getitem__)
        for reader in later:
            reads = {int(v) for impl in problem.impls(reader) for v in problem.variant(reader, impl).inputs}
            if all(producer[v] < 0 or position[int(producer[v])] < position[gradient] for v in reads):
                order.remove(reader)
                order.insert(order.index(gradient), reader)
                position = {node: k for k, node in enumerate(order)}
    return np.asarray(order, dtype=np.int64)


def keeps_random_order(problem: Problem, order: np.ndarray) -> bool:
    """Whether `order` runs the random nodes in their default relative order, as `Problem.random_nodes`
    requires of every schedule."""
    position = np.empty(len(order), dtype=np.int64)
    position[np.asarray(order)] = np.arange(len(order))
    randoms = sorted(problem.random_nodes, key=lambda v: int(problem.position[v]))
    return bool(np.all(np.diff(position[randoms]) > 0))
