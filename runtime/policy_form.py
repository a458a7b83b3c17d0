"""The policy form of a plan (ARCHITECTURE.md, "one plan, two forms of execution"): which schedules
`torch.utils.checkpoint(use_reentrant=False, context_fn=create_selective_checkpoint_contexts(policy))`
around each region runs, and the schedule the simulator must see for them. Torch-free: solvers build
schedules with it, `runtime.policy` reads plans with it.

A region is one call of a repeated module recorded at capture (`meta["node_modules"]`). Its decision is
the set of its nodes whose outputs autograd keeps (MUST_SAVE); every other op of the region is
recomputed (PREFER_RECOMPUTE). What autograd does with that, as a schedule:

- forward: every forward and loss node once, in the default order;
- a backward node belongs to the regions whose values it reads (a region's own values first, its
  outputs, read by later forward nodes, only when it reads nothing else of a region);
- before the first backward node of a checkpointed region, the region's forward reruns from its first
  node through the last node whose output its backward reads (checkpoint's early stop), skipping the
  saved nodes: one recomputation per region, right before its backward;
- saved nodes are those whose outputs the region's backward reads (`savable`); random nodes (dropout's
  draw) and their direct readers (the in-place scaling of eager's mask) are never saved in a checkpointed
  region (`unsaved`), so a recomputation redraws every mask from the generator state checkpoint
  restores, in the same order, and writes it into a tensor of its own.

A region that saves everything `savable` is not checkpointed. `decisions(regions, schedule)` reads the
decision back from a plan's schedule and refuses (PolicyFormError) one that is not `policy_schedule` of
it.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Any, Mapping, Sequence

FORM = "policy"


class PolicyFormError(ValueError):
    """A plan whose schedule autograd with selective checkpointing cannot run."""


@dataclass(frozen=True)
class Regions:
    """What the policy form needs of a graph: node order, reads and writes, phases, region per node."""

    order: tuple[int, ...]                   # node ids in the default order
    inputs: tuple[tuple[int, ...], ...]      # per node, values read
    outputs: tuple[tuple[int, ...], ...]     # per node, values written
    backward: frozenset[int]
    region_of: tuple[str | None, ...]        # per node, the recorded module (forward nodes only)
    random: frozenset[int]

    @classmethod
    def of_problem(cls, problem: Any) -> "Regions":
        """From a `tasks.solve.core.problem.Problem`."""
        n = len(problem.node_inputs)
        return cls(tuple(int(v) for v in problem.order), tuple(problem.node_inputs), tuple(problem.node_outputs),
                   frozenset(i for i, p in enumerate(problem.phase) if p == "backward"),
                   tuple(problem.node_modules) or (None,) * n, frozenset(problem.random_nodes))

    @classmethod
    def of_graph(cls, graph: Any) -> "Regions":
        """From a captured `runtime.graph.OpGraph` (its nodes are in the default order)."""
        n = len(graph.nodes)
        random = getattr(graph.program, "random_devices", {}) or {}
        return cls(tuple(range(n)), tuple(x.inputs for x in graph.nodes), tuple(x.outputs for x in graph.nodes),
                   frozenset(x.id for x in graph.nodes if x.phase == "backward"),
                   tuple(graph.meta.get("node_modules") or (None,) * n), frozenset(int(k) for k in random))

    @cached_property
    def members(self) -> dict[str, list[int]]:
        """Forward nodes of each region, in order."""
        out: dict[str, list[int]] = {}
        for node in self.order:
            name = self.region_of[node]
            if name is not None and node not in self.backward:
                out.setdefault(name, []).append(node)
        return out

    @cached_property
    def _producer_region(self) -> dict[int, str]:
        return {v: name for name, nodes in self.members.items() for node in nodes for v in self.outputs[node]}

    @cached_property
    def region_outputs(self) -> set[int]:
        """Values made in a region and read by a forward node outside it."""
        made = self._producer_region
        return {v for node in self.order if node not in self.backward for v in self.inputs[node]
                if v in made and made[v] != self.region_of[node]}

    @cached_property
    def owners(self) -> dict[int, set[str]]:
        """Backward node -> the regions it belongs to (module docstring)."""
        made, outs = self._producer_region, self.region_outputs
        owners: dict[int, set[str]] = {}
        for node in self.backward:
            own = {made[v] for v in self.inputs[node] if v in made and v not in outs}
            owners[node] = own or {made[v] for v in self.inputs[node] if v in made}
        return owners

    @cached_property
    def savable(self) -> dict[str, list[int]]:
        """Per region, its nodes whose outputs its own backward reads, in order: the nodes a decision may save."""
        read: dict[str, set[int]] = {}
        for node, regions in self.owners.items():
            for name in regions:
                read.setdefault(name, set()).update(self.inputs[node])
        return {name: [n for n in nodes if read.get(name, set()) & set(self.outputs[n])]
                for name, nodes in self.members.items()}

    @cached_property
    def unsaved(self) -> frozenset[int]:
        """Nodes no checkpointed region saves: random nodes and the nodes reading their outputs."""
        drawn = {v for n in self.random for v in self.outputs[n]}
        return self.random | {n for n in range(len(self.inputs)) if drawn & set(self.inputs[n])}

    def trigger(self, name: str) -> int | None:
        """The first backward node of region `name` (where its recomputation runs), or None."""
        return next((n for n in self.order if n in self.backward and name in self.owners[n]), None)

    def recomputed(self, name: str, saved: Sequence[int] | frozenset[int]) -> list[int]:
        """The nodes region `name` reruns before its backward when it saves `saved`."""
        savable = self.savable[name]
        if not savable:
            return []
        nodes = self.members[name]
        last = nodes.index(savable[-1])
        return [n for n in nodes[:last + 1] if n not in saved]


def policy_schedule(regions: Regions, saved: Mapping[str, Sequence[int] | frozenset[int]]) -> list[dict[str, int]]:
    """The schedule autograd runs when each region `name` in `saved` is checkpointed saving `saved[name]`
    (a subset of `regions.savable[name]` outside `regions.unsaved`); regions not in `saved` are not
    checkpointed."""
    for name, keep in saved.items():
        if name not in regions.members:
            raise PolicyFormError(f"region {name!r} is not a recorded module of this graph "
                                  f"({', '.join(regions.members) or 'none recorded'}).")
        bad = set(keep) - set(regions.savable[name]) | (set(keep) & regions.unsaved)
        if bad:
            raise PolicyFormError(f"region {name!r} cannot save nodes {sorted(bad)[:5]}: only nodes whose outputs its "
                                  f"backward reads may be saved, and never a random node or a direct reader of one "
                                  f"(a recomputation redraws them all).")
    before: dict[int, list[int]] = {}
    for name, keep in saved.items():
        trigger, rerun = regions.trigger(name), regions.recomputed(name, frozenset(keep))
        if trigger is not None and rerun:
            before.setdefault(trigger, []).extend(rerun)
    steps: list[dict[str, int]] = []
    for node in regions.order:
        steps.extend({"compute": n} for n in before.get(node, ()))
        steps.append({"compute": node})
    return steps


def decisions(regions: Regions, schedule: Sequence[Mapping[str, Any]]) -> dict[str, frozenset[int]]:
    """The saved nodes of each checkpointed region of a plan's schedule; PolicyFormError when the schedule
    is not the `policy_schedule` of what it recomputes (frees aside, which the simulator implies)."""
    computes = [int(s["compute"]) for s in schedule if "compute" in s]
    if any(s.get("impl") not in (None, "default") for s in schedule if "compute" in s):
        raise PolicyFormError("the plan runs implementation variants (impl), which eager PyTorch under "
                              "torch.utils.checkpoint cannot: only the executor form (runtime.load) runs them. "
                              "Solve with variants off, or use runtime.load.")
    again = {n for i, n in enumerate(computes) if n in computes[:i]}
    outside = sorted(n for n in again if n in regions.backward or regions.region_of[n] is None)
    if outside:
        raise PolicyFormError(f"the plan recomputes nodes {outside[:5]} outside every recorded module (or backward "
                              f"nodes); the policy form recomputes only within the regions checkpoint wraps "
                              f"({', '.join(regions.members) or 'none recorded'}). Solve with the policy form "
                              f"(solver 'selective-policy'), or run the plan with runtime.load.")
    saved = {name: frozenset(n for n in regions.savable[name] if n not in again)
             for name, nodes in regions.members.items() if again & set(nodes)}
    expected = [int(s["compute"]) for s in policy_schedule(regions, saved)]
    if computes != expected:
        i = next((i for i, (a, b) in enumerate(zip(computes, expected)) if a != b), min(len(computes), len(expected)))
        got = computes[i] if i < len(computes) else "the end"
        want = expected[i] if i < len(expected) else "the end"
        raise PolicyFormError(f"the plan's schedule is not one selective checkpointing can run: its compute step {i} "
                              f"is node {got} where the policy form runs node {want} (it recomputes each region "
                              f"once, right before the region's backward, from the region's start through the "
                              f"last value its backward reads, and keeps a value from the forward only if that "
                              f"backward reads it). Solve with solver 'selective-policy', or run the plan with "
                              f"runtime.load.")
    return saved
