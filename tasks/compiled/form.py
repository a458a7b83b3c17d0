"""Planning the compiled form: which forward nodes of a torch.compile joint graph the backward recomputes.

A joint graph (`memplan.runtime.compiled.records.JointGraph`) becomes a `Problem` as inductor will run it:
inductor fuses chains of pointwise ops and reductions into one kernel, so a value such an op makes and one such op
of the same phase alone reads never exists in memory (`fused_values`: zero bytes, and nothing to move); every
other value takes its storage's bytes. On bench/compiled_form.py's decoder this predicts inductor's measured peak
without recomputation to 0.4% (0.804 of eager's against 0.807; the unfused graph: 1.001). Costs are a roofline
estimate: a matmul's, attention's or convolution's floating-point work at `FLOPS`, any op's materialized bytes
read and written at `BANDWIDTH`. A solver's schedule
at a budget, judged by the one simulator, names the forward nodes it computes twice: those the compiled step
recomputes (`runtime/compiled/partition.py` tags them for inductor's partitioner).

The solver's decisions do not reach the lowest compiled peaks. On the joint problem no schedule peaks below the
parameters' gradients at the end of the backward, when the activations are already freed (on bench/compiled_real.py's
6-layer Llama: 188.4 MiB, 0.75 of the 252.6 MiB without recomputation). Any budget under that floor resolves to the
least the solver reaches (`least_within`, 188.9 MiB), and so to one decision, whatever the fraction: it recomputes 40
forward nodes and keeps 139.8 MiB of forward values for the backward (18 matmul outputs tagged `MUST_SAVE`), which the
simulator finds off its peak but the compiled step's measured peak, earlier in the backward, holds.
`segment_decision` is the structured alternative the measured search adds (tasks/compiled/plans.py): checkpointing
between the forward's cuts (`forward_cuts`: where one value alone carries the forward on), as `torch.utils.checkpoint`
around each block does, with the last segments optionally left un-recomputed.
"""

from __future__ import annotations

from collections import Counter

import numpy as np

from memplan.runtime.compiled.records import Decision, JointGraph, JointNode
from memplan.tasks.solve import solve
from memplan.tasks.solve.core.checkpoints import schedule_from_checkpoints
from memplan.tasks.solve.core.problem import Problem
from memplan.tasks.solve.core.simulator import default_schedule, simulate
from memplan.tasks.solve.core.solution import Solution

FLOPS = 50e9
"""Floating-point operations per second a matmul runs at in the cost estimate (a rough CPU core)."""
BANDWIDTH = 10e9
"""Bytes per second any other op moves in the cost estimate."""


EXTERN = ("aten.mm.", "aten.addmm.", "aten.bmm.", "aten.baddbmm.", "aten._scaled_dot_product", "aten.convolution")
"""Ops inductor runs as library kernels (BLAS, oneDNN, attention): their results are always materialized."""


def fusible(node: JointNode) -> bool:
    """Whether inductor fuses `node` with its producers and consumers (a pointwise op or a reduction)."""
    return node.flops == 0 and not node.target.startswith(EXTERN)


REALIZE_READS = 4
"""Inductor computes a pointwise value inside each kernel that reads it up to this many readers
(`torch._inductor.config.realize_reads_threshold`); read more often, it writes the value to memory."""


def fused_values(joint: JointGraph) -> frozenset[int]:
    """Values made by a fusible op, none a graph output, read by one to `REALIZE_READS` ops, all fusible and of
    the same phase: inductor computes them inside their readers' kernels, so they take no memory."""
    readers: dict[int, list[JointNode]] = {}
    for node in joint.nodes:
        for v in node.inputs:
            readers.setdefault(v, []).append(node)
    outputs = set(joint.outputs)
    return frozenset(v for node in joint.nodes if fusible(node) for v in node.outputs
                     if v not in outputs and 1 <= len(readers.get(v, ())) <= REALIZE_READS
                     and all(fusible(r) and r.phase == node.phase for r in readers[v]))


def joint_problem(joint: JointGraph, name: str = "compiled") -> Problem:
    """The problem of `joint` as inductor runs it (module docstring): values `0..len(inputs)-1` are resident
    inputs, fused values take no bytes; costs in milliseconds (estimated)."""
    producer = np.full(len(joint.value_bytes), -1, dtype=np.int64)
    for i, node in enumerate(joint.nodes):
        producer[list(node.outputs)] = i
    fused = fused_values(joint)
    value_bytes = np.array([0 if v in fused else b for v, b in enumerate(joint.value_bytes)], dtype=np.int64)
    moved = [int(value_bytes[list({*n.inputs, *n.outputs})].sum()) for n in joint.nodes]
    cost = np.array([1e3 * (n.flops / FLOPS + m / BANDWIDTH) for n, m in zip(joint.nodes, moved)])
    return Problem(
        name=name, cost=cost, workspace=np.zeros(len(joint.nodes), dtype=np.int64),
        phase=tuple(n.phase for n in joint.nodes), node_inputs=tuple(n.inputs for n in joint.nodes),
        node_outputs=tuple(n.outputs for n in joint.nodes), value_bytes=value_bytes,
        value_producer=producer, outputs=tuple(dict.fromkeys(v for v in joint.outputs if producer[v] >= 0)),
        order=np.arange(len(joint.nodes)), node_names=tuple(n.name for n in joint.nodes), cost_unit="ms")


