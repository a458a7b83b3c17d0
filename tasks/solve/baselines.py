"""Classic rematerialization baselines (Checkmate table 1 and appendix B).

Every checkpointing baseline picks retained forward nodes and completes them with the optimal
recomputation fill (`schedule_from_checkpoints`); Griewank's revolve fixes its own recomputation.
Memory-aware variants (the greedy ones) search their parameter and return the cheapest schedule
within the budget; the others return their single schedule, or say it does not fit.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Annotated

import networkx as nx
import numpy as np
from pydantic import Field

from memplan.tasks.solve.core.checkpoints import forward_nodes, schedule_from_checkpoints
from memplan.tasks.solve.core.problem import Problem
from memplan.tasks.solve.core.simulator import default_schedule, simulate
from memplan.tasks.solve.core.solution import Solution, SolveOptions, checked_solution

GREEDY_STEPS = 48


def forward_edges(problem: Problem) -> list[tuple[int, int]]:
    fwd = problem.is_recomputable
    return sorted({(int(problem.value_producer[v]), node) for node in forward_nodes(problem)
                   for v in problem.node_inputs[node] if problem.value_producer[v] >= 0 and fwd[problem.value_producer[v]]})


def is_linear(problem: Problem) -> bool:
    """The forward graph is a path through the forward nodes in order (VGG, MobileNet, SegNet)."""
    fwd = forward_nodes(problem)
    return forward_edges(problem) == sorted(zip(fwd, fwd[1:]))


def articulation_points(problem: Problem) -> list[int]:
    """Cut vertices of the undirected forward graph (appendix B.1), in order."""
    graph = nx.Graph(forward_edges(problem))
    graph.add_nodes_from(forward_nodes(problem))
    cut = set(nx.articulation_points(graph))
    return [v for v in forward_nodes(problem) if v in cut]


def sqrt_n_checkpoints(candidates: list[int]) -> list[int]:
    """Chen et al. (2016) sqrt(n): of n candidates in order, every ceil(sqrt(n))-th ends a segment."""
    stride = max(1, math.ceil(math.sqrt(len(candidates))))
    return candidates[stride - 1::stride]


def greedy_checkpoints(problem: Problem, candidates: list[int], b: float) -> list[int]:
    """Chen et al. (2016) greedy: walk the forward nodes accumulating output bytes; once more than `b`
    bytes have accumulated at a candidate, checkpoint it and start a new segment."""
    allowed = set(candidates)
    kept, acc = [], 0.0
    for node in forward_nodes(problem):
        acc += float(problem.node_bytes[node])
        if acc > b and node in allowed:
            kept.append(node)
            acc = 0.0
    return kept


def _values(problem: Problem, nodes: list[int]) -> list[int]:
    return [v for node in nodes for v in problem.node_outputs[node]]


def _not_linear(problem: Problem, name: str, budget: int, start: float) -> Solution:
    return Solution(name, budget, "no_solution", solve_seconds=time.perf_counter() - start,
                    message=f"{name} applies to linear forward graphs only; {problem.name} branches "
                            f"(use ap-* or linearized-* baselines, or checkmate)")


def checkpoint_all(problem: Problem, budget: int, options: SolveOptions) -> Solution:
    """No rematerialization: every node once in the default order."""
    start = time.perf_counter()
    return checked_solution(problem, "checkpoint-all", budget, default_schedule(problem),
                            solve_seconds=time.perf_counter() - start)


def _fixed(problem: Problem, name: str, budget: int, kept: list[int], start: float) -> Solution:
    schedule = schedule_from_checkpoints(problem, _values(problem, kept))
    return checked_solution(problem, name, budget, schedule, solve_seconds=time.perf_counter() - start,
                            message=f"{len(kept)} checkpoints")


def _greedy(problem: Problem, name: str, budget: int, candidates: list[int], start: float,
            time_limit: float | None) -> Solution:
    """Search b over a geometric grid; cheapest fitting schedule found before the time limit. Each
    segment is recomputed once for the backward pass and kept until its last use (Chen et al. 2016, as
    torch.utils.checkpoint does), so no node runs more than twice: at most one extra forward."""
    sizes = problem.node_bytes[forward_nodes(problem)].astype(float)
    lo, hi = max(sizes.min(initial=1.0), 1.0), max(sizes.sum(), 2.0)
    best, tried, stopped = None, set(), ""
    for b in np.geomspace(lo, hi, GREEDY_STEPS):
        if time_limit is not None and time.perf_counter() - start > time_limit:
            stopped = " before the time limit"
            break
        kept = tuple(greedy_checkpoints(problem, candidates, b))
        if kept in tried:
            continue
        tried.add(kept)
        schedule = schedule_from_checkpoints(problem, _values(problem, list(kept)))
        sim = simulate(problem, schedule)
        if sim.peak_bytes <= budget and (best is None or sim.compute_cost < best[1].compute_cost):
            best = (schedule, sim, len(kept), b)
    if best is None:
        return Solution(name, budget, "no_solution", solve_seconds=time.perf_counter() - start,
                        message=f"no segment size b of {len(tried)} checkpoint sets tried{stopped} fits the budget")
    return checked_solution(problem, name, budget, best[0], solve_seconds=time.perf_counter() - start,
                            message=f"{best[2]} checkpoints, b = {best[3]:.4g} bytes")


def chen_sqrt_n(problem: Problem, budget: int, options: SolveOptions) -> Solution:
    start = time.perf_counter()
    if not is_linear(problem):
        return _not_linear(problem, "chen-sqrt-n", budget, start)
    return _fixed(problem, "chen-sqrt-n", budget, sqrt_n_checkpoints(forward_nodes(problem)), start)


def chen_greedy(problem: Problem, budget: int, options: SolveOptions) -> Solution:
    start = time.perf_counter()
    if not is_linear(problem):
        return _not_linear(problem, "chen-greedy", budget, start)
    return _greedy(problem, "chen-greedy", budget, forward_nodes(problem), start, options.time_limit)


def ap_sqrt_n(problem: Problem, budget: int, options: SolveOptions) -> Solution:
    """Appendix B.1: Chen's sqrt(n) on the articulation points."""
    start = time.perf_counter()
    return _fixed(problem, "ap-sqrt-n", budget, sqrt_n_checkpoints(articulation_points(problem)), start)


