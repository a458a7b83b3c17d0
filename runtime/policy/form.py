"""The policy form of a plan (docs/training.md: one plan, two forms of execution): which schedules
`torch.utils.checkpoint(use_reentrant=False, context_fn=create_selective_checkpoint_contexts(policy))`
around each region runs, and the schedule the simulator must see for them. Torch-free: solvers build
schedules with it, `runtime.policy.apply` reads plans with it.

A region is one call of a repeated module recorded at capture (`meta["node_modules"]`), or, for a layer
the decision splits (`Regions.split`; plans record them in `provenance.split`), one call of a child of it
(`meta["node_parts"]`: its attention, its MLP), the layer's own ops between them (residual adds) then
being in no region. Its decision is the set of its nodes whose outputs autograd keeps (MUST_SAVE); every
other op of the region is recomputed (PREFER_RECOMPUTE). What autograd does with that, as a schedule:

- forward: every forward and loss node once, in the default order;
- a backward node belongs to the regions whose own values it reads (not their outputs, which later
  forward nodes read: the next region's checkpoint holds those as its input, and the backward of a
  node reading one is that region's);
- before the first backward node of a checkpointed region (the first op of the autograd Node running it,
  which unpacks its saved tensors as it starts), the region's forward reruns from its first
  node through the last node whose output its backward reads (checkpoint's early stop: the `rerun`
  range), skipping the saved nodes, whose outputs the forward's cache supplies: one recomputation per
  region, right before its backward;
- a decision may save any node of the rerun range that allocates (`savable`), e.g. a projection that only
  recomputed ops read, as torchtitan's op lists do; random nodes (dropout's draw), their direct readers
  (the in-place scaling of eager's mask) and the buffers only they read (the mask eager's `bernoulli_`
  fills) are never saved (`unsaved`), so a recomputation redraws every mask from the generator state
  checkpoint restores, in the same order, and writes it into a tensor of its own;
- a saved node must be read by the region's backward or by a node it recomputes (`idle_saves`): the
  checkpoint cache holds a saved output until the recomputation reaches its op, which a schedule, whose
  values die at their last read, cannot express for a value nobody reads then. `settled` drops such
  saves (their nodes are then recomputed, as autograd would run them);
- a nested module (`Regions.nest`: a split layer checkpointed whole as well, around its parts' checkpoints,
  all whole; PyTorch's nested non-reentrant checkpoints) keeps only what it was called with through the
  forward; before its first backward node it reruns from its first node to its last part's entry
  (`outer_rerun`: the parts it passes run their forward and keep nothing), then each part reruns before
  its own backward, so the parts before the last are computed three times; a part's arguments come from
  that rerun (`runtime.policy.apply` passes every tensor positionally, so checkpoint saves them where the
  enclosing checkpoint recomputes them), so only the module's own frame holds values;
- a checkpointed region's frame keeps the values the region was called with (`frame_inputs`: made outside
  it, read by its forward; Llama's attention mask, made once and passed to every layer) until the last
  autograd Node holding a tensor saved under the region has run (`frame_ends`); the schedule marks that
  node's step with `"holds"` (docs/plan-format.md), so the simulator keeps them live through it.

The simulator frees a value after the last op that reads it; autograd holds a saved tensor until the
whole backward node of its forward op has run, and where that node is several ops of the graph (sin's
backward: cos, then mul) a value lives one op longer than predicted, so the measured peak can exceed the
prediction by such a tensor. One-op backwards (GELU's, a matmul's, layer norm's) are exact.

A region with a policy (a decision saving some of its nodes) runs its forward and its recomputation under
selective checkpointing's dispatch modes, which add a cost per op no node's profile holds; `dispatch_cost`
prices it from the profile's measurement (runtime/policy/dispatch_cost.py). A region recomputed whole runs as plain
`torch.utils.checkpoint` and pays none.

`decisions(regions, schedule)` reads the decision back from a plan's schedule and refuses
(PolicyFormError) one that is not `policy_schedule` of it.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import cached_property
from typing import Any, Iterable, Mapping, Sequence

from memplan.runtime.format.forms import POLICY as FORM  # noqa: F401  (the policy form's name)


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
    allocating: frozenset[int]               # nodes whose outputs take bytes (views take none)
    autograd: tuple[int | None, ...] = ()    # per node, its autograd Node's label (runtime/tracing/autograd_nodes.py)
    part_of: tuple[str | None, ...] = ()     # per node, the recorded child of its module (forward nodes only)
    split_modules: frozenset[str] = frozenset()  # the recorded modules whose parts are the regions instead
    nested_modules: frozenset[str] = frozenset()  # split modules also checkpointed whole around their parts

    @classmethod
    def of_problem(cls, problem: Any, split: Iterable[str] = (), nest: Iterable[str] = ()) -> "Regions":
        """From a `tasks.solve.core.problem.Problem`, with the recorded modules in `split` split into their
        parts (`Regions.split`) and those in `nest` nested (`Regions.nest`)."""
        n = len(problem.node_inputs)
        return cls(tuple(int(v) for v in problem.order), tuple(problem.node_inputs), tuple(problem.node_outputs),
                   frozenset(i for i, p in enumerate(problem.phase) if p == "backward"),
                   tuple(problem.node_modules) or (None,) * n, frozenset(problem.random_nodes),
                   frozenset(i for i, b in enumerate(problem.node_bytes) if b > 0), tuple(problem.autograd_nodes),
                   tuple(problem.node_parts) or (None,) * n).split(split).nest(nest)

    @classmethod
    def of_graph(cls, graph: Any, split: Iterable[str] = (), nest: Iterable[str] = ()) -> "Regions":
        """From a captured `runtime.format.graph.OpGraph` (its nodes are in the default order), reading as
        `Problem.from_graph` does (`held_reads`), with the recorded modules in `split` split into their parts
        (`Regions.split`) and those in `nest` nested (`Regions.nest`)."""
        n = len(graph.nodes)
        reads = held_reads([x.phase for x in graph.nodes], [x.inputs for x in graph.nodes],
                           [x.outputs for x in graph.nodes], graph.meta.get("autograd_nodes") or [None] * n)
        return cls(tuple(range(n)), tuple(reads), tuple(x.outputs for x in graph.nodes),
                   frozenset(x.id for x in graph.nodes if x.phase == "backward"),
                   tuple(graph.meta.get("node_modules") or (None,) * n), frozenset(graph.recorded_random_nodes()),
                   frozenset(x.id for x in graph.nodes if sum(graph.values[v].bytes for v in x.outputs) > 0),
                   tuple(graph.meta.get("autograd_nodes") or ()),
                   tuple(graph.meta.get("node_parts") or (None,) * n)).split(split).nest(nest)

    @cached_property
    def parts(self) -> dict[str, list[str]]:
        """Per recorded module not split, its recorded children that compute something, in order."""
        out: dict[str, list[str]] = {}
        for name, nodes in self.members.items():
            if name not in self.split_modules:
                out[name] = list(dict.fromkeys(self.part_of[n] for n in nodes if self.part_of and self.part_of[n]))
        return out

    def split(self, modules: Iterable[str]) -> "Regions":
        """These regions with each of `modules` (recorded modules) replaced by its parts (`parts`): a region
        per part, and the module's nodes outside every part in none (autograd keeps what they save)."""
        modules = frozenset(modules) - self.split_modules
        unknown = sorted(name for name in modules if not self.parts.get(name))
        if unknown:
            splittable = [name for name, parts in self.parts.items() if parts]
            raise PolicyFormError(f"cannot split {unknown[:3]} into parts: the graph records no parts of them "
                                  f"(modules with recorded parts: {', '.join(splittable[:6]) or 'none'}). A graph "
                                  f"captured before memplan recorded parts has none: capture it again.")
        return replace(self, split_modules=self.split_modules | modules) if modules else self

    def nest(self, modules: Iterable[str]) -> "Regions":
        """These regions with each of `modules` split (`split`) and nested: checkpointed whole as well, around
        the checkpoints of its parts (PyTorch's nested non-reentrant checkpoints; `outer_rerun`)."""
        modules = frozenset(modules)
        if not modules:
            return self
        split = self.split(modules - self.split_modules)
        return replace(split, nested_modules=self.nested_modules | modules)

    @cached_property
    def whole(self) -> "Regions":
        """These regions with no module split or nested."""
        return replace(self, split_modules=frozenset(), nested_modules=frozenset())

    def nested_of(self, region: str) -> str | None:
        """The nested module whose part `region` is, or None."""
        module = self.region_of[self.members[region][0]] if region in self.members else None
        return module if module in self.nested_modules else None

    def outer_rerun(self, name: str, inner: Iterable[str]) -> list[int]:
        """The nodes nested module `name`'s own checkpoint reruns when its parts `inner` are checkpointed
        inside it (whole): from its first node until it has recomputed every tensor it saved in the
        forward (checkpoint's early stop), which are each inner part's arguments (saved as it is entered:
        the rerun ends before the last inner part) and what the module's other ops save (the values read by
        a backward node of no inner part; its residual adds save none). The inner parts it passes run their
        forward whole and keep nothing of it: their own checkpoints recompute them before their backward."""
        inner = set(inner)
        nodes = self.whole.members[name]
        stop = max((nodes.index(self.members[part][0]) - 1 for part in inner), default=-1)
        made = {v for n in nodes for v in self.outputs[n]}
        kept = {v for b in self.backward if not self.owners[b] & inner for v in self.inputs[b]}
        for i, n in enumerate(nodes):
            if self.region[n] not in inner and (set(self.outputs[n]) | (set(self.inputs[n]) & made)) & kept:
                stop = max(stop, i)
        return nodes[:stop + 1]

    @cached_property
    def region(self) -> tuple[str | None, ...]:
        """Per node, its region: its recorded module, or for a split one its part (None outside every part)."""
        return tuple(self.part_of[n] if name in self.split_modules else name for n, name in enumerate(self.region_of))

    @cached_property
    def members(self) -> dict[str, list[int]]:
        """Forward nodes of each region, in order."""
        out: dict[str, list[int]] = {}
        for node in self.order:
            name = self.region[node]
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
                if v in made and made[v] != self.region[node]}

    @cached_property
    def owners(self) -> dict[int, set[str]]:
        """Backward node -> the regions it belongs to (module docstring)."""
        made, outs = self._producer_region, self.region_outputs
        return {node: {made[v] for v in self.inputs[node] if v in made and v not in outs} for node in self.backward}

    @cached_property
    def backward_reads(self) -> dict[str, set[int]]:
        """Per region, the values its own backward reads."""
        read: dict[str, set[int]] = {name: set() for name in self.members}
        for node, regions in self.owners.items():
            for name in regions:
                read[name].update(self.inputs[node])
        return read

    @cached_property
    def rerun(self) -> dict[str, list[int]]:
        """Per region, its nodes from the first through the last whose output its backward reads, in order:
        what a recomputation runs, saved nodes aside (empty: its backward reads nothing of it)."""
        out = {}
        for name, nodes in self.members.items():
            read = [i for i, n in enumerate(nodes) if self.backward_reads[name] & set(self.outputs[n])]
            out[name] = nodes[:read[-1] + 1] if read else []
        return out

    @cached_property
    def savable(self) -> dict[str, list[int]]:
        """Per region, the nodes a decision may save: those of its `rerun` range that allocate, outside
        `unsaved`."""
        return {name: [n for n in nodes if n in self.allocating and n not in self.unsaved]
                for name, nodes in self.rerun.items()}

    @cached_property
    def unsaved(self) -> frozenset[int]:
        """Nodes no checkpointed region saves: random nodes, the nodes reading their outputs, and the nodes
        only random nodes read (the buffer eager's `bernoulli_` fills in place)."""
        drawn = {v for n in self.random for v in self.outputs[n]}
        readers: dict[int, set[int]] = {}
        for n, values in enumerate(self.inputs):
            for v in values:
                readers.setdefault(v, set()).add(n)
        buffers = {n for n in range(len(self.inputs)) if n not in self.random and self.outputs[n]
                   and all(readers.get(v) and readers[v] <= self.random for v in self.outputs[n])}
        return self.random | buffers | {n for n in range(len(self.inputs)) if drawn & set(self.inputs[n])}

    def trigger(self, name: str) -> int | None:
        """Where region `name`'s recomputation runs: before its first backward node, or before the first op
        of the autograd Node that runs it (a Node unpacks its saved tensors as it starts); None: no backward."""
        return self._triggers.get(name)

    @cached_property
    def _triggers(self) -> dict[str, int]:
        order, found = list(self.order), {}
        for i, node in enumerate(order):
            for name in self.owners.get(node, ()) if node in self.backward else ():
                if name not in found:
                    at, label = i, self.autograd[node] if self.autograd else None
                    while label is not None and at > 0 and order[at - 1] in self.backward \
                            and self.autograd[order[at - 1]] == label:
                        at -= 1
                    found[name] = order[at]
        return found

    @cached_property
    def called_with(self) -> dict[str, frozenset[int]]:
        """Per region, the values its forward reads that are made outside it (graph inputs included): the
        checkpointed function's arguments and what it reads of the model."""
        out = {}
        for name, nodes in self.members.items():
            own = {v for n in nodes for v in self.outputs[n]}
            out[name] = frozenset(v for n in nodes for v in self.inputs[n] if v not in own)
        return out

    @cached_property
    def frame_inputs(self) -> dict[str, tuple[int, ...]]:
        """Per region, `called_with` less graph inputs (always resident): what checkpoint's frame keeps
        alive, as the arguments to rerun the region from."""
        made = {v for values in self.outputs for v in values}
        return {name: tuple(sorted(values & made)) for name, values in self.called_with.items()}

    @cached_property
    def frame_ends(self) -> dict[str, int]:
        """Per region with a backward, its last backward node whose autograd Node unpacks a tensor saved
        under the region's checkpoint, which references the frame (and with it `frame_inputs`) until it has
        run: the last node that reads one of the region's own values (`owners`) or, before another region's
        next such node, one of `called_with` (the first linear's weight gradient reads the region's input)."""
        last: dict[str, int] = {}
        span: set[str] = set()
        for node in self.order:
            if node not in self.backward:
                continue
            span = self.owners[node] or span
            reads = set(self.inputs[node])
            for name in span:
                if name in self.owners[node] or reads & self.called_with[name]:
                    last[name] = node
        return last

    def recomputed(self, name: str, saved: Sequence[int] | frozenset[int]) -> list[int]:
        """The nodes region `name` reruns before its backward when it saves `saved`."""
        return [n for n in self.rerun[name] if n not in saved]

    def settled(self, name: str, saved: Sequence[int] | frozenset[int]) -> frozenset[int]:
        """`saved` without its idle saves, repeatedly (an idle save dropped is recomputed and reads its
        inputs): the nodes of `saved` the region's backward or one of its recomputed nodes reads."""
        keep, read = set(saved), set(self.backward_reads[name])
        for node in reversed(self.rerun[name]):
            if node in keep and not read & set(self.outputs[node]):
                keep.discard(node)
            if node not in keep:
                read.update(self.inputs[node])
        return frozenset(keep)

    def idle_saves(self, name: str, saved: Sequence[int] | frozenset[int]) -> set[int]:
        """Saved nodes of region `name` that neither its backward nor a node it recomputes reads."""
        read = set(self.backward_reads[name]).union(*(self.inputs[n] for n in self.recomputed(name, saved)))
        return {n for n in saved if not read & set(self.outputs[n])}