def cut_peak(joint: JointGraph, saved: frozenset[int]) -> int:
    """The simulated peak of a partition of `joint` that saves the values `saved` for the backward: the forward
    keeps those, and the backward recomputes any other forward value it reads where it reads it
    (`schedule_from_checkpoints` without retaining recomputed values: inductor fuses a recomputed pointwise chain
    into its reader)."""
    problem = joint_problem(joint)
    schedule = schedule_from_checkpoints(problem, saved, retain_recomputed=False)
    return simulate(problem, schedule).peak_bytes


def recomputed_forward(problem: Problem, schedule: list) -> frozenset[str]:
    """The forward nodes `schedule` computes more than once, by name."""
    counts = Counter(step[1] for step in schedule if step[0] == "compute")
    return frozenset(problem.node_names[i] for i, c in counts.items() if c > 1 and problem.phase[i] == "forward")


def saved_forward(problem: Problem, schedule: list) -> frozenset[str]:
    """The forward nodes `schedule` computes once whose values a backward node reads: those it keeps for the
    backward, by name."""
    counts = Counter(step[1] for step in schedule if step[0] == "compute")
    read_later = {v for node, inputs in enumerate(problem.node_inputs) if problem.phase[node] != "forward"
                  for v in inputs}
    return frozenset(problem.node_names[i] for i, c in counts.items() if c == 1 and problem.phase[i] == "forward"
                     and set(problem.node_outputs[i]) & read_later)


SAVES = ("none", "costly", "all")
"""What a decision tags to be saved of what its schedule keeps for the backward: nothing (the partitioner places
it), the nodes with floating-point work (matmuls, attention, convolutions: cheap nodes stay the partitioner's,
which recomputes fusible ones where that saves memory), or all of it."""


REACH_STEPS = 7
"""Where the solver finds nothing at the budget, the least budget it reaches is bisected to 1/2**7 of the range."""


def least_within(problem: Problem, solver: str, fraction: float) -> Solution:
    """The solver's answer at `fraction` of the no-recomputation peak, or where it finds none there, at the least
    budget between that and the no-recomputation peak where it does (bisected `REACH_STEPS` times): a lower
    fraction never gives a plan that needs more memory than a higher one's."""
    ceiling = simulate(problem, default_schedule(problem)).peak_bytes
    budget = max(1, int(fraction * ceiling))
    solution = solve(problem, solver, budget)
    if solution.feasible or budget >= ceiling:
        return solution
    low, high = budget, ceiling
    best = solve(problem, solver, ceiling)
    for _ in range(REACH_STEPS):
        middle = (low + high) // 2
        found = solve(problem, solver, middle)
        low, high, best = (low, middle, found) if found.feasible else (middle, high, best)
    return best


class FractionDecision:
    """A `Decide` for the compiled form: each joint graph solved by `solver` at `fraction` of its
    no-recomputation peak (the simulator's), or at the least it reaches above that (`least_within`); `solutions`
    keeps each graph's answer in compile order."""

    def __init__(self, solver: str = "dtr", fraction: float = 0.5, save: str = "costly") -> None:
        if not 0 < fraction <= 1:
            raise ValueError(f"fraction {fraction!r} must lie in (0, 1]: the share of the no-recomputation peak")
        if save not in SAVES:
            raise ValueError(f"save {save!r} is not one of {', '.join(SAVES)} (what a decision tags to be saved)")
        self.solver, self.fraction, self.save = solver, fraction, save
        self.solutions: list[Solution] = []

    def __call__(self, joint: JointGraph) -> Decision:
        problem = joint_problem(joint)
        solution = least_within(problem, self.solver, self.fraction)
        self.solutions.append(solution)
        if not solution.feasible:
            return Decision()
        costly = {n.name for n in joint.nodes if n.flops > 0}
        saved = saved_forward(problem, solution.schedule) if self.save != "none" else frozenset()
        return Decision(recomputed_forward(problem, solution.schedule),
                        saved & costly if self.save == "costly" else saved)


def compile_step(fn, *, fraction: float = 0.6, solver: str = "dtr", save: str = "costly"):
    """`fn` (a training step: `fn(*batch)` returns the loss) compiled by inductor in the compiled form, each
    joint graph solved by `solver` at `fraction` of its no-recomputation peak (`FractionDecision`)."""
    from memplan.runtime.compiled.step import CompiledStep

    return CompiledStep(fn, FractionDecision(solver, fraction, save))


def _sourced(joint: JointGraph) -> frozenset[int]:
    """Forward values computed from no graph input at all (constants, random seeds, `arange`): any kernel can make
    them, so they neither cut the forward nor are tagged."""
    sourced: set[int] = set()
    for node in joint.nodes:
        if node.phase == "forward" and all(v in sourced for v in node.inputs):
            sourced.update(node.outputs)
    return frozenset(sourced)


