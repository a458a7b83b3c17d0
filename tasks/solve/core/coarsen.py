"""Chain coarsening: merge single-reader, single-producer chains of nodes into one node before an exact
solve, and expand the coarse schedule back.

Node v joins the chain of its predecessor u when u allocates exactly one value w, w is read by v alone and
is no graph output, w is v's only input made by a node (its other inputs are graph inputs, always
resident), and u and v have the same phase. A chain m_1..m_r becomes one node: it reads the chain's
inputs, allocates m_r's outputs, costs the sum of the members' costs, and its workspace is
max_j (bytes(w_{j-1}) + bytes(out_j) + ws_j) - bytes(out_r) (w_0 = 0), so a coarse step holds at least
what any member's step holds (the chain's inputs counted as live throughout). Hence:

- the expanded schedule (each coarse compute replaced by its members in order) has a simulated peak at
  most the coarse one, at the same cost: a coarse schedule within the budget expands to one within it;
- coarsening restricts the search (members always run together, w is never kept), so the coarse
  optimum is an upper bound on the fine optimum, and sum of fine costs stays the only lower bound.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import Any, Callable, Iterable

import numpy as np

from memplan.tasks.solve.core.problem import Problem
from memplan.tasks.solve.core.simulator import normalize_schedule
from memplan.tasks.solve.core.solution import Solution, SolveOptions, checked_solution


@dataclass(frozen=True)
class Coarsening:
    """`problem` is the coarse problem; `members[c]` the fine nodes of coarse node c, in run order."""

    problem: Problem
    members: tuple[tuple[int, ...], ...]

    def expand(self, schedule: Iterable[Any]) -> list[tuple[str, int]]:
        """The fine schedule of a coarse one (frees dropped: the simulator frees after the last read)."""
        return [("compute", m) for step in normalize_schedule(schedule) if "compute" in step
                for m in self.members[step["compute"]]]


def chains(problem: Problem) -> list[list[int]]:
    """The maximal chains of the module docstring, in default order of their last member."""
    producer, users = problem.value_producer, problem.value_users
    head = list(range(problem.num_nodes))                       # node -> chain it ends or belongs to
    chain: dict[int, list[int]] = {v: [v] for v in range(problem.num_nodes)}
    for v in problem.order.tolist():
        made = [w for w in problem.node_inputs[v] if producer[w] >= 0]
        if len(made) != 1:
            continue
        w = made[0]
        u = int(producer[w])
        if (problem.node_outputs[u] == (w,) and users[w] == (v,) and not problem.is_output[w]
                and problem.phase[u] == problem.phase[v]):
            c = head[u]
            chain[c].append(v)
            del chain[v]
            head[v] = c
    last = {c: problem.position[members[-1]] for c, members in chain.items()}
    return [chain[c] for c in sorted(chain, key=last.__getitem__)]


def coarsen(problem: Problem) -> Coarsening:
    """Merge every chain into one node (module docstring). The problem must have no variants."""
    if problem.has_variants:
        raise ValueError("coarsen needs a problem without implementation variants (problem.without_variants()).")
    groups = chains(problem)
    producer, nbytes = problem.value_producer, problem.value_bytes
    inside = {w for g in groups for u in g[:-1] for w in problem.node_outputs[u]}
    keep = [w for w in range(problem.num_values) if w not in inside]
    new_id = np.full(problem.num_values, -1, dtype=np.int64)
    new_id[keep] = np.arange(len(keep))
    node_of = np.empty(problem.num_nodes, dtype=np.int64)
    for c, g in enumerate(groups):
        node_of[g] = c
    cost, workspace, inputs, outputs, names = [], [], [], [], []
    for g in groups:
        reads = dict.fromkeys(w for m in g for w in problem.node_inputs[m] if w not in inside)
        out_bytes = [int(nbytes[list(problem.node_outputs[m])].sum()) for m in g]
        held = [(out_bytes[j - 1] if j else 0) + out_bytes[j] + int(problem.workspace[m]) for j, m in enumerate(g)]
        cost.append(float(problem.cost[g].sum()))
        workspace.append(max(held) - out_bytes[-1])
        inputs.append(tuple(int(new_id[w]) for w in reads))
        outputs.append(tuple(int(new_id[w]) for w in problem.node_outputs[g[-1]]))
        names.append("+".join(problem.node_names[m] for m in g) if problem.node_names else "")
    kept_producer = producer[keep]
    coarse = Problem(
        name=f"{problem.name} (coarse)", cost=np.asarray(cost), workspace=np.asarray(workspace, dtype=np.int64),
        phase=tuple(problem.phase[g[-1]] for g in groups), node_inputs=tuple(inputs), node_outputs=tuple(outputs),
        value_bytes=nbytes[keep], value_producer=np.where(kept_producer >= 0, node_of[np.maximum(kept_producer, 0)], -1),
        outputs=tuple(int(new_id[w]) for w in problem.outputs), order=np.arange(len(groups), dtype=np.int64),
        fingerprint=problem.fingerprint, node_names=tuple(names) if problem.node_names else (),
        cost_unit=problem.cost_unit)
    return Coarsening(coarse, tuple(tuple(g) for g in groups))


def solve_coarsened(run: Callable[[Problem, int, SolveOptions], Solution], problem: Problem, budget: int,
                    options: SolveOptions) -> Solution:
    """`run` on the coarse problem, its schedule expanded and checked on `problem`. The coarse bound does not
    bound the fine optimum, so the bound is the sum of the fine costs (each node runs at least once)."""
    start = time.perf_counter()
    c = coarsen(problem)
    sol = run(c.problem, budget, replace(options, mip_start=None))
    floor = float(problem.cost.sum())
    note = f"solved on {c.problem.num_nodes} coarse nodes for {problem.num_nodes}"
    if sol.schedule is None:                                    # not feasible
        return replace(sol, status="no_solution" if sol.status == "infeasible" else sol.status, bound=floor,
                       min_budget_lower_bound=None, solve_seconds=time.perf_counter() - start,
                       message=f"{note}: {sol.message}".strip(": "))
    schedule = c.expand(sol.schedule)
    cost = float(problem.cost[[s[1] for s in schedule]].sum())
    return checked_solution(problem, sol.solver, budget, schedule, status="optimal" if cost <= floor else "feasible",
                            bound=floor, solve_seconds=time.perf_counter() - start, backend=sol.backend,
                            num_variables=sol.num_variables, num_constraints=sol.num_constraints,
                            progress=sol.progress, message=f"{note}; {sol.message}".strip("; "))
