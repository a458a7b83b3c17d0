"""Implementation variants chosen greedily, family by family, so that a recompute-only solver can use them.

MONeT (Gupta et al. 2021, sec. 4) chooses every operator's implementation jointly with the checkpoints;
its program is exact but large. The cheap alternative here fixes one implementation per node first and
then plans recomputation on the result with a recompute-only solver (`dtr`):

- a **family** is a variant name (`mask`, `bitmask`, `output`, `compact`, ...); fixing it runs that
  variant on every node offering it, so a forward node and the backward node reading what it keeps
  (the ReLU that makes the mask and the backward that reads it) switch together. A node whose fixed
  variant reads a value no fixed implementation makes falls back to its default, until none does;
- a family is **memory-saving** when fixing it alone lowers the peak of the checkpoint-all schedule
  (every node once, default order): it keeps fewer bytes for the backward pass;
- a family is **time-saving** when its variants read and allocate the values their defaults do, with no
  more workspace, and its nodes, as profiled, cost at least `TIME_SAVING` less together than their
  defaults (the fused GELU's tanh by its sigmoid identity): every schedule then holds the same memory and
  costs less, so every candidate fixes it;
- a variant is **node-local** when it reads and allocates its default's values, not in place (the tanh's
  sigmoid identity, a convolution's weight gradient by ATen's native kernel): it can be fixed node by
  node, and it is **lean** on the nodes where it needs less workspace than its default (the native weight
  gradient on resnet18's last stage, not on its first, where its im2col buffer is the larger);
- the candidate choices are the time-saving families alone, and with every memory-saving family
  together, once with each of the families that compete for the same nodes (`mask` or `bitmask` on one
  ReLU) in turn; then, where some node offers a lean variant, the first choice with the leanest variant of
  each such node fixed (the solver prices its time against the recomputation it saves).

`fixed_problem` turns a choice into a problem without variants whose per-node arrays are the chosen
implementations (value ids unchanged: the values no chosen implementation makes, such as the int64
indices a compact max-pool replaces, keep their ids with no bytes and no producer), so any recompute-only solver plans on it; `tag_schedule` names the chosen
implementation on each compute step, and the simulator checks the schedule on the original problem.
"""

from __future__ import annotations

from dataclasses import replace
from itertools import product

import numpy as np

from memplan.tasks.solve.core.problem import Problem
from memplan.tasks.solve.core.simulator import default_schedule, simulate

Choice = dict[int, str]
"""Node -> the name of its fixed non-default implementation (nodes left out run their default)."""

TIME_SAVING = 0.05
"""The least relative saving of a time-saving family: profiled times of one op move a few percent between
runs, and a variant that is not bit-identical to its default is worth fixing only for a clear gain."""


def fixed_problem(problem: Problem, choice: Choice) -> Problem:
    """`problem` with node i's default replaced by its implementation `choice[i]`, and no variants."""
    impl = [problem.variant(node, choice.get(node)) for node in range(problem.num_nodes)]
    made = np.zeros(problem.num_values, dtype=bool)
    for v in impl:
        made[list(v.outputs)] = True
    orphan = (problem.value_producer >= 0) & ~made            # made by no chosen implementation
    return replace(problem, cost=np.array([v.cost for v in impl]),
                   workspace=np.array([v.workspace for v in impl], dtype=np.int64),
                   node_inputs=tuple(v.inputs for v in impl), node_outputs=tuple(v.outputs for v in impl),
                   value_bytes=np.where(orphan, 0, problem.value_bytes),
                   value_producer=np.where(orphan, -1, problem.value_producer), variants=(), num_variant_values=0)


def tag_schedule(schedule: list, choice: Choice) -> list:
    """The schedule with each compute step of a node in `choice` running that implementation."""
    return [("compute", s[1], choice[s[1]]) if s[0] == "compute" and s[1] in choice else s for s in schedule]