def ap_greedy(problem: Problem, budget: int, options: SolveOptions) -> Solution:
    """Appendix B.1: Chen's greedy with checkpoints restricted to articulation points."""
    start = time.perf_counter()
    return _greedy(problem, "ap-greedy", budget, articulation_points(problem), start, options.time_limit)


def linearized_sqrt_n(problem: Problem, budget: int, options: SolveOptions) -> Solution:
    """Appendix B.2: Chen's sqrt(n) on the topological order of the forward nodes."""
    start = time.perf_counter()
    return _fixed(problem, "linearized-sqrt-n", budget, sqrt_n_checkpoints(forward_nodes(problem)), start)


def linearized_greedy(problem: Problem, budget: int, options: SolveOptions) -> Solution:
    """Appendix B.2: Chen's greedy on the topological order of the forward nodes."""
    start = time.perf_counter()
    return _greedy(problem, "linearized-greedy", budget, forward_nodes(problem), start, options.time_limit)


def module_instances(problem: Problem) -> list[list[int]]:
    """Forward nodes of each recorded module call (`Problem.node_modules`), in order: runs of
    consecutive forward nodes computed by the same module."""
    runs: list[list[int]] = []
    last = None
    for node in forward_nodes(problem):
        module = problem.node_modules[node] if problem.node_modules else None
        if module is not None and module == last:
            runs[-1].append(node)
        elif module is not None:
            runs.append([node])
        last = module
    return runs


def module_checkpoints(problem: Problem, every: int) -> list[int]:
    """What `torch.utils.checkpoint` around every `every` consecutive modules keeps (values): each
    segment's outputs (values its nodes make and a forward node outside it reads) and every value made
    by a forward node outside the modules (a user checkpoints the layers, not the rest). Graph outputs
    made inside a segment (BatchNorm's running statistics) are resident anyway and are not segment
    boundaries: as checkpoints they cut every block at each BatchNorm, whose recomputed inputs then stayed
    live until the backward (ResNet-50: no saving at all)."""
    runs = module_instances(problem)
    inside = {node for run in runs for node in run}
    kept = [v for node in forward_nodes(problem) if node not in inside for v in problem.node_outputs[node]]
    for i in range(0, len(runs), every):
        nodes = {node for run in runs[i:i + every] for node in run}
        kept += [v for node in nodes for v in problem.node_outputs[node]
                 if any(problem.is_recomputable[u] and u not in nodes for u in problem.value_users[v])]
    return kept


