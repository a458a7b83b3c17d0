"""What every solver takes and returns: `SolveOptions` in, a `Solution` (checked by the simulator) out,
and its conversion to a runtime plan (docs/plan-format.md) and to the solve report."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Annotated, Any, Callable, Mapping

import numpy as np
from pydantic import Field, TypeAdapter, ValidationError

from memplan.runtime.format.plan import Plan, memplan_version, normalize_step
from memplan.tasks.solve.core.milp import Progress, relative_gap
from memplan.tasks.solve.core.problem import Problem
from memplan.tasks.solve.core.simulator import Simulation, simulate


DEFAULT_BACKEND = "auto"
DEFAULT_GAP = 0.01
DEFAULT_TIME_LIMIT_S = 300.0
"""The one set of solve defaults: `SolveOptions`, `[[plans]]` in pipeline.toml and `memplan solve`."""

TimeLimit = Annotated[float, Field(gt=0, allow_inf_nan=False)]
Gap = Annotated[float, Field(ge=0, lt=1, allow_inf_nan=False)]
Threads = Annotated[int, Field(ge=1)]
"""The one set of rules for the solve values a user gives, shared by `memplan solve` and pipeline.toml: a
finite positive time limit in seconds, a relative MIP gap in [0, 1), at least one thread. (Solvers pass
themselves `time_limit=0` when no time is left.)"""


def check_solve_value(rule: Any, value: Any) -> Any:
    """`value` checked against `rule` (TimeLimit, Gap, Threads); ValueError naming the value and the rule."""
    try:
        return TypeAdapter(rule).validate_python(value)
    except ValidationError as exc:
        raise ValueError(f"{value!r} is refused: {exc.errors()[0]['msg'].lower()}.") from None


@dataclass
class SolveOptions:
    """`time_limit` (seconds; None: none), relative `gap` and `threads` bound the MILP solvers; `backend`
    picks the MILP backend ("auto": Gurobi when the license present covers the model, else HiGHS;
    "highs"; "gurobi"); `mip_start` is a schedule to start from; `params` holds the solver's own typed
    options (its options dataclass, or a mapping the registry checks against it; see
    `tasks.solve.SOLVERS[name].options`). `portfolio`: a MILP/LP solver also returns no schedule worse
    than the cheap solvers' at the same budget (tasks.solve.core.portfolio; False tests the solver alone).
    `peers`: the solvers (by name) this one may call for a warm start or a block, passed in by the registry
    (`SolverSpec.peers`), so that no solver imports another. A search solving one problem at many budgets (a
    `max_overhead` plan, `tasks.solve_stage.overhead_ladder`) may pass `cost_limit` (no schedule costing more is
    wanted: a solver may drop one, and stop building it), `enough` (the first schedule within the budget costing at
    most this will do: a solver may stop there rather than look for the cheapest) and `memo`, one dict for all its
    solves, where a solver may keep what does not depend on the budget or what it learned at other budgets (under
    keys naming itself and the problem). Solvers may ignore all three."""

    time_limit: float | None = DEFAULT_TIME_LIMIT_S
    gap: float = DEFAULT_GAP
    backend: str = DEFAULT_BACKEND
    threads: int | None = None
    mip_start: list | None = None
    params: Any = None
    portfolio: bool = True
    peers: Mapping[str, Callable[..., Any]] = field(default_factory=dict)
    cost_limit: float | None = None
    enough: float | None = None
    memo: dict | None = None


@dataclass
class Solution:
    """A solver's answer for one budget. `status`: "optimal" (proved, MILP), "feasible" (a schedule
    within the budget, optimality not proved), "infeasible" (proved: no schedule the solver considers
    fits; `min_budget_lower_bound` is a lower bound on the smallest feasible budget), "no_solution"
    (time limit or heuristic failure without a schedule within budget). `objective` is the schedule's
    total compute cost, `bound` a lower bound on the optimal cost. Schedule steps are
    `("compute", node[, impl])` / `("free", value)`; `addresses` (optional) maps a value copy (step
    computing it, value) to its arena offset, and `simulation` then carries the arena size. `source`
    names the solver whose schedule this is when it is not `solver` itself (tasks.solve.core.portfolio)."""

    solver: str
    budget_bytes: int
    status: str
    schedule: list[tuple] | None = None
    simulation: Simulation | None = None
    addresses: dict[tuple[int, int], int] | None = None
    bound: float | None = None
    solve_seconds: float = 0.0
    backend: str | None = None
    num_variables: int | None = None
    num_constraints: int | None = None
    min_budget_lower_bound: int | None = None
    progress: list[Progress] = field(default_factory=list)
    message: str = ""
    source: str | None = None
    form: str = "executor"          # "policy": runtime.apply runs it too (provenance["form"], runtime/policy/form.py)
    policy_split: tuple[str, ...] = ()  # the policy form's layers checkpointed by their parts (provenance["split"])
    policy_nest: tuple[str, ...] = ()   # ... and of those, the ones also checkpointed whole (provenance["nest"])
    dispatch_cost: float = 0.0          # the policy form's dispatch modes (runtime.policy.form.dispatch_cost)

    @property
    def feasible(self) -> bool:
        return self.schedule is not None

    @property
    def objective(self) -> float | None:
        return None if self.simulation is None else self.simulation.compute_cost + self.dispatch_cost

    @property
    def predicted_peak_bytes(self) -> int | None:
        return None if self.simulation is None else self.simulation.peak_bytes

    @property
    def gap(self) -> float | None:
        return relative_gap(self.objective, self.bound)

    def report(self) -> dict[str, Any]:
        """The solve report (the JSON object `memplan solve --json` prints)."""
        return {
            "solver": self.solver,
            "budget_bytes": self.budget_bytes,
            "feasible": self.feasible,
            "status": self.status,
            "objective": self.objective,
            "predicted_peak_bytes": self.predicted_peak_bytes,
            "arena_bytes": None if self.simulation is None else self.simulation.arena_bytes,
            "bound": self.bound,
            "gap": self.gap,
            "solve_seconds": round(self.solve_seconds, 3),
            "backend": self.backend,
            "source": self.source or self.solver,
            "num_variables": self.num_variables,
            "num_constraints": self.num_constraints,
            "min_budget_lower_bound": self.min_budget_lower_bound,
            "message": self.message,
        }

    def to_plan(self, problem: Problem, *, device: str | None = None, profile_run_id: str | None = None) -> Plan:
        """The runtime plan of this solution (docs/plan-format.md). Every prediction is the simulator's, and
        the policy form's `dispatch_cost`; `time_ms` is their sum when the problem's costs are profiled
        milliseconds, else null."""
        if self.schedule is None or self.simulation is None:
            raise ValueError(f"solver {self.solver} found no schedule within {self.budget_bytes} bytes "
                             f"(status {self.status}); there is no plan to write.")
        sim = self.simulation
        predicted = {"peak_bytes": sim.peak_bytes, "constant_bytes": sim.constant_bytes,
                     "compute_cost": sim.compute_cost,
                     "time_ms": self.objective if problem.cost_unit == "ms" else None,
                     **({"dispatch_cost": self.dispatch_cost} if self.dispatch_cost else {})}
        if self.addresses is not None:
            predicted["arena_bytes"] = sim.arena_bytes
        if problem.updates:
            predicted["optimizer_state_bytes"] = problem.optimizer_state_bytes
        return Plan(
            fingerprint=problem.fingerprint or f"benchmark:{problem.name}",
            schedule=_keeping_updated_gradients(problem, self.schedule, self.addresses),
            addresses=self.addresses,
            predicted=predicted,
            provenance={"solver": self.solver, "schedule_from": self.source or self.solver,
                        "budget_bytes": self.budget_bytes, "backend": self.backend,
                        "gap": self.gap, "profile_run_id": profile_run_id, "device": device,
                        "created_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                        "memplan_version": memplan_version(),
                        **({"form": self.form} if self.form != "executor" else {}),
                        **({"split": list(self.policy_split)} if self.policy_split else {}),
                        **({"nest": list(self.policy_nest)} if self.policy_nest else {})},
        )


def _keeping_updated_gradients(problem: Problem, schedule: list, addresses: Mapping | None) -> list:
    """The schedule without frees of the gradients the optimizer updates inside the step: the runtime's graph
    keeps them as outputs (its program frees each at its update), and a free changes no simulated lifetime."""
    grads = {g for u in problem.updates for g in u.grads}
    if not grads:
        return list(schedule)
    if addresses:
        raise ValueError("a plan with the optimizer inside the step cannot carry arena addresses yet (the runtime's "
                         "graph keeps the gradients as outputs, which no address may place); plan it with "
                         "addresses = 'none'.")
    return [step for step in schedule if normalize_step(step).get("free") not in grads]


def checked_solution(problem: Problem, solver: str, budget: int, schedule: list | None,
                     addresses: dict[tuple[int, int], int] | None = None, **kw: Any) -> Solution:
    """A Solution whose schedule (and addresses, when given) has been run through the simulator; a
    schedule above the budget is dropped (status "no_solution", the message gives its peak)."""
    if schedule is None:
        kw.pop("status", None)
        return Solution(solver, budget, "no_solution", **kw)
    sim = simulate(problem, schedule, addresses)
    if sim.peak_bytes > budget:
        kw["message"] = (kw.get("message", "") + f" schedule peak {sim.peak_bytes} exceeds the budget {budget}").strip()
        kw.pop("status", None)
        return Solution(solver, budget, "no_solution", **kw)
    return Solution(solver, budget, kw.pop("status", "feasible"), schedule, sim, addresses, **kw)


def min_budget_lower_bound(problem: Problem) -> int:
    """A budget below which no schedule exists: every compute step holds the node's internal inputs,
    outputs and workspace (under its leanest implementation variant; an in-place output counted once with
    its input), the last step holds every graph output, and with the optimizer inside the step each update
    holds its gradients and its workspace."""
    internal = problem.value_producer >= 0

    def held(v) -> int:      # an in-place output shares its input's bytes
        return int(problem.value_bytes[[x for x in v.inputs if internal[x]]].sum()
                   + problem.value_bytes[list(v.outputs)].sum()
                   - problem.value_bytes[[o for o, _ in v.overwrites]].sum()) + int(v.workspace)

    per_node = np.array([min(held(problem.variant(node, impl)) for impl in problem.impls(node))
                         for node in range(problem.num_nodes)], dtype=np.int64)
    outputs = int(problem.value_bytes[list(set(problem.outputs))].sum())
    updates = max((int(problem.value_bytes[list(u.grads)].sum()) + u.largest_workspace for u in problem.updates),
                  default=0)
    return int(max(per_node.max(initial=0), outputs, updates))