def family_choice(problem: Problem, families: tuple[str, ...]) -> Choice:
    """Each node offering one of `families` runs the first it offers (never an in-place one, which a problem
    without variants cannot state); a node reading a value that no chosen
    implementation makes falls back to its default (or, running its default already, the producers it
    reads do: a compact max-pool whose backward keeps the default), until every read is made."""
    choice = {node: names[0] for node in range(problem.num_nodes)
              for names in [[f for f in families if f in problem.impls(node)
                             and not problem.variant(node, f).overwrites]] if names}
    while True:
        made: set[int] = set()
        for node in range(problem.num_nodes):
            made.update(problem.variant(node, choice.get(node)).outputs)
        broken = [node for node in range(problem.num_nodes)
                  if any(problem.value_producer[v] >= 0 and v not in made
                         for v in problem.variant(node, choice.get(node)).inputs)]
        if not broken:
            return choice
        for node in broken:                   # its own variant, or the variant of the producer it reads
            if node in choice:
                del choice[node]
            else:
                for v in problem.node_inputs[node]:
                    choice.pop(int(problem.value_producer[v]), None)


def _time_saving(problem: Problem, choice: Choice) -> bool:
    """Whether `choice` runs only variants reading and allocating their defaults' values, with no more workspace,
    that cost at least `TIME_SAVING` less together than the defaults (module docstring)."""
    chosen = [(n, problem.variant(n, impl)) for n, impl in choice.items()]
    same = all(set(v.inputs) == set(problem.node_inputs[n]) and tuple(v.outputs) == tuple(problem.node_outputs[n])
               and not v.overwrites and v.workspace <= problem.workspace[n] for n, v in chosen)
    return same and sum(v.cost for _, v in chosen) <= (1 - TIME_SAVING) * sum(problem.cost[n] for n, _ in chosen)


def lean_choice(problem: Problem) -> Choice:
    """Each node offering a lean node-local variant (module docstring) runs the one needing least workspace."""
    choice: Choice = {}
    for node in range(problem.num_nodes):
        reads, makes = set(problem.node_inputs[node]), tuple(problem.node_outputs[node])
        lean = [v for v in (problem.variants[node] if problem.has_variants else ())
                if set(v.inputs) == reads and tuple(v.outputs) == makes and not v.overwrites
                and v.workspace < problem.workspace[node]]
        if lean:
            choice[node] = min(lean, key=lambda v: v.workspace).name
    return choice


def candidate_choices(problem: Problem) -> list[Choice]:
    """The time-saving families alone, then with every memory-saving family together, one alternative per
    combination of the memory-saving families competing for the same nodes, then the first with the lean
    variants (module docstring); duplicates removed (without time-saving families the first choice is no
    variants)."""
    if not problem.has_variants:
        return [{}]
    schedule = default_schedule(problem)
    full = simulate(problem, schedule).peak_bytes
    names = sorted({v.name for offered in problem.variants for v in offered})
    saving, timed = [], []
    for name in names:
        choice = family_choice(problem, (name,))
        if not choice:
            continue
        if _time_saving(problem, choice):
            timed.append(name)
        elif simulate(problem, tag_schedule(schedule, choice)).peak_bytes < full:
            saving.append((name, frozenset(choice)))
    groups: list[list[str]] = []                              # families sharing nodes compete
    for name, nodes in saving:
        group = next((g for g in groups if any(nodes & dict(saving)[other] for other in g)), None)
        if group is None:
            groups.append([name])
        else:
            group.append(name)
    found: list[Choice] = [family_choice(problem, tuple(timed))]
    for firsts in product(*groups):
        order = (*firsts, *(n for g in groups for n in g if n not in firsts), *timed)
        choice = family_choice(problem, order)
        if choice not in found:
            found.append(choice)
    lean = lean_choice(problem)
    if lean and {**found[0], **lean} not in found:
        found.append({**found[0], **lean})
    return found


__all__ = ["TIME_SAVING", "Choice", "candidate_choices", "family_choice", "fixed_problem", "lean_choice",
           "tag_schedule"]
