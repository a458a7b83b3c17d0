"""Dynamic Tensor Rematerialization (Kirisame et al., ICLR 2021) run offline as a planner (`dtr`).

Walk a topological order. Before each computation, while the resident values plus the node's new outputs
and workspace exceed the budget, evict (emit a free of) the resident value of least

    h(t) = (c0(t) + c(e*(t))) / (m(t) * s(t))                                        (DTR sec. 4)

among the evictable ones (produced by a recomputable node, not a graph output, not read by a
computation in progress): c0 the producer's cost, m the bytes, s the staleness and c(e*(t)) the cost of
the evicted neighbourhood, estimated by
- "eq" (h_DTR^eq): evicted values joined into equivalence classes (union-find) with the neighbours they
  were evicted beside, each class carrying its total cost; c(e*) sums the classes of t's evicted
  neighbours (a rematerialized value leaves its class's cost; classes are not split, as in the paper);
- "local" (h_DTR^local): the costs of t's evicted immediate neighbours (inputs of its producer and
  outputs of its users);
- "lookahead" (offline): "eq" plus the cost of recomputing the inputs of t's producer that will be gone
  at t's next use (evicted, or last read by the order before it), LOOKAHEAD_DEPTH levels deep.
Staleness "last-access" is the paper's (compute steps since t was last read or written); "next-use" is
the distance to t's next read in the order (known offline, as in Belady's policy).
A node reading an evicted value first recomputes its producer, recursively its evicted inputs first,
each pinned until its reader has run. A value is freed after its last read in the order unless an
evicted value the order still reads is computed from it. With `hold`, values that a step's
recomputations read stay resident (evictable) until the step has run, rather than being freed at once.
Every combination of the options (`DtrOptions`: the problem's order, moccasin's low-peak `memory_order`
and, with the optimizer inside the step, `update_order` (each parameter's later readers before its
gradient, so it is updated as soon as the gradient is made), heuristics, staleness, hold, budget
allowances) is walked, each walk stopping once it costs more than the best so far (each better schedule
is logged as progress). Before the walks, `insertion` runs the peak-directed recomputation insertion
greedy (tasks/solve/core/peak_insertion.py) from each order: it does not thrash where the walks do
(random layered graphs at 0.8). The simulator checks each schedule (a walk's peak is at most the walk's
own count, since a copy is live only until its last read) and the cheapest within the budget is
returned. When the problem offers implementation variants, all of this runs once per candidate choice of
them (tasks/solve/core/fixed_variants.py: the time-saving families, such as the GELU's tanh by its sigmoid
identity, alone and with the memory-saving families, each fixed on every node offering it, and with each
node-local variant fixed where it needs less workspace), each schedule running its choice's variants;
a choice whose nodes, each computed once, already cost more than the best schedule found is skipped (as
profiled on this CPU, MobileNet-V2's masks and output-activated BatchNorm add 36-61% to the step, more
than the recomputation they could save). For a search over budgets (`SolveOptions`: a `max_overhead` plan) the
walks also stop past its `cost_limit`, the runs stop at the first schedule costing at most `enough`, and the runs
and choices that found the best schedules at its other budgets (kept in its `memo`) go first.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from itertools import product
from typing import Callable, Literal

import numpy as np
import scipy.sparse as sp

from memplan.tasks.solve.core.fixed_variants import candidate_choices, fixed_problem, tag_schedule
from memplan.tasks.solve.core.milp import Progress
from memplan.tasks.solve.core.orders import keeps_random_order, memory_order, update_order
from memplan.tasks.solve.core.peak_insertion import peak_insertion_schedule
from memplan.tasks.solve.core.problem import Problem
from memplan.tasks.solve.core.simulator import simulate
from memplan.tasks.solve.core.solution import Solution, SolveOptions, checked_solution, min_budget_lower_bound

Heuristic = Literal["eq", "local", "lookahead"]
Staleness = Literal["last-access", "next-use"]


@dataclass(frozen=True)
class DtrOptions:
    """Options of `dtr`: every combination of the listed heuristics, staleness measures and allowances is
    run; the cheapest schedule within the budget is kept."""

    orders: tuple[Literal["default", "memory", "update"], ...] = field(default=("default", "memory", "update"),
                                                                       metadata={
        "help": "orders walked: 'default' (the problem's), 'memory' (moccasin's low-peak topological order) and/or "
                "'update' (with the optimizer inside the step: each parameter's later readers before its gradient, "
                "tasks/solve/core/orders.py update_order; walked only where it differs from the default)."})
    heuristics: tuple[Heuristic, ...] = field(default=("lookahead", "local"), metadata={
        "help": "evicted-neighbourhood cost: 'eq' (h_DTR^eq), 'local' (h_DTR^local), 'lookahead' (eq plus the "
                "inputs that will be gone at the next use)."})
    staleness: tuple[Staleness, ...] = field(default=("last-access", "next-use"), metadata={
        "help": "s(t): 'last-access' (steps since last read, the paper's) and/or 'next-use' (steps to next read)."})
    hold: tuple[bool, ...] = field(default=(False, True), metadata={
        "help": "free a recomputation's inputs at once (False) and/or hold them until the step has run (True)."})
    max_cost: float = field(default=2.0, metadata={
        "help": "a walk stops once its cost passes this multiple of the sum of node costs (or the best so far)."})
    allowances: tuple[float, ...] = field(default=(1.0,), metadata={
        "help": "fractions of the budget the walk plans for (each in (0, 1])."})
    insertion: bool = field(default=True, metadata={
        "help": "also run the peak-directed recomputation insertion greedy (tasks/solve/core/peak_insertion.py) "
                "from each order."})
    variants: bool = field(default=True, metadata={
        "help": "when the problem offers implementation variants, also plan with each candidate choice of them "
                "fixed (tasks/solve/core/fixed_variants.py: the memory- and time-saving families, e.g. ReLU masks), an "
                "equal share of the time each."})
    insertion_passes: int = field(default=0, metadata={
        "help": "remove-and-repair passes after each insertion run (random layered n250/n500 at 0.8: 0.4-0.5% "
                "cheaper for 2-6x its time)."})


LOOKAHEAD_DEPTH = 2
"""Levels of inputs the 'lookahead' heuristic prices the recomputation of."""


class _Stuck(Exception):
    """No evictable value is left to make room (or a needed value cannot be recomputed)."""


class _Walk:
    """One DTR walk over `problem.order` within `budget` bytes."""

    def __init__(self, problem: Problem, budget: int, heuristic: Heuristic, staleness: Staleness,
                 deadline: float | None, cost_limit: float, hold: bool):
        p = problem
        self.p, self.budget, self.heuristic, self.staleness, self.deadline = p, budget, heuristic, staleness, deadline
        self.cost_limit, self.cost, self.hold = cost_limit, 0.0, hold
        nv = p.num_values
        self.inputs = [tuple(dict.fromkeys(ins)) for ins in p.node_inputs]
        self.producer = p.value_producer
        self.nbytes = p.value_bytes.astype(np.int64)
        self.vcost = np.where(self.producer >= 0, p.cost[np.maximum(self.producer, 0)], 0.0)
        internal = self.producer >= 0
        self.evictable = internal.copy()
        self.evictable[internal] = p.is_recomputable[self.producer[internal]]
        self.evictable &= ~p.is_output & (self.nbytes > 0)
        self.resident = ~internal                     # graph inputs are always resident, never counted
        self.computed = ~internal
        self.pinned = np.zeros(nv, dtype=np.int64)
        self.remaining = np.array([len(u) for u in p.value_users], dtype=np.int64)
        self.user_pos = [np.array([p.position[u] for u in users], dtype=np.int64) for users in p.value_users]
        self.last_access = np.zeros(nv, dtype=np.float64)
        self.clock = 0
        self.position = 0
        self.live = 0
        self.schedule: list[tuple[str, int]] = []
        self.touched: list[int] = []
        rows, cols = [], []
        for node, ins in enumerate(self.inputs):
            for v in ins:
                if internal[v]:
                    for w in p.node_outputs[node]:
                        rows += [v, w]
                        cols += [w, v]
        self.parents = [[v for v in self.inputs[self.producer[w]] if internal[v]] if internal[w] else []
                        for w in range(nv)]
        self.last_use = np.array([pos[-1] if len(pos) else -1 for pos in self.user_pos], dtype=np.int64)
        self.children = sp.csr_matrix((np.ones(len(rows) // 2), (rows[::2], cols[::2])), shape=(nv, nv))
        self.neighbours = sp.csr_matrix((np.ones(len(rows)), (rows, cols)), shape=(nv, nv))
        self.neighbours.data[:] = 1.0                # duplicates summed: back to 0/1
        self.parent = np.arange(nv)                  # union-find of evicted values (h_DTR^eq)
        self.class_cost = np.zeros(nv)

    # -- h_DTR^eq equivalence classes -----------------------------------------------------------

    def _find(self, v: int) -> int:
        root = v
        while self.parent[root] != root:
            root = self.parent[root]
        while self.parent[v] != root:
            self.parent[v], v = root, self.parent[v]
        return root

    def _evicted_neighbours(self, v: int) -> np.ndarray:
        row = self.neighbours.indices[self.neighbours.indptr[v]:self.neighbours.indptr[v + 1]]
        return row[self.computed[row] & ~self.resident[row]]

    def _on_evict(self, v: int) -> None:
        self.parent[v], self.class_cost[v] = v, self.vcost[v]
        for u in self._evicted_neighbours(v):
            a, b = self._find(int(u)), self._find(v)
            if a != b:
                self.parent[a] = b
                self.class_cost[b] += self.class_cost[a]

    # -- eviction ---------------------------------------------------------------------------------

    def _scores(self, candidates: np.ndarray) -> np.ndarray:
        """h(t) of each candidate (lower: evict first)."""
        evicted = self.computed & ~self.resident
        if self.heuristic == "local":
            neighbourhood = self.neighbours[candidates] @ np.where(evicted, self.vcost, 0.0)
        else:
            neighbourhood = np.zeros(len(candidates))
            for k, t in enumerate(candidates.tolist()):
                roots = {self._find(int(u)) for u in self._evicted_neighbours(t)}
                neighbourhood[k] = sum(self.class_cost[r] for r in roots)
                if self.heuristic == "lookahead":
                    neighbourhood[k] += self._refill_cost(t, self._next_use(t), LOOKAHEAD_DEPTH)
        if self.staleness == "last-access":
            s = self.clock - self.last_access[candidates] + 1.0
        else:
            s = np.array([self._next_use(t) - self.position + 1.0 for t in candidates.tolist()])
        return (self.vcost[candidates] + neighbourhood) / (self.nbytes[candidates] * s)

    def _refill_cost(self, t: int, at: int, depth: int, seen: set | None = None) -> float:
        """Cost of recomputing t's inputs that will not be resident at position `at` (evicted now, or last
        read by the order before `at`), recursively up to `depth` levels (each counted once), then the
        cost of their classes."""
        seen = set() if seen is None else seen
        total = 0.0
        for u in self.parents[t]:
            if u in seen or (self.resident[u] and self.last_use[u] >= at):
                continue
            seen.add(u)
            total += self.vcost[u]
            if depth > 1:
                total += self._refill_cost(u, at, depth - 1, seen)
            elif not self.resident[u]:
                total += self.class_cost[self._find(u)]
        return total

    def _children(self, v: int) -> np.ndarray:
        """Evicted values computed from v that the order still reads."""
        row = self.children.indices[self.children.indptr[v]:self.children.indptr[v + 1]]
        return row[self.computed[row] & ~self.resident[row] & (self.remaining[row] > 0)]

    def _dead(self, v: int) -> bool:
        """v is no longer read by the order nor needed to recompute an evicted value the order reads."""
        return (self.remaining[v] == 0 and not self.p.is_output[v]
                and not self._children(v).size)

    def _next_use(self, t: int) -> int:
        if self.remaining[t] == 0:                  # kept for an evicted child: its next use
            return min((self._next_use(int(c)) for c in self._children(t)), default=len(self.p.order))
        return int(self.user_pos[t][len(self.user_pos[t]) - self.remaining[t]])

    def _make_room(self, node: int, need: int) -> None:
        while self.live + need > self.budget:
            mask = self.resident & self.evictable & (self.pinned == 0)
            mask[list(self.p.node_outputs[node])] = False
            candidates = np.flatnonzero(mask)
            if candidates.size == 0:
                raise _Stuck(f"{self.p.node_label(node)} needs {self.live + need} bytes with every resident value "
                             f"pinned or not evictable")
            scores = self._scores(candidates)
            victim = int(candidates[int(np.argmin(scores))])        # first of the lowest: deterministic
            self._free(victim)
            if self.heuristic != "local":
                self._on_evict(victim)

    def _free(self, v: int) -> None:
        self.resident[v] = False
        self.live -= int(self.nbytes[v])
        self.schedule.append(("free", v))

    # -- computing --------------------------------------------------------------------------------

    def _compute(self, node: int) -> None:
        outs = self.p.node_outputs[node]
        new = int(sum(int(self.nbytes[w]) for w in outs if not self.resident[w]))
        self._make_room(node, new + int(self.p.workspace[node]))
        self.schedule.append(("compute", node))
        self.clock += 1
        self.cost += float(self.p.cost[node])
        if self.cost > self.cost_limit:
            raise _Stuck(f"the schedule costs more than {self.cost_limit:.6g}")
        if self.deadline is not None and time.perf_counter() > self.deadline:
            raise _Stuck("time limit reached")
        for w in outs:
            if self.computed[w] and not self.resident[w] and self.heuristic != "local":
                root = self._find(w)
                self.class_cost[root] = max(self.class_cost[root] - self.vcost[w], 0.0)
            self.resident[w] = self.computed[w] = True
            self.last_access[w] = self.clock
        self.live += new

    def _materialize(self, target: int) -> None:
        """Compute `target` (a node of the order, or a recomputation), first recomputing its evicted
        inputs, recursively, each pinned until its reader has run."""
        stack = [[target, 0]]
        while stack:
            frame = stack[-1]
            node, ins = frame[0], self.inputs[frame[0]]
            while frame[1] < len(ins):
                v = ins[frame[1]]
                if self.resident[v]:
                    if self.producer[v] >= 0:
                        self.pinned[v] += 1
                        self.last_access[v] = self.clock
                    frame[1] += 1
                    continue
                producer = int(self.producer[v])
                if not self.p.is_recomputable[producer]:
                    raise _Stuck(f"value {v} of {self.p.node_label(producer)}, which is not recomputable, was freed "
                                 f"but {self.p.node_label(node)} reads it again")
                stack.append([producer, 0])
                break
            else:
                self._compute(node)
                for v in ins:
                    if self.producer[v] >= 0:
                        self.pinned[v] -= 1
                stack.pop()
                if stack and not self.hold:      # a recomputation: free what it read or wrote that no one waits for
                    waiting = self.inputs[stack[-1][0]][stack[-1][1]]
                    for w in (*ins, *self.p.node_outputs[node]):
                        if (w != waiting and self.producer[w] >= 0 and self.resident[w] and self.pinned[w] == 0
                                and self._dead(w)):
                            self._free(w)
                self.touched.extend(ins)
                self.touched.extend(self.p.node_outputs[node])

    def run(self) -> list[tuple[str, int]]:
        p = self.p
        for position, node in enumerate(p.order.tolist()):
            self.position = position
            self._materialize(node)
            for v in self.inputs[node]:
                if self.producer[v] >= 0:
                    self.remaining[v] -= 1
            for v in dict.fromkeys(self.touched):      # what this step and its recomputations read or wrote
                if self.producer[v] >= 0 and self.resident[v] and self._dead(v):
                    self._free(v)
            self.touched.clear()
        return self.schedule


def dtr_schedule(problem: Problem, budget: int, heuristic: Heuristic = "eq", staleness: Staleness = "last-access",
                 hold: bool = False, deadline: float | None = None,
                 cost_limit: float = float("inf")) -> list[tuple[str, int]] | None:
    """The DTR walk's schedule within `budget` bytes (module docstring), or None when it gets stuck, passes
    `deadline` (perf_counter seconds) or its compute cost exceeds `cost_limit`. `hold`: values a step's
    recomputations read stay resident (evictable) until the step has run, instead of being freed at once."""
    try:
        return _Walk(problem, budget, heuristic, staleness, deadline, cost_limit, hold).run()
    except _Stuck:
        return None


def _walk_all(problem: Problem, budget: int, opts: DtrOptions, deadline: float | None,
              consider: Callable[[list, tuple], bool], best_cost: Callable[[], float], first: set = frozenset()) -> int:
    """Run the insertion greedy and every walk of `opts` on `problem` until `deadline`, passing each schedule
    found and its run's key to `consider`, which returns True when it is enough (the runs stop); the runs keyed
    in `first` go first (those that found the best schedules at other budgets). A walk stops once it costs more
    than `best_cost()`. Returns the number of runs."""
    start = time.perf_counter()
    walks = {"default": problem}
    if "memory" in opts.orders:
        order = memory_order(problem)
        if keeps_random_order(problem, order):
            walks["memory"] = replace(problem, order=order)
    if "update" in opts.orders and problem.updates:
        order = update_order(problem)
        if not np.array_equal(order, problem.order) and keeps_random_order(problem, order):
            walks["update"] = replace(problem, order=order)
    # the insertion greedy gets at most half the time: on large operator graphs (a 24-layer GPT-2 at 0.3
    # of its peak) it can take minutes where the walks find the same schedule in seconds
    insertion_deadline = None if deadline is None else start + (deadline - start) / 2
    keys = [("insertion", order) for order in opts.orders if opts.insertion and order in walks]
    keys += [("walk", *run) for run in product(opts.orders, opts.allowances, opts.heuristics, opts.staleness, opts.hold)
             if run[0] in walks]
    runs = 0
    for key in sorted(keys, key=lambda key: key not in first):
        if deadline is not None and time.perf_counter() > (insertion_deadline if key[0] == "insertion" else deadline):
            continue
        runs += 1
        if key[0] == "insertion":
            schedule = peak_insertion_schedule(problem, budget, walks[key[1]].order, insertion_deadline,
                                               improve_passes=opts.insertion_passes)
        else:
            order, allowance, heuristic, staleness, hold = key[1:]
            limit = min(opts.max_cost * float(problem.cost.sum()), best_cost())
            schedule = dtr_schedule(walks[order], int(allowance * budget), heuristic, staleness, hold, deadline, limit)
        if schedule is not None and consider(schedule, key):
            break
    return runs


def dtr(problem: Problem, budget: int, options: SolveOptions) -> Solution:
    """The cheapest simulated schedule within `budget` over the option runs (`DtrOptions`)."""
    start = time.perf_counter()
    opts: DtrOptions = options.params
    if any(not 0 < a <= 1 for a in opts.allowances) or not all(
            (opts.orders, opts.heuristics, opts.staleness, opts.hold, opts.allowances)):
        raise ValueError(f"dtr options: allowances {opts.allowances!r} must be fractions in (0, 1], and orders, "
                         f"heuristics, staleness, hold and allowances must each list at least one choice.")
    lower = min_budget_lower_bound(problem)
    if budget < lower:
        return Solution("dtr", budget, "infeasible", solve_seconds=time.perf_counter() - start,
                        min_budget_lower_bound=lower,
                        message=f"no schedule fits: some node needs {lower} bytes for its inputs, outputs and "
                                f"workspace")
    deadline = None if options.time_limit is None else start + options.time_limit
    cost_limit = float("inf") if options.cost_limit is None else options.cost_limit
    best, best_key, runs, progress = None, None, 0, []
    choices = candidate_choices(problem) if opts.variants else [{}]
    won = set() if options.memo is None else options.memo.setdefault(("dtr", id(problem)), set())

    def consider(schedule, c: int, key: tuple) -> bool:
        nonlocal best, best_key
        schedule = tag_schedule(schedule, choices[c])
        sim = simulate(problem, schedule)
        found = (sim.compute_cost, sim.peak_bytes)
        if sim.peak_bytes <= budget and sim.compute_cost <= cost_limit and (best_key is None or found < best_key):
            best, best_key = schedule, found
            won.add((c, key))
            progress.append(Progress(time.perf_counter() - start, sim.compute_cost, None))
        return enough()

    def enough() -> bool:
        return best_key is not None and options.enough is not None and best_key[0] <= options.enough

    def best_cost() -> float:
        return cost_limit if best_key is None else min(cost_limit, best_key[0])

    # each choice gets an equal share of the time left; those that won at other budgets (`options.memo`) go first
    for left, c in enumerate(sorted(range(len(choices)), key=lambda c: all(c != i for i, _ in won))):
        fixed = fixed_problem(problem, choices[c]) if problem.has_variants else problem
        if enough() or fixed.cost.sum() > best_cost() or (best_key is not None and fixed.cost.sum() >= best_key[0]):
            continue                                 # every node once already costs more than the best (or the limit)
        share = None if deadline is None else time.perf_counter() + (deadline - time.perf_counter()) / (len(choices) - left)
        runs += _walk_all(fixed, budget, opts, share, lambda schedule, key, c=c: consider(schedule, c, key), best_cost,
                          {key for i, key in won if i == c})
    return checked_solution(problem, "dtr", budget, best, solve_seconds=time.perf_counter() - start,
                            message="" if best else (f"no DTR walk nor insertion ({runs} run) fit: each walk ran out of "
                                                     f"evictable values or cost more than max_cost = {opts.max_cost:g} "
                                                     f"x the sum of node costs (or the caller's cost_limit), each "
                                                     f"insertion ran out of moves lowering the peak, or the time "
                                                     f"limit was reached"),
                            min_budget_lower_bound=lower, progress=progress)
