"""Recomputation fill: the cheapest set of (re)computations that makes a retention choice correct.

Checkmate's two-phase rounding (Algorithm 2) and the baselines of appendix B fix which values are
retained (the checkpoint matrix S) and then solve for the computation matrix R by setting as few
entries to 1 as possible: in stage t, node t runs (eq. 8a), every value retained into stage t+1 but not
resident in stage t is materialized (eq. 1c), and every input of a node running in stage t that is not
resident is recomputed, recursively (eq. 1b). Each entry set is forced, so R is optimal for S.
"""

from __future__ import annotations

from typing import Iterable, Protocol

import numpy as np

from memplan.tasks.solve.core.problem import Problem, ProblemError

NEVER = np.iinfo(np.int64).max


def forward_nodes(problem: Problem) -> list[int]:
    """Recomputable (forward and loss) nodes in the default order."""
    return [int(v) for v in problem.order if problem.is_recomputable[v]]


class ValueMask(Protocol):
    """A boolean mask over values, or anything indexed like one (a list, an array, `_ResidentAt`)."""

    def __getitem__(self, value: int, /) -> object: ...


def recompute_closure(problem: Problem, targets: Iterable[int], resident: ValueMask) -> list[int]:
    """Nodes to run, in default-order position, so that every node in `targets` can run: a target's
    input that is not `resident` (a boolean mask over values, or anything indexed like one; graph inputs
    always are) has its producer added, and so on recursively (the eq. 1b fix of Algorithm 2 for one stage)."""
    producer = problem.value_producer
    marked = set(targets)
    stack = list(marked)
    while stack:
        node = stack.pop()
        for v in problem.node_inputs[node]:
            p = int(producer[v])
            if p >= 0 and not resident[v] and p not in marked:
                marked.add(p)
                stack.append(p)
    if len(marked) == 1:
        return list(marked)
    pos = problem.position
    return sorted(marked, key=lambda node: pos[node])


class _ResidentAt:
    """The mask `available_until >= t` of `schedule_from_checkpoints`, read per value instead of built per stage
    (a stage of a recomputation fill reads a few values; the mask has one entry per value)."""

    def __init__(self, available_until: list[int], t: int):
        self.available_until, self.t = available_until, t

    def __getitem__(self, value: int) -> bool:
        return self.available_until[value] >= self.t


def segment_windows(problem: Problem, kept: np.ndarray) -> np.ndarray:
    """Last stage (order position) in which the first copy of each value is retained.

    Kept values, graph outputs and values of backward nodes are retained until their last use (NEVER).
    Any other value lives through its segment: until its last user at or before the next node that
    produces a kept value (Chen et al. 2016: only segment boundaries are stored); with no later kept
    value, until its last use. Graph inputs are always resident (NEVER)."""
    pos = problem.position
    producer = problem.value_producer
    boundary_positions = np.unique(pos[producer[kept & (producer >= 0)]])
    window = np.full(problem.num_values, NEVER, dtype=np.int64)
    recomputable = (producer >= 0) & ~kept & ~problem.is_output
    recomputable[recomputable] = problem.is_recomputable[producer[recomputable]]
    for v in np.flatnonzero(recomputable):
        p = pos[producer[v]]
        nxt = np.searchsorted(boundary_positions, p, side="right")
        if nxt == len(boundary_positions):
            continue
        limit = boundary_positions[nxt]
        user_positions = [pos[u] for u in problem.value_users[v] if pos[u] <= limit]
        window[v] = max(user_positions, default=p)
    return window


def schedule_from_checkpoints(problem: Problem, kept: Iterable[int], *,
                              retain_recomputed: bool = True) -> list[tuple[str, int]]:
    """Frontier-advancing schedule (stage t first computes node order[t], eq. 8a) for the retained
    values `kept` (value ids), with the optimal recomputation fill (appendix B: "solve for the optimal
    recomputation plan R").

    Retention (the S matrix): values are retained as in `segment_windows`; a recomputed value is
    retained until its last use when `retain_recomputed` (Chen's segment recomputation: each segment is
    recomputed once for the backward pass), otherwise only within the stage that recomputed it
    (Checkmate's S with only the checkpoints set). Memory follows from the simulator.
    """
    kept_mask = np.zeros(problem.num_values, dtype=bool)
    kept_ids = np.fromiter(kept, dtype=np.int64)
    if kept_ids.size and (kept_ids.min() < 0 or kept_ids.max() >= problem.num_values):
        raise ProblemError(f"kept values must be value ids 0..{problem.num_values - 1}, got "
                           f"{kept_ids[(kept_ids < 0) | (kept_ids >= problem.num_values)][:5].tolist()}.")
    kept_mask[kept_ids] = True
    window = segment_windows(problem, kept_mask).tolist()
    available_until = np.where(problem.value_producer < 0, NEVER, -1).tolist()
    schedule: list[tuple[str, int]] = []
    for t, node in enumerate(problem.order.tolist()):
        for x in recompute_closure(problem, [node], _ResidentAt(available_until, t)):
            schedule.append(("compute", x))
            for v in problem.node_outputs[x]:
                available_until[v] = window[v] if x == node else NEVER if retain_recomputed else t
    return schedule