def dispatch_cost(policy_dispatch: Sequence[float], regions: Regions, saved: Mapping[str, Any]) -> float:
    """The cost selective checkpointing's dispatch modes add to a step whose regions save `saved` (region ->
    saved nodes): per region saving some, `policy_dispatch` = (forward, recomputation) per node times its
    forward nodes and its `rerun` range (a recomputation passes its saved nodes through the mode too)."""
    forward, recompute = policy_dispatch
    return sum(forward * len(regions.members[name]) + recompute * len(regions.rerun[name])
               for name, keep in saved.items() if keep)


def policy_schedule(regions: Regions, saved: Mapping[str, Sequence[int] | frozenset[int]]) -> list[dict[str, Any]]:
    """The schedule autograd runs when each region `name` in `saved` is checkpointed saving `saved[name]`
    (a subset of `regions.savable[name]` without idle saves); regions not in `saved` are not checkpointed."""
    for name, keep in saved.items():
        if name not in regions.members:
            raise PolicyFormError(f"region {name!r} is not a recorded module of this graph "
                                  f"({', '.join(regions.members) or 'none recorded'}).")
        bad = set(keep) - set(regions.savable[name])
        if bad:
            raise PolicyFormError(f"region {name!r} cannot save nodes {sorted(bad)[:5]}: a region saves only nodes "
                                  f"that allocate, up to the last one its backward reads (checkpoint stops "
                                  f"recomputing there), and never a random node, a reader of one or the buffer it "
                                  f"fills (a recomputation redraws them all).")
        idle = regions.idle_saves(name, keep)
        if idle:
            raise PolicyFormError(f"region {name!r} saves nodes {sorted(idle)[:5]} that neither its backward nor a "
                                  f"node it recomputes reads: checkpoint's cache would hold them until the "
                                  f"recomputation reaches them, longer than the schedule says. Save "
                                  f"`Regions.settled(name, saved)` instead.")
    inner = {name: regions.nested_of(name) for name in saved}
    for name in regions.nested_modules:
        parts = [part for part in regions.members if regions.nested_of(part) == name and regions.rerun[part]]
        if any(saved.get(part) != frozenset() for part in parts):
            raise PolicyFormError(f"nested module {name!r} must have each of its parts ({', '.join(parts)}) "
                                  f"checkpointed whole, saving nothing: its own checkpoint reruns them and keeps "
                                  f"none of their values.")
    before: dict[int, list[int]] = {}
    holds: dict[int, set[int]] = {}
    whole = regions.whole
    for name in sorted(regions.nested_modules):
        trigger = whole.trigger(name)
        if trigger is not None:
            before.setdefault(trigger, []).extend(regions.outer_rerun(name, [p for p in saved if inner[p] == name]))
            if whole.frame_inputs[name]:
                holds.setdefault(whole.frame_ends[name], set()).update(whole.frame_inputs[name])
    for name, keep in saved.items():
        trigger, rerun = regions.trigger(name), regions.recomputed(name, frozenset(keep))
        if trigger is not None and rerun:
            before.setdefault(trigger, []).extend(rerun)
            if regions.frame_inputs[name] and inner[name] is None:
                holds.setdefault(regions.frame_ends[name], set()).update(regions.frame_inputs[name])
    steps: list[dict[str, Any]] = []
    for node in regions.order:
        steps.extend({"compute": n} for n in before.get(node, ()))
        steps.append({"compute": node, "holds": sorted(holds[node])} if node in holds else {"compute": node})
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
    outside = sorted(n for n in again if n in regions.backward
                     or (regions.region[n] is None and regions.region_of[n] not in regions.nested_modules))
    if outside:
        raise PolicyFormError(f"the plan recomputes nodes {outside[:5]} outside every recorded module (or backward "
                              f"nodes); the policy form recomputes only within the regions checkpoint wraps "
                              f"({', '.join(regions.members) or 'none recorded'}). Solve with the policy form "
                              f"(solver 'selective-policy'), or run the plan with runtime.load.")
    saved = {name: frozenset(n for n in regions.savable[name] if n not in again)
             for name, nodes in regions.members.items() if again & set(nodes)}
    rule = ("it recomputes each region once, right before the region's backward, from the region's start through "
            "the last value its backward reads, and keeps a value from the forward only if that backward or the "
            "recomputation reads it")
    fix = "Solve with solver 'selective-policy', or run the plan with runtime.load."
    for name, keep in saved.items():
        idle = regions.idle_saves(name, keep)
        if idle:
            raise PolicyFormError(f"the plan's schedule is not one selective checkpointing can run: region {name!r} "
                                  f"would keep nodes {sorted(idle)[:5]} from the forward that neither its backward "
                                  f"nor its recomputation reads ({rule}). {fix}")
    steps = [s for s in schedule if "compute" in s]
    expected = policy_schedule(regions, saved)
    want = [s["compute"] for s in expected]
    if computes != want:
        i = next((i for i, (a, b) in enumerate(zip(computes, want)) if a != b), min(len(computes), len(want)))
        got = computes[i] if i < len(computes) else "the end"
        expected_node = want[i] if i < len(want) else "the end"
        raise PolicyFormError(f"the plan's schedule is not one selective checkpointing can run: its compute step {i} "
                              f"is node {got} where the policy form runs node {expected_node} ({rule}). {fix}")
    for i, (step, form) in enumerate(zip(steps, expected)):
        if sorted(step.get("holds", ())) != form.get("holds", []):
            raise PolicyFormError(f"the plan's compute step {i} (node {computes[i]}) holds values "
                                  f"{sorted(step.get('holds', ()))[:5]} where the policy form holds "
                                  f"{form.get('holds', [])[:5]}: a checkpointed region's frame keeps the values it "
                                  f"was called with until the region's last backward node has run, and the "
                                  f"prediction must count them there. {fix}")
    return saved


def held_reads(phases: Sequence[str], inputs: Sequence[Sequence[int]], outputs: Sequence[Sequence[int]],
               autograd_nodes: Sequence[int | None]) -> list[tuple[int, ...]]:
    """Per operator node, its reads plus, for the last of a run of consecutive backward nodes sharing an
    autograd Node, the values the run's earlier nodes read that the run does not make (runtime/tracing/autograd_nodes.py)."""
    reads = [tuple(dict.fromkeys(r)) for r in inputs]
    n, start = len(reads), 0
    while start < n:
        end = start + 1
        label = autograd_nodes[start] if phases[start] == "backward" else None
        while label is not None and end < n and phases[end] == "backward" and autograd_nodes[end] == label:
            end += 1
        if end - start > 1:
            made = {v for i in range(start, end) for v in outputs[i]}
            earlier = [v for i in range(start, end - 1) for v in reads[i] if v not in made]
            reads[end - 1] = tuple(dict.fromkeys([*reads[end - 1], *earlier]))
        start = end
    return reads