def forward_cuts(joint: JointGraph) -> list[int]:
    """The forward nodes (indices into `joint.nodes`, in order) after which one value they make alone carries the
    forward on: no other value a forward node made is read by a later forward node (graph inputs and `_sourced`
    values aside). In a residual network these are the residual adds, the embedding's output and the chain to the
    loss: where `torch.utils.checkpoint` around each block saves its input."""
    sourced = _sourced(joint)
    made = {v for node in joint.nodes if node.phase == "forward" for v in node.outputs} - sourced
    forward = [i for i, node in enumerate(joint.nodes) if node.phase == "forward"]
    last_read: dict[int, int] = {}
    for i in forward:
        for v in joint.nodes[i].inputs:
            if v in made:
                last_read[v] = i
    live: set[int] = set()
    cuts = []
    for i in forward:
        outputs = joint.nodes[i].outputs
        live = {v for v in live if last_read[v] > i} | {v for v in outputs if last_read.get(v, -1) > i}
        if len(live) == 1 and live <= set(outputs):
            cuts.append(i)
    return cuts


def segment_cuts(joint: JointGraph) -> list[int]:
    """`forward_cuts` that end a segment with floating-point work (a matmul, attention, convolution) since the
    previous one, the first cut included: on a transformer, the embedding, each block's two residual adds and the
    head's matmul."""
    cuts = forward_cuts(joint)
    out: list[int] = []
    for i in cuts:
        if not out or any(joint.nodes[k].flops > 0 for k in range(out[-1] + 1, i + 1)):
            out.append(i)
    return out


SEGMENTS = ((1, 0.0, False), (1, 0.3, False), (1, 0.6, False), (1, 0.0, True), (1, 0.3, True), (1, 0.6, True))
"""The structured candidates the measured search adds, as `(stride, tail share, lead)` (`segment_candidates`):
checkpointing at every segment cut (a transformer's residual adds; every second one, per block, measured the same
peaks), the head's segment left to the partitioner and none, 30% or 60% of the other segments left un-recomputed
at the end (the backward starts there, so recomputing them saves little memory for their time), and each with the
lead (the embedding's lookup) recomputed too. On bench/compiled_real.py's 6-layer Llama they measured 0.615 of
eager's peak (0.612 with the lead) down to 60% of the segments left, and 0.694 with all but one left."""


def segment_candidates(joint: JointGraph) -> list[tuple[int, int, bool]]:
    """`SEGMENTS` resolved on `joint`: `(stride, tail, lead)` with the tail at least 1 segment and its share of
    the segments after the first cut, those that leave a segment to recompute, each once."""
    count = len(segment_cuts(joint)) - 1
    out: list[tuple[int, int, bool]] = []
    for stride, share, lead in SEGMENTS:
        candidate = (stride, max(1, round(share * count)), lead)
        if candidate not in out and segment_decision(joint, *candidate) is not None:
            out.append(candidate)
    return out


def segment_decision(joint: JointGraph, stride: int, tail: int, lead: bool = False) -> Decision | None:
    """Checkpointing by segments (`segment_cuts`), as `torch.utils.checkpoint` around blocks does but on the joint
    graph: the values of every `stride`-th cut from the first, and of the last one recomputed after, are saved
    (`MUST_SAVE`) and every other forward node between the first cut and the `tail`-th last is recomputed
    (`MUST_RECOMPUTE`); the last `tail` segments (at least the head's) are left to the partitioner, and so are the
    nodes before the first cut, or with `lead` they and the first cut are recomputed too (from the graph's inputs:
    an embedding's lookup, where its output would otherwise be saved). None where no segment is left to recompute."""
    if stride < 1 or tail < 1:
        raise ValueError(f"stride {stride} and tail {tail} must be at least 1")
    cuts = segment_cuts(joint)
    end = len(cuts) - 1 - tail
    if end < 1:
        return None
    bounds = {cuts[k] for k in range(0, end, stride) if k > 0 or not lead} | {cuts[end]}
    sourced = _sourced(joint)
    recompute = {joint.nodes[i].name for i in range(0 if lead else cuts[0] + 1, cuts[end] + 1)
                 if i not in bounds and joint.nodes[i].phase == "forward"
                 and not set(joint.nodes[i].outputs) <= sourced}
    return Decision(frozenset(recompute), frozenset(joint.nodes[i].name for i in bounds))


class SegmentDecision:
    """A `Decide` for the compiled form: `segment_decision(joint, stride, tail, lead)` (none tagged where it has no
    segment to recompute)."""

    def __init__(self, stride: int, tail: int, lead: bool = False) -> None:
        self.stride, self.tail, self.lead = stride, tail, bool(lead)

    def __call__(self, joint: JointGraph) -> Decision:
        return segment_decision(joint, self.stride, self.tail, self.lead) or Decision()
