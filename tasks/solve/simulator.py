"""The schedule simulator: the single definition of memory (docs/plan-format.md, ARCHITECTURE.md).

A schedule is a list of steps, `("compute", node)` / `("free", value)` tuples or the plan's JSON dicts
(`{"compute": N, "impl": ...}` / `{"free": X}`). Semantics:
- graph inputs are always resident and reported as `constant_bytes`, never in the peak;
- a compute allocates fresh copies of the node's outputs; later reads see the newest copy;
- a copy is live from the step computing it through the step holding its last read before the value
  is computed again (a copy never read lives during its own step only); an explicit free can only
  come after that last read, so it releases nothing earlier;
- the final copy of a graph output stays live to the end;
- live memory during a compute step = live copies + the node's workspace; the peak is its maximum.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable

import numpy as np

from runtime.plan import PlanError, normalize_step
from tasks.solve.problem import Problem


class InvalidSchedule(ValueError):
    """A schedule that cannot run: unknown node or value, an input not resident, a graph output
    missing at the end."""


@dataclass(frozen=True)
class Simulation:
    """`timeline[i]`: live bytes during step i (a compute step includes the node's workspace; a free
    step shows what stays live after it). `peak_step` is the first compute step reaching the peak.
    Copy c of value `copy_value[c]` is live during steps `copy_start[c]..copy_end[c]`."""

    peak_bytes: int
    peak_step: int
    compute_cost: float
    constant_bytes: int
    num_computes: int
    timeline: np.ndarray
    copy_value: np.ndarray
    copy_start: np.ndarray
    copy_end: np.ndarray

    def live_values(self, step: int) -> np.ndarray:
        """Values with a copy live during `step`."""
        live = (self.copy_start <= step) & (self.copy_end >= step)
        return np.unique(self.copy_value[live])


def normalize_schedule(schedule: Iterable[Any]) -> list[dict[str, Any]]:
    """The schedule as plan step dicts; raises InvalidSchedule naming the first malformed step."""
    try:
        return [normalize_step(step, f"schedule[{i}]") for i, step in enumerate(schedule)]
    except PlanError as exc:
        raise InvalidSchedule(str(exc)) from None


def simulate(problem: Problem, schedule: Iterable[Any]) -> Simulation:
    """Peak, memory timeline and compute cost of `schedule` on `problem` (module docstring)."""
    steps = normalize_schedule(schedule)
    n, nv = problem.num_nodes, problem.num_values
    producer = problem.value_producer
    current = np.full(nv, -1, dtype=np.int64)     # value -> index of its newest resident copy
    freed_at: dict[int, int] = {}
    copy_value: list[int] = []
    copy_start: list[int] = []
    copy_end: list[int] = []                      # last step the copy is live
    workspace = np.zeros(len(steps), dtype=np.int64)
    is_compute = np.zeros(len(steps), dtype=bool)
    cost = 0.0
    for i, step in enumerate(steps):
        if "compute" in step:
            node = step["compute"]
            if node >= n:
                raise InvalidSchedule(f"schedule[{i}] computes node {node}, which does not exist (0..{n - 1}).")
            for v in problem.node_inputs[node]:
                if producer[v] < 0:
                    continue
                c = current[v]
                if c < 0:
                    why = (f"it was freed at schedule[{freed_at[v]}]" if v in freed_at
                           else f"its producer {problem.node_label(int(producer[v]))} has not been computed")
                    raise InvalidSchedule(f"schedule[{i}] computes {problem.node_label(node)}, which reads "
                                          f"value {v}, but {why}.")
                copy_end[c] = i
            for v in problem.node_outputs[node]:
                current[v] = len(copy_value)
                copy_value.append(v)
                copy_start.append(i)
                copy_end.append(i)
            workspace[i] = problem.workspace[node]
            is_compute[i] = True
            cost += float(problem.cost[node])
        else:
            v = step["free"]
            if v >= nv:
                raise InvalidSchedule(f"schedule[{i}] frees value {v}, which does not exist (0..{nv - 1}).")
            if producer[v] < 0:
                raise InvalidSchedule(f"schedule[{i}] frees value {v}, a graph input; graph inputs are always resident.")
            if current[v] < 0:
                raise InvalidSchedule(f"schedule[{i}] frees value {v}, which is not resident.")
            current[v] = -1
            freed_at[v] = i
    missing = [v for v in problem.outputs if current[v] < 0]
    if missing:
        raise InvalidSchedule(f"graph outputs {missing[:10]} are not resident at the end of the schedule "
                              f"({len(missing)} missing); compute each and do not free it afterwards.")
    values = np.asarray(copy_value, dtype=np.int64)
    starts = np.asarray(copy_start, dtype=np.int64)
    ends = np.asarray(copy_end, dtype=np.int64)
    ends[current[list(problem.outputs)]] = len(steps) - 1
    nbytes = problem.value_bytes[values]
    delta = np.zeros(len(steps) + 1, dtype=np.int64)
    np.add.at(delta, starts, nbytes)
    np.add.at(delta, ends + 1, -nbytes)
    timeline = np.cumsum(delta[:-1]) + workspace
    compute_live = np.where(is_compute, timeline, -1)
    peak_step = int(np.argmax(compute_live)) if is_compute.any() else -1
    return Simulation(
        peak_bytes=int(compute_live[peak_step]) if peak_step >= 0 else 0,
        peak_step=peak_step,
        compute_cost=cost,
        constant_bytes=problem.constant_bytes,
        num_computes=int(is_compute.sum()),
        timeline=timeline,
        copy_value=values,
        copy_start=starts,
        copy_end=ends,
    )


def default_schedule(problem: Problem) -> list[tuple[str, int]]:
    """Every node once, in the default order (no recomputation)."""
    return [("compute", int(node)) for node in problem.order]
