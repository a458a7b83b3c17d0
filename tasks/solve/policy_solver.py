"""`selective-policy`: the cheapest schedule within the budget that selective activation checkpointing
runs (PyTorch SAC, `torch.utils.checkpoint` with a MUST_SAVE / PREFER_RECOMPUTE policy per op;
runtime/policy/form.py says which schedules those are), so its plan trains in the user's own loop
through `runtime.apply` and the simulator's peak is what autograd then does.

Decision per region (a repeated module recorded at capture): which of its nodes it keeps, any that
allocates up to the last its backward reads (`Regions.savable`; e.g. the projections torchtitan keeps).
Candidates to recompute are ranked by predicted time per byte (the knapsack order of PyTorch's
`_activation_checkpointing` and of torchtitan's op lists, where matmuls are dearest per byte), each
decision `Regions.settled`. Three families are simulated and the cheapest within the budget returned, the
dispatch cost of the regions run with a policy counted (`runtime.policy.form.dispatch_cost`):
- `decision_ladder`: the savable nodes of all regions dropped one at a time in that order, then the
  first k regions checkpointed whole (what `module-checkpoint` does);
- `staircases`: regions alike (a transformer's layers) share one ranking of their node positions, by
  the mean time per byte over them (one profile's noise does not split them), giving levels 0 (not
  checkpointed), 1, 2, ... of the same decision in every region; every region at level i and the first
  or last k at level i + 1, or the first or last k whole: the per-layer policies torchtitan applies,
  and mixes of them across layers;
- `split_decisions`: layers split into their parts (`Regions.split`: each of a layer's children, its
  attention, its MLP, its norms, a region of its own, so one part's recomputation is not live through
  another's backward, at the cost of keeping each part's input): the first or last k layers split with
  the parts of some kinds checkpointed whole, the rest whole; every layer split, with
  `decision_ladder` over the parts; and the first or last k layers nested (`Regions.nest`: checkpointed
  whole around their parts' checkpoints, which keeps one input per layer through the forward and one
  part's recomputation in the backward, at a third forward of the parts before the last) (the plan records
  the split layers in `provenance.split`, the nested ones in `provenance.nest`).

From the cheapest of them, `improved` searches locally for the memory the families leave unused (their decisions
move in coarse steps, so the cheapest may peak well below the budget): it takes the first neighbouring decision
that fits and costs less (a region no longer checkpointed, or one more of its nodes kept) until none does, so the
answer is a local optimum of those moves. No decision's price depends on the budget: a search over budgets (a
`max_overhead` plan) prices each once (`SolveOptions.memo`), and skips the local search where the cheapest
candidate already costs at most its `enough`.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field
from typing import Iterator

from memplan.runtime.policy.form import FORM, Regions, dispatch_cost, policy_schedule
from memplan.tasks.solve.core.problem import Problem
from memplan.tasks.solve.core.simulator import simulate
from memplan.tasks.solve.core.solution import Solution, SolveOptions, checked_solution

@dataclass(frozen=True)
class PolicyOptions:
    """Options of `selective-policy`."""

    compiled: bool = field(default=False, metadata={
        "help": "the model trains under torch.compile, whose compiled graph runs the policy's decisions without "
                "selective checkpointing's dispatch modes: their cost (runtime/policy/dispatch_cost.py) is not counted."})


PART_KINDS = 4
"""Up to this many kinds of parts per layer (a transformer layer's two norms, attention and MLP),
`split_decisions` tries every subset of them."""


def decision_ladder(problem: Problem, regions: Regions) -> list[dict[str, frozenset[int]]]:
    """Candidate decisions (region -> saved nodes), from saving everything towards saving nothing: the
    savable nodes dropped one at a time, cheapest recomputation per byte first (elementwise ops before
    matmuls), each decision `Regions.settled`; then the first k regions checkpointed whole."""
    savable = regions.savable
    order = sorted(((float(problem.cost[n]) / max(int(problem.node_bytes[n]), 1), i, name, n)
                    for i, (name, nodes) in enumerate(savable.items()) for n in nodes))
    ladder, dropped = [], {name: set() for name in savable}
    for *_, name, n in order:
        dropped[name].add(n)
        ladder.append({r: regions.settled(r, set(nodes) - dropped[r]) for r, nodes in savable.items() if dropped[r]})
    names = list(savable)
    ladder += [{r: frozenset() for r in names[:k]} for k in range(1, len(names) + 1)]
    return ladder


def staircases(problem: Problem, regions: Regions) -> list[dict[str, frozenset[int]]]:
    """Candidate decisions of alike regions (module docstring): levels of one shared ranking."""
    groups: dict[int, list[str]] = {}
    for name, nodes in regions.savable.items():
        groups.setdefault(len(nodes), []).append(name)
    levels: dict[str, list[frozenset[int] | None]] = {}
    for names in groups.values():
        per_byte = [[float(problem.cost[n]) / max(int(problem.node_bytes[n]), 1) for n in regions.savable[name]]
                    for name in names]
        ranking = sorted(range(len(per_byte[0])), key=lambda i: sum(row[i] for row in per_byte))
        for name in names:
            nodes = regions.savable[name]
            levels[name] = [None, *(regions.settled(name, set(nodes) - {nodes[i] for i in ranking[:k]})
                                    for k in range(1, len(nodes) + 1))]
    names = list(regions.savable)
    ends = [(names[:k], names[k:]) for k in range(len(names) + 1)] + \
           [(names[len(names) - k:], names[:len(names) - k]) for k in range(1, len(names))]
    out = []
    for level in range(max(map(len, levels.values()))):
        for more, rest in ends:
            for deeper in ("next", "whole"):
                decision = {}
                for name in rest:
                    decision[name] = levels[name][min(level, len(levels[name]) - 1)]
                for name in more:
                    decision[name] = frozenset() if deeper == "whole" else \
                        levels[name][min(level + 1, len(levels[name]) - 1)]
                out.append({name: keep for name, keep in decision.items() if keep is not None})
    return out


def split_decisions(problem: Problem, regions: Regions) -> Iterator[tuple[Regions, dict[str, frozenset[int]]]]:
    """Candidate decisions over split layers (module docstring), each with the regions it is over: the first
    or last k layers split, the others whole, and of the split layers' parts those of some kinds checkpointed
    whole (kinds: the parts' child names; every subset of up to `PART_KINDS` kinds, else all kinds and all
    but one); then every layer split, `decision_ladder` over its parts; then the first or last k layers
    nested, each part whole."""
    names = [name for name, parts in regions.parts.items() if parts]
    kind = lambda part: part.rsplit(".", 1)[-1]  # noqa: E731  (the child's own name: "mlp", "self_attn")
    kinds = sorted({kind(part) for layer in names for part in regions.parts[layer]})
    subsets = [set(c) for k in range(1, len(kinds) + 1) for c in itertools.combinations(kinds, k)] \
        if len(kinds) <= PART_KINDS else [set(kinds), *(set(kinds) - {left_out} for left_out in kinds)]
    for split in _first_or_last(names):
        parts = regions.split(split)
        for kept in subsets:
            yield parts, {name: frozenset() for name in parts.members if parts.rerun[name]
                          and (name in regions.members or kind(name) in kept)}
    if names:
        parts = regions.split(names)
        yield from ((parts, saved) for saved in decision_ladder(problem, parts))
    for nest in _first_or_last(names):
        nested = regions.nest(nest)
        yield nested, {name: frozenset() for name in nested.members if nested.rerun[name]}


def _first_or_last(names: list[str]) -> list[tuple[str, ...]]:
    """The first k and the last k of `names`, for every k, without repeats."""
    return list(dict.fromkeys(ends for k in range(1, len(names) + 1)
                              for ends in (tuple(names[:k]), tuple(names[len(names) - k:]))))


def movable(regions: Regions, name: str) -> bool:
    """Whether `improved` may change a region's decision: not a nested module nor a part of one, whose parts are
    all checkpointed whole."""
    return name not in regions.nested_modules and regions.nested_of(name) is None


def decision_key(regions: Regions, saved: dict[str, frozenset[int]]) -> tuple:
    """A decision over `regions` as a hashable key."""
    return (regions.split_modules, regions.nested_modules,
            tuple(sorted((name, tuple(sorted(keep))) for name, keep in saved.items())))


def priced(problem: Problem, regions: Regions, saved: dict[str, frozenset[int]], per_node: tuple[float, float],
           memo: dict | None = None) -> tuple[float, float, list, int]:
    """A decision's cost (compute and the dispatch of its policies), dispatch cost, schedule and simulated peak;
    from `memo` (by `decision_key`) when priced before, as at the other budgets of a search (none depends on it)."""
    key = None if memo is None else decision_key(regions, saved)
    if key in (memo or {}):
        return memo[key]
    schedule = policy_schedule(regions, saved)
    sim = simulate(problem, schedule)
    dispatch = dispatch_cost(per_node, regions, saved)
    found = sim.compute_cost + dispatch, dispatch, schedule, sim.peak_bytes
    if memo is not None:
        memo[key] = found
    return found


def improved(problem: Problem, regions: Regions, saved: dict[str, frozenset[int]], budget: int,
             per_node: tuple[float, float], deadline: float | None = None, memo: dict | None = None
             ) -> tuple[dict[str, frozenset[int]], tuple[float, float, list, int]]:
    """A local search from a decision within `budget`, for the memory the candidate families leave unused: it moves
    to the first neighbour that fits the budget and costs less (`priced`), until no neighbour does (or `deadline`,
    a `time.perf_counter` value, passes). Neighbours: a checkpointed region no longer checkpointed; then one more
    savable node kept in a checkpointed region (`Regions.settled`), dearest recomputation per byte first. Regions of
    nested modules keep their decision (`movable`). Returns the decision and its `priced` tuple (`memo`: as there)."""
    current = priced(problem, regions, saved, per_node, memo)
    while deadline is None or time.perf_counter() < deadline:
        keep_more = sorted(((-float(problem.cost[n]) / max(int(problem.node_bytes[n]), 1), name, n)
                            for name, keep in saved.items() if movable(regions, name)
                            for n in regions.savable[name] if n not in keep))
        neighbours = itertools.chain(
            ({r: keep for r, keep in saved.items() if r != name} for name in saved if movable(regions, name)),
            ({**saved, name: more} for _, name, n in keep_more
             if (more := regions.settled(name, saved[name] | {n})) != saved[name]))
        for neighbour in neighbours:
            candidate = priced(problem, regions, neighbour, per_node, memo)
            if candidate[3] <= budget and candidate[0] < current[0]:
                saved, current = neighbour, candidate
                break
        else:
            break
    return saved, current


def selective_policy(problem: Problem, budget: int, options: SolveOptions) -> Solution:
    """The cheapest candidate schedule (module docstring) whose simulated peak fits `budget`, by its compute cost
    and, for the regions it runs with a policy, the dispatch modes' (`runtime.policy.form.dispatch_cost`), then
    `improved` by the local search within the budget (and `time_limit`)."""
    start = time.perf_counter()
    regions = Regions.of_problem(problem)
    if not regions.members:
        return Solution("selective-policy", budget, "no_solution", solve_seconds=time.perf_counter() - start,
                        message=f"{problem.name} records no module boundaries, which the policy form checkpoints "
                                f"(capture it with runtime.capture, which records them)", form=FORM)
    per_node = (0.0, 0.0) if options.params is not None and options.params.compiled else problem.policy_dispatch
    memo = None if options.memo is None else options.memo.setdefault(("selective-policy", id(problem), per_node), {})
    whole = ((regions, saved) for saved in [{}, *decision_ladder(problem, regions), *staircases(problem, regions)])
    best, seen = None, set()
    for over, saved in itertools.chain(whole, split_decisions(problem, regions)):
        if options.time_limit is not None and best is not None and time.perf_counter() - start > options.time_limit:
            break
        key = decision_key(over, saved)
        if key in seen:
            continue
        seen.add(key)
        cost, _, _, peak = priced(problem, over, saved, per_node, memo)
        if peak <= budget and (best is None or cost < best[0]):
            best = (cost, saved, over)
    if best is None:
        return Solution("selective-policy", budget, "no_solution", solve_seconds=time.perf_counter() - start,
                        message=f"no selective-checkpointing decision over {len(regions.members)} regions fits "
                                f"the budget", form=FORM)
    _, saved, over = best
    deadline = None if options.time_limit is None else start + options.time_limit
    if options.enough is not None and best[0] <= options.enough:      # enough for the caller: no local search
        cost, dispatch, schedule, _ = priced(problem, over, saved, per_node, memo)
    else:
        saved, (cost, dispatch, schedule, _) = improved(problem, over, saved, budget, per_node, deadline, memo)
    recomputed = sum(1 for step in schedule if "compute" in step) - problem.num_nodes
    split = f", {len(over.split_modules)} of them split into their parts" if over.split_modules else ""
    split += f" ({len(over.nested_modules)} also checkpointed whole around them)" if over.nested_modules else ""
    policies = sum(1 for keep in saved.values() if keep)
    return checked_solution(problem, "selective-policy", budget, schedule, solve_seconds=time.perf_counter() - start,
                            form=FORM, policy_split=tuple(sorted(over.split_modules)),
                            policy_nest=tuple(sorted(over.nested_modules)),
                            dispatch_cost=dispatch,
                            message=f"{len(saved)} regions checkpointed over {len(regions.members)} layers{split}, "
                                    f"{policies} of them with a policy, {recomputed} nodes recomputed")