def module_checkpoint(problem: Problem, budget: int, options: SolveOptions) -> Solution:
    """Per-module checkpointing, as users write it by hand: `torch.utils.checkpoint` around each group
    of `every` consecutive repeated modules recorded at capture (every = 0: the cheapest group size
    that fits the budget). Each group is recomputed once before its backward (at most one extra
    forward)."""
    start = time.perf_counter()
    runs = module_instances(problem)
    if not runs:
        return Solution("module-checkpoint", budget, "no_solution", solve_seconds=time.perf_counter() - start,
                        message=f"{problem.name} records no module boundaries (capture it with runtime.capture, "
                                f"which records them)")
    every = options.params.every if options.params is not None else 0
    best = None
    for n in ([every] if every else range(1, len(runs) + 1)):
        schedule = schedule_from_checkpoints(problem, module_checkpoints(problem, n))
        sim = simulate(problem, schedule)
        if every or sim.peak_bytes <= budget and (best is None or sim.compute_cost < best[1].compute_cost):
            best = (schedule, sim, n)
    if best is None:
        return Solution("module-checkpoint", budget, "no_solution", solve_seconds=time.perf_counter() - start,
                        message=f"no group size 1..{len(runs)} of {len(runs)} modules fits the budget")
    return checked_solution(problem, "module-checkpoint", budget, best[0], solve_seconds=time.perf_counter() - start,
                            message=f"checkpoint every {best[2]} of {len(runs)} modules")


@dataclass(frozen=True)
class ModuleCheckpointOptions:
    """Options of `module-checkpoint`."""

    every: Annotated[int, Field(ge=0)] = field(default=0, metadata={
        "help": "modules per checkpointed group (1: every block); 0: the cheapest group size that fits."})


@lru_cache(maxsize=None)
def revolve_cost(steps: int, slots: int) -> tuple[int, int]:
    """Griewank & Walther (2000): the fewest forward steps to reverse `steps` chain steps from a stored
    start state with `slots` free checkpoint slots, and the first advance m achieving it:
    T(1, c) = 1, T(l, 0) = l(l+1)/2, T(l, c) = min_m m + T(l-m, c-1) + T(m, c)."""
    if steps == 1:
        return 1, 0
    if slots == 0:
        return steps * (steps + 1) // 2, 0
    return min((m + revolve_cost(steps - m, slots - 1)[0] + revolve_cost(m, slots)[0], m) for m in range(1, steps))


def revolve_schedule(problem: Problem, slots: int) -> list[tuple[str, int]]:
    """Binomial checkpointing of a linear graph. Forward state j is the output of forward node j; a
    backward node runs when the reversal reaches the last forward state it reads (phi)."""
    fwd = forward_nodes(problem)
    index = {node: j for j, node in enumerate(fwd)}
    backward: dict[int, list[int]] = {}
    for node in problem.order.tolist():
        if not problem.is_recomputable[node]:
            phi = max((index.get(int(problem.value_producer[v]), -1) for v in problem.node_inputs[node]), default=-1)
            backward.setdefault(phi, []).append(node)
    schedule: list[tuple[str, int]] = []

    def reverse(s: int, e: int, c: int) -> None:
        # state s is stored (s = -1: the graph inputs); reverse forward steps s+1 .. e
        if e == s + 1:
            schedule.append(("compute", fwd[e]))
            schedule.extend(("compute", b) for b in backward.get(e, []))
            return
        m = s + revolve_cost(e - s, c)[1] if c else e - 1
        schedule.extend(("compute", fwd[j]) for j in range(s + 1, m + 1))
        reverse(m, e, c - 1 if c else 0)
        reverse(s, m, c)

    if fwd:
        reverse(-1, len(fwd) - 1, slots)
    schedule.extend(("compute", b) for b in backward.get(-1, []))
    return schedule


def griewank_log_n(problem: Problem, budget: int, options: SolveOptions) -> Solution:
    """REVOLVE with ceil(log2 n) checkpoint slots on a linear graph (Griewank & Walther 2000)."""
    start = time.perf_counter()
    if not is_linear(problem):
        return _not_linear(problem, "griewank-log-n", budget, start)
    steps = len(forward_nodes(problem))
    slots = max(1, math.ceil(math.log2(max(steps, 2))))
    return checked_solution(problem, "griewank-log-n", budget, revolve_schedule(problem, slots),
                            solve_seconds=time.perf_counter() - start, message=f"{slots} checkpoint slots")
