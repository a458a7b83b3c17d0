"""MOCCASIN (Bartan et al., ICML 2023): rematerialization as constraint programming with retention
intervals, solved by OR-tools CP-SAT (`moccasin`).

The order is the graph's default order (option order = "default") or `memory_order`, a topological order
of low peak (the default: phase 1 then starts closer to the budget). Time is Checkmate's stages laid end
to end in that order: slot(t, k) = t(t+1)/2 + k is node order[k] run in stage t (k <= t), H = n(n+1)/2
slots, so each slot holds at most one computation. Node v = order[k] has up to C = `max_copies` copies
(the paper's C computations per tensor); copy i:

- a[v,i] in {0,1}: the copy is computed; a[v,0] = 1 at s[v,0] = slot(k, k) (frontier advancing: the
  first computations follow the order, as in the paper's staged model), a[v,i+1] <= a[v,i].
- s[v,i] in {slot(t, k): t > k}: its slot; e[v,i,w] >= s[v,i]: the last slot output w of the copy is
  retained (retention interval [s, e]); copies are disjoint and in order: s[v,i+1] > e[v,i,w].
- precedence: for each value w of u read by v and each active copy j of v, some active copy i of u
  retains w at v's slot: s[u,i] < s[v,j] <= e[u,i,w] (one boolean per (i, j) pair, the paper's x).
- graph outputs: the last active copy retains them to the end, e = H-1.
- memory: Cumulative over the retention intervals [s, e+1) with demand bytes(w), plus unit intervals
  for workspace, capacity `peak`. This is the simulator's memory: a copy is live from the slot computing
  it through its last read, inputs and outputs during a compute.
- objective: sum_{v,i} cost_v a[v,i] (costs scaled to integers, floored, so the bound stays a bound).

With C >= n and the default order the model holds every frontier-advancing schedule, the space of
Checkmate's MILP, so the two optima are equal (the bound is a bound within that space). Solving follows
the paper's two phases: minimize `peak` down to the budget from the no-recomputation schedule, then
minimize cost under peak <= budget from phase 1's schedule. Phase 1 is skipped when the start fits: by
default (`insertion_start`) the start is the peak-directed insertion greedy's schedule
(tasks/solve/core/peak_insertion.py) on the model's order, made frontier-advancing (`frontier_schedule`).
The active copies sorted by slot are the schedule; the simulator checks it.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field, replace
from typing import Literal

import numpy as np

from memplan.tasks.solve.core.coarsen import solve_coarsened
from memplan.tasks.solve.core.milp import Progress
from memplan.tasks.solve.core.orders import memory_order
from memplan.tasks.solve.core.peak_insertion import peak_insertion_schedule
from memplan.tasks.solve.core.problem import Problem
from memplan.tasks.solve.core.simulator import default_schedule, simulate
from memplan.tasks.solve.core.solution import Solution, SolveOptions, checked_solution, min_budget_lower_bound

log = logging.getLogger("memplan.solve")

COST_RESOLUTION = 10 ** 6
"""Non-integer costs are scaled so that the dearest node costs this many units (floored)."""


@dataclass(frozen=True)
class MoccasinOptions:
    """Options of `moccasin`."""

    max_copies: int = field(default=2, metadata={
        "help": "C: computations per node at most (MOCCASIN's retention intervals per tensor)."})
    order: Literal["memory", "default"] = field(default="memory", metadata={
        "help": "the order whose stages the slots follow: 'memory' (memory_order, a low-peak topological "
                "order) or 'default' (the graph's, Checkmate's space)."})
    presolve: bool = field(default=False, metadata={
        "help": "CP-SAT presolve; off by default: on the random layered n250 graph it delays the first "
                "solution from seconds to minutes."})
    insertion_start: bool = field(default=True, metadata={
        "help": "without a mip_start, when the no-recomputation schedule exceeds the budget, start from the "
                "peak-directed insertion greedy's schedule (tasks/solve/core/peak_insertion.py) made frontier-advancing, "
                "so that phase 1 is skipped when it fits."})
    coarsen: bool = field(default=False, metadata={
        "help": "solve on the graph with single-reader chains merged (tasks/solve/core/coarsen.py), then expand."})


@dataclass
class _Model:
    """The CP-SAT model and its variables, indexed [node][copy] (ends [node][copy][output])."""

    cp: object
    horizon: int
    active: list
    start: list
    end: list
    reads: list            # (u, i, v, j, w, boolean)
    unit: float
    peak: object           # the cumulative's capacity
    cost: object           # the objective (integer cost units)


def _integer_costs(cost: np.ndarray) -> tuple[np.ndarray, float]:
    """(integer costs, unit): exact when costs are integers below 2^40, else floor(cost / unit) with the
    dearest node at COST_RESOLUTION units."""
    if np.all(cost == np.round(cost)) and cost.max(initial=0) < 2 ** 40:
        return cost.astype(np.int64), 1.0
    unit = float(cost.max()) / COST_RESOLUTION
    return np.floor(cost / unit).astype(np.int64), unit


def slot(stage, position):
    """Event index of the node at order `position` run in `stage` (Checkmate's stages laid end to end)."""
    return stage * (stage + 1) // 2 + position


def build_model(problem: Problem, budget: int, max_copies: int) -> _Model:
    """The CP-SAT model of the module docstring; the cumulative's capacity is the variable `model.peak`
    in [budget, eager peak] (phase 1 minimizes it, phase 2 fixes it to the budget)."""
    from ortools.sat.python import cp_model

    n = problem.num_nodes
    pos = problem.position
    H = slot(n, 0)
    cp = cp_model.CpModel()
    costs, unit = _integer_costs(problem.cost)
    users, is_output = problem.value_users, problem.is_output
    active, start, end = [], [], []
    memory, demand = [], []
    for v in range(n):
        k = int(pos[v])
        copies = min(max_copies, n - k)             # copy i > 0 runs in a later stage
        a_v, s_v, e_v = [], [], []
        for i in range(copies):
            if i == 0:
                a, s = cp.NewConstant(1), cp.NewConstant(slot(k, k))
            else:
                a = cp.NewBoolVar(f"a{v}_{i}")
                s = cp.NewIntVarFromDomain(cp_model.Domain.FromValues([slot(t, k) for t in range(k + i, n)]), f"s{v}_{i}")
                cp.AddImplication(a, a_v[-1])
                for e_prev in e_v[-1] or [s_v[-1]]:
                    cp.Add(s > e_prev).OnlyEnforceIf(a)
                cp.Add(s == slot(k + i, k)).OnlyEnforceIf(a.Not())
            ends = []
            for w in problem.node_outputs[v]:
                if not users[w] and not is_output[w]:
                    ends.append(s)                                  # never read: live in its own slot
                    continue
                e = cp.NewIntVar(slot(k, k), H - 1, f"e{v}_{i}_{w}")
                cp.Add(e >= s)
                if i:
                    cp.Add(e == s).OnlyEnforceIf(a.Not())
                ends.append(e)
                if problem.value_bytes[w] > 0:
                    size = cp.NewIntVar(1, H, f"len{v}_{i}_{w}")
                    memory.append(cp.NewOptionalIntervalVar(s, size, e + 1, a, f"keep{v}_{i}_{w}"))
                    demand.append(int(problem.value_bytes[w]))
            for w, e in zip(problem.node_outputs[v], ends):
                if e is s and problem.value_bytes[w] > 0:
                    memory.append(cp.NewOptionalFixedSizeIntervalVar(s, 1, a, f"own{v}_{i}_{w}"))
                    demand.append(int(problem.value_bytes[w]))
            if problem.workspace[v] > 0:
                memory.append(cp.NewOptionalFixedSizeIntervalVar(s, 1, a, f"work{v}_{i}"))
                demand.append(int(problem.workspace[v]))
            a_v.append(a)
            s_v.append(s)
            e_v.append(ends)
        active.append(a_v)
        start.append(s_v)
        end.append(e_v)
    eager = int(simulate(problem, default_schedule(problem)).peak_bytes)
    peak = cp.NewIntVar(min(int(budget), eager), max(int(budget), eager), "peak")
    if memory:
        cp.AddCumulative(memory, demand, peak)
    # graph outputs: the last active copy retains them to the end
    for v in range(n):
        for k, w in enumerate(problem.node_outputs[v]):
            if not is_output[w]:
                continue
            for i in range(len(active[v])):
                last = ([active[v][i]] if i else []) + ([active[v][i + 1].Not()] if i + 1 < len(active[v]) else [])
                cp.Add(end[v][i][k] == H - 1).OnlyEnforceIf(last)
    # precedence: a retention interval of each input covers the slot computing each active copy
    reads = []
    producer = problem.value_producer
    for v in range(n):
        for w in problem.node_inputs[v]:
            u = int(producer[w])
            if u < 0:
                continue
            k = problem.node_outputs[u].index(w)
            for j in range(len(active[v])):
                options = []
                for i in range(len(active[u])):
                    b = cp.NewBoolVar(f"r{u}_{i}_{v}_{j}_{w}")
                    cp.AddImplication(b, active[u][i])
                    cp.AddImplication(b, active[v][j])
                    cp.Add(start[u][i] < start[v][j]).OnlyEnforceIf(b)
                    cp.Add(end[u][i][k] >= start[v][j]).OnlyEnforceIf(b)
                    options.append(b)
                    reads.append((u, i, v, j, k, b))
                cp.AddBoolOr(options).OnlyEnforceIf(active[v][j])
    terms = [(a, int(costs[v])) for v in range(n) for a in active[v][1:] if costs[v]]
    cost = cp_model.LinearExpr.WeightedSum([a for a, _ in terms], [c for _, c in terms]) + int(costs.sum())
    return _Model(cp, H, active, start, end, reads, unit, peak, cost)


def schedule_from_solution(model: _Model, value) -> list[tuple[str, int]]:
    """Active copies in slot order (`value` reads a variable's value in the solution)."""
    steps = [(value(model.start[v][i]), v) for v in range(len(model.active))
             for i, a in enumerate(model.active[v]) if value(a)]
    return [("compute", v) for _, v in sorted(steps)]


def frontier_slots(problem: Problem, schedule: list) -> list[int] | None:
    """The slot of each compute step of a frontier-advancing schedule (stage t ends with the first
    computation of order[t]; each stage runs nodes in increasing order), or None for another schedule."""
    pos, n = problem.position, problem.num_nodes
    stage, last, slots = 0, -1, []
    for step in schedule:
        node = step[1] if isinstance(step, tuple) else step.get("compute")
        if (step[0] if isinstance(step, tuple) else "compute" if "compute" in step else "free") != "compute":
            continue
        k = int(pos[node])
        if stage >= n or k > stage or k <= last:
            return None
        slots.append(slot(stage, k))
        last = k
        if k == stage:
            stage, last = stage + 1, -1
    return slots if stage == n else None


def frontier_schedule(problem: Problem, schedule: list[tuple[str, int]]) -> list[tuple[str, int]]:
    """The compute steps of `schedule` (first computations in the order) made frontier-advancing: the
    recomputations before each first computation run in order position, each node once there."""
    pos, out, stage, seen = problem.position, [], [], set()
    for kind, v in schedule:
        if kind != "compute":
            continue
        if v not in seen:
            out += sorted(set(stage), key=lambda u: int(pos[u])) + [v]
            seen.add(v)
            stage = []
        else:
            stage.append(v)
    out += sorted(set(stage), key=lambda u: int(pos[u]))
    return [("compute", int(v)) for v in out]


def insertion_start(problem: Problem, budget: int, max_copies: int, deadline: float | None) -> list | None:
    """The insertion greedy's schedule on `problem.order`, frontier-advancing, with at most `max_copies`
    computations per node; None when it finds none or the frontier-advancing form exceeds the budget."""
    schedule = peak_insertion_schedule(problem, budget, problem.order, deadline, max_copies=max_copies)
    if schedule is None:
        return None
    schedule = frontier_schedule(problem, schedule)
    return schedule if simulate(problem, schedule).peak_bytes <= budget else None


def add_hint(problem: Problem, model: _Model, schedule: list) -> bool:
    """Hint every variable with `schedule`; False (no hint) when it is not frontier-advancing or computes a
    node more often than the model allows."""
    slots = frontier_slots(problem, schedule)
    if slots is None:
        return False
    nodes = [s[1] if isinstance(s, tuple) else s["compute"] for s in schedule
             if (s[0] if isinstance(s, tuple) else "compute" if "compute" in s else "free") == "compute"]
    copy_of: list[list[int]] = [[] for _ in range(len(model.active))]
    for t, v in zip(slots, nodes):
        copy_of[v].append(t)
    if any(len(c) > len(model.active[v]) for v, c in enumerate(copy_of)):
        return False
    sim = simulate(problem, [("compute", v) for v in nodes])
    step_slot = np.asarray(slots, dtype=np.int64)
    last_slot = {(int(step_slot[s]), int(w)): int(step_slot[e])
                 for s, w, e in zip(sim.copy_start, sim.copy_value, sim.copy_end)}
    cp, H, pos = model.cp, model.horizon, problem.position
    cp.ClearHints()
    for v, taken in enumerate(copy_of):
        k = int(pos[v])
        for i, a in enumerate(model.active[v]):
            on = i < len(taken)
            t = taken[i] if on else slot(k + i, k)
            if i:
                cp.AddHint(a, int(on))
                cp.AddHint(model.start[v][i], t)
            for j, w in enumerate(problem.node_outputs[v]):
                e = model.end[v][i][j]
                if e is model.start[v][i]:
                    continue
                final = on and i == len(taken) - 1 and problem.is_output[w]
                cp.AddHint(e, H - 1 if final else last_slot[(t, w)] if on else t)
    for u, i, v, j, k, b in model.reads:
        w = problem.node_outputs[u][k]
        su = copy_of[u][i] if i < len(copy_of[u]) else None
        sv = copy_of[v][j] if j < len(copy_of[v]) else None
        covers = su is not None and sv is not None and su < sv and (
            (i == len(copy_of[u]) - 1 and problem.is_output[w]) or sv <= last_slot[(su, w)])
        cp.AddHint(b, int(covers))
    return True


def moccasin(problem: Problem, budget: int, options: SolveOptions) -> Solution:
    """Two phases as in the paper, both by CP-SAT with `options.threads` workers (default 1) within
    `options.time_limit` in all: (1) from the start (`options.mip_start`, else the insertion start or the
    no-recomputation schedule), minimize the peak down to the budget (skipped when the start fits); (2)
    with the peak at most the budget, minimize the compute cost from phase 1's schedule, to relative gap
    `options.gap`. A start that is not
    frontier-advancing or exceeds `max_copies` is not used as a hint, but is returned when it fits and
    phase 1 finds nothing."""
    from ortools.sat.python import cp_model

    t0 = time.perf_counter()
    lower = min_budget_lower_bound(problem)
    if budget < lower:
        return Solution("moccasin", budget, "infeasible", solve_seconds=time.perf_counter() - t0,
                        min_budget_lower_bound=lower,
                        message=f"no schedule fits: some node needs {lower} bytes for its inputs, outputs and workspace")
    opts: MoccasinOptions = options.params
    if opts.max_copies < 1:
        raise ValueError(f"moccasin option max_copies = {opts.max_copies}: each node needs at least one copy; use 1 or more.")
    if opts.coarsen:
        return solve_coarsened(moccasin, problem, budget, replace(options, params=replace(opts, coarsen=False)))
    deadline = None if options.time_limit is None else t0 + options.time_limit
    fine = problem
    if opts.order == "memory":
        problem = replace(problem, order=memory_order(problem))
    model = build_model(problem, budget, opts.max_copies)
    unit = model.unit
    progress: list[Progress] = []
    start = options.mip_start if options.mip_start is not None else default_schedule(problem)
    if options.mip_start is None and opts.insertion_start and simulate(problem, start).peak_bytes > budget:
        start = insertion_start(problem, budget, opts.max_copies, deadline) or start
    size = dict(num_variables=len(model.cp.Proto().variables), num_constraints=len(model.cp.Proto().constraints))

    def run(objective, record: bool, gap: float):
        solver = cp_model.CpSolver()
        params = solver.parameters
        params.num_workers = int(options.threads or 1)
        params.relative_gap_limit = float(gap)
        params.cp_model_presolve = opts.presolve
        if deadline is not None:
            params.max_time_in_seconds = max(deadline - time.perf_counter(), 0.01)
        model.cp.Minimize(objective)

        class Recorder(cp_model.CpSolverSolutionCallback):
            def on_solution_callback(self) -> None:
                if not record:
                    log.info("cp-sat phase 1 %7.1fs  peak %d (budget %d)", time.perf_counter() - t0,
                             self.ObjectiveValue(), budget)
                else:
                    progress.append(Progress(time.perf_counter() - t0, self.ObjectiveValue() * unit,
                                             self.BestObjectiveBound() * unit))
                    log.info("cp-sat %7.1fs  incumbent %.6g  bound %.6g", progress[-1].seconds,
                             progress[-1].incumbent, progress[-1].bound)

        return solver, solver.Solve(model.cp, Recorder())

    hinted = add_hint(problem, model, start)
    if not hinted and options.mip_start is not None:
        log.info("moccasin: the start schedule is not frontier-advancing in the model's order; starting from none")
        start = default_schedule(problem)
        hinted = add_hint(problem, model, start)
    if simulate(problem, start).peak_bytes > budget or not hinted:
        solver, status = run(model.peak, False, 0.0)                                      # phase 1
        if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE) or solver.Value(model.peak) > budget:
            why = ("CP-SAT proved that no frontier-advancing schedule with at most "
                   f"{opts.max_copies} computations per node fits" if status in (cp_model.OPTIMAL, cp_model.INFEASIBLE)
                   else "time limit reached before a schedule within the budget was found")
            kind = "infeasible" if status in (cp_model.OPTIMAL, cp_model.INFEASIBLE) else "no_solution"
            if options.mip_start is not None and simulate(fine, options.mip_start).peak_bytes <= budget:
                return checked_solution(fine, "moccasin", budget, options.mip_start, status="feasible",
                                        solve_seconds=time.perf_counter() - t0, backend="cp-sat",
                                        message=f"{why}; returned the start schedule, which lies outside that space",
                                        **size)
            return Solution("moccasin", budget, kind, solve_seconds=time.perf_counter() - t0, backend="cp-sat",
                            min_budget_lower_bound=max(lower, budget + 1) if kind == "infeasible" else lower,
                            message=why, **size)
        first = schedule_from_solution(model, solver.Value)
        add_hint(problem, model, first)
        progress.append(Progress(time.perf_counter() - t0, simulate(problem, first).compute_cost, None))
    else:
        first = start
        progress.append(Progress(time.perf_counter() - t0, simulate(problem, first).compute_cost, None))
    model.cp.Add(model.peak <= int(budget))
    solver, status = run(model.cost, True, options.gap)                                     # phase 2
    seconds = time.perf_counter() - t0
    found = status in (cp_model.OPTIMAL, cp_model.FEASIBLE)
    bound = solver.BestObjectiveBound() * unit if status != cp_model.MODEL_INVALID else None
    bound = None if bound is None or not math.isfinite(bound) else bound
    schedule = schedule_from_solution(model, solver.Value) if found else first
    label = "optimal" if status == cp_model.OPTIMAL else "feasible"
    return checked_solution(fine, "moccasin", budget, schedule, status=label, bound=bound, solve_seconds=seconds,
                            backend="cp-sat", progress=progress,
                            message="" if status == cp_model.OPTIMAL else "time limit reached", **size)
