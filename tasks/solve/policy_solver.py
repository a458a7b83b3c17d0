"""`selective-policy`: the cheapest schedule within the budget that selective activation checkpointing
runs (PyTorch SAC, `torch.utils.checkpoint` with a MUST_SAVE / PREFER_RECOMPUTE policy per op;
runtime/policy_form.py says which schedules those are), so its plan trains in the user's own loop
through `runtime.apply` and the simulator's peak is what autograd then does.

Decision per region (a repeated module recorded at capture): which of its nodes it keeps, any that
allocates up to the last its backward reads (`Regions.savable`; e.g. the projections torchtitan keeps).
Candidates to recompute are those nodes ranked by predicted time per byte (the knapsack order of
PyTorch's `_activation_checkpointing` and of torchtitan's op lists, where matmuls are dearest per byte);
every prefix of that ranking, and checkpointing the first k regions whole (what `module-checkpoint`
does), is simulated, and the cheapest within the budget is returned.
"""

from __future__ import annotations

import time

from runtime.policy_form import FORM, Regions, policy_schedule
from tasks.solve.core.problem import Problem
from tasks.solve.core.simulator import simulate
from tasks.solve.core.solution import Solution, SolveOptions, checked_solution


def decision_ladder(problem: Problem, regions: Regions) -> list[dict[str, frozenset[int]]]:
    """Candidate decisions (region -> saved nodes), from saving everything towards saving nothing: the
    savable nodes dropped one at a time, cheapest recomputation per byte first (elementwise ops before
    matmuls), each decision `Regions.settled`; then the first k regions checkpointed whole."""
    savable = regions.savable
    order = sorted(((float(problem.cost[n]) / max(int(problem.node_bytes[n]), 1), i, name, n)
                    for i, (name, nodes) in enumerate(savable.items()) for n in nodes))
    ladder, seen, dropped = [], set(), {name: set() for name in savable}
    for *_, name, n in order:
        dropped[name].add(n)
        decision = {r: regions.settled(r, set(nodes) - dropped[r]) for r, nodes in savable.items() if dropped[r]}
        key = tuple(sorted((r, tuple(sorted(keep))) for r, keep in decision.items()))
        if key not in seen:
            seen.add(key)
            ladder.append(decision)
    names = list(savable)
    ladder += [{r: frozenset() for r in names[:k]} for k in range(1, len(names) + 1)]
    return ladder


def selective_policy(problem: Problem, budget: int, options: SolveOptions) -> Solution:
    """The cheapest `decision_ladder` schedule whose simulated peak fits `budget` (module docstring)."""
    start = time.perf_counter()
    regions = Regions.of_problem(problem)
    if not regions.members:
        return Solution("selective-policy", budget, "no_solution", solve_seconds=time.perf_counter() - start,
                        message=f"{problem.name} records no module boundaries, which the policy form checkpoints "
                                f"(capture it with runtime.capture, which records them)", form=FORM)
    best = None
    for saved in [{}, *decision_ladder(problem, regions)]:
        if options.time_limit is not None and best is not None and time.perf_counter() - start > options.time_limit:
            break
        schedule = policy_schedule(regions, saved)
        sim = simulate(problem, schedule)
        if sim.peak_bytes <= budget and (best is None or sim.compute_cost < best[1].compute_cost):
            best = (schedule, sim, saved)
    if best is None:
        return Solution("selective-policy", budget, "no_solution", solve_seconds=time.perf_counter() - start,
                        message=f"no selective-checkpointing decision over {len(regions.members)} regions fits "
                                f"the budget", form=FORM)
    recomputed = sum(len(regions.recomputed(name, keep)) for name, keep in best[2].items())
    return checked_solution(problem, "selective-policy", budget, best[0], solve_seconds=time.perf_counter() - start,
                            form=FORM, message=f"{len(best[2])} of {len(regions.members)} regions checkpointed, "
                                                   f"{recomputed} nodes recomputed")
