"""The compiled form in the pipeline: the plans of `[[plans]]` tables with `form = "compiled"`, for one model at
one batch size, by a search measured under torch.compile with inductor.

The model's step (`loss_fn(model, *batch)`, as validation builds it) compiles to one joint graph (a step that
graph-breaks is refused with where it breaks: `runtime.compiled.step.GraphBreakError`). First it compiles with
inductor's own partition (nothing tagged), whose measured peak `M` is the compiled no-recomputation step: a budget
given as a fraction is a fraction of `M`, and that plan is what the cell's plans are timed against.

A plan is the solver's schedule on the joint problem (tasks/compiled/form.py) at a fraction `f` of its
no-recomputation peak (`FractionDecision`), compiled and measured. For a budget `B` in bytes the search measures
plans at fractions chosen from what it measured (`next_fraction`): from `B / M` down while nothing fits,
extrapolating the last step where the peak fell (at most twice the even step) and otherwise by the even step that
spreads the plans left over the rest of the range (the measured peak need not fall with the fraction: on
transformers' GPT-2 with dropout it measured 5.4 MB at 0.25, 7.3 at 0.55 and 8.8 at 0.2); then by bisection between the highest fraction that fits and the lowest above it that does not, up to
`probes` plans or until they are `RESOLUTION` apart. Where none of those measured within `B`, the search measures
the segment candidates once (`tasks.compiled.form.segment_candidates`: checkpointing the joint graph between the cuts where one
value alone carries the forward on, as `torch.utils.checkpoint` around each block does, with the last segments left
un-recomputed). The solver's own decisions cannot reach as low: on the grouped-query Llama of bench/compiled_real.py
the simulator's floor is the parameters' gradients at the end of the backward, where no activation is live, so every
fraction below about 0.75 gives one decision, which keeps matmul outputs (tagged `MUST_SAVE`) and measured 0.674-0.678
of eager's peak, where checkpointing per block measured 0.615 (tasks/compiled/form.py, docs/measurements/compiled-form.md). Every plan measured is kept for the model
and batch size, so the budgets of one run share them: each budget's answer is the measured plan within `B` with the
least recomputation: the least estimated cost of the nodes it tags to recompute (`Probe.recompute_cost`; inductor's
own: none), then the highest fraction. A lower budget therefore never gets a plan that measured more than a higher
budget's. The compile is deterministic, so a plan's predicted peak is what the search measured for it;
validation measures it again. The simulator's peak of the partition inductor made (`cut_peak`) is recorded beside it
(`provenance.simulated_peak_bytes`). A `max_overhead` limit takes the least simulated peak whose predicted cost (the
roofline estimate) is within `(1 + max_overhead)` of the no-recomputation schedule's (`least_memory_within`) and
measures the plan at that fraction. A step that draws random numbers (dropout) gets a second decision at the same
fraction, on the joint graph inductor makes when it draws them as eager PyTorch does (`fallback_random`), which
validation compiles to compare gradients with eager's (`exact_random_region`).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Callable

import torch

from memplan.runtime.compiled.records import Decision, JointGraph, RegionDecision
from memplan.runtime.compiled.partition import Partitioned
from memplan.runtime.compiled.step import CompiledStep, GraphBreakError
from memplan.runtime.format.plan import Plan, memplan_version, plan_id
from memplan.tasks.compiled.form import (FractionDecision, SegmentDecision, cut_peak, joint_problem,
                                         segment_candidates, segment_decision)
from memplan.tasks.config import Budget, MemplanError, ModelConfig
from memplan.tasks.models import build_batch, build_loss, build_model
from memplan.tasks.records import Solved
from memplan.tasks.solve.core.problem import Problem
from memplan.tasks.solve.core.simulator import default_schedule, simulate

RANDOM = ("aten.rand", "aten.bernoulli", "aten.native_dropout", "inductor_random", "prims.inductor_random",
          "aten.randn", "aten.randint", "aten.normal", "aten.uniform", "aten.multinomial", "run_and_save_rng")
"""Targets of the joint graph's ops that draw random numbers (dropout's masks among them)."""

RESOLUTION = 0.03
"""The search stops when the fractions that fit and do not fit the budget are this close."""

LEAST_FRACTION = 0.05
"""The search solves at no less than this fraction of the no-recomputation peak."""


@dataclass(frozen=True)
class Probe:
    """One compiled plan measured: the fraction it was solved at (None: inductor's own partition or a segment
    candidate), its region decision, the simulator's peak of the partition inductor made (`cut_peak`), the
    predicted cost (ms) of the solver's schedule, its measured peak and the seconds its compile took; for a
    segment candidate its `(stride, tail)` (`tasks.compiled.form.segment_decision`); and the estimated cost (ms,
    the joint problem's roofline) of the forward nodes it tags for recomputation, by which the search ranks plans
    (0: inductor's own)."""

    fraction: float | None
    region: RegionDecision
    simulated_peak_bytes: int
    predicted_cost: float | None
    measured_peak_bytes: int
    compile_seconds: float
    segments: tuple[int, int, bool] | None = None
    recompute_cost: float = 0.0

    @property
    def label(self) -> str:
        """"inductor", "fraction 0.600" or "segments 2/1" (stride / tail), "segments 1/4 + lead" (lead recomputed)."""
        if self.segments is not None:
            return f"segments {self.segments[0]}/{self.segments[1]}" + (" + lead" if self.segments[2] else "")
        return "inductor" if self.fraction is None else f"fraction {self.fraction:.3f}"


class CompiledGraphError(MemplanError):
    """A step the compiled form cannot plan: it graph-breaks, or it compiled to no graph (one paragraph)."""


class CompiledModel:
    """A training step `loss_fn(model, *batch)` named `name` on `device`, and the plans of it measured so far
    (`probes`, inductor's own partition first)."""

    def __init__(self, name: str, model: torch.nn.Module, loss_fn: Callable[..., torch.Tensor], batch: tuple,
                 device: str, solver: str) -> None:
        self.name, self.model, self.loss_fn, self.batch, self.device, self.solver = \
            name, model, loss_fn, batch, device, solver
        self.probes: list[Probe] = []
        self.inductor, joint = self._measure(None)
        self.joint: JointGraph = joint
        self.problem: Problem = joint_problem(joint)
        self.simulated = simulate(self.problem, default_schedule(self.problem))
        self.random = any(n.target.startswith(RANDOM) for n in joint.nodes)

    def exact_random_region(self, probe: Probe) -> RegionDecision | None:
        """For a step that draws random numbers, the decision at `probe`'s fraction on the joint graph inductor
        makes when it draws them as eager PyTorch does (`fallback_random`, another graph), which validation
        compiles to compare gradients with eager's; None for a step that draws none."""
        if not self.random:
            return None
        cut, _, _ = self._compiled(probe.fraction, exact_random=True, measure=False, segments=probe.segments)
        return RegionDecision(cut.fingerprint, cut.decision)

    def _compiled(self, fraction: float | None, exact_random: bool = False, measure: bool = True,
                  segments: tuple[int, int, bool] | None = None) -> tuple[Partitioned, CompiledStep, int]:
        """Compile the step on a copy of the model with the decision at `fraction` (None: inductor's own), or
        with `segments` the segment candidate `(stride, tail, lead)`, and run it once; with `measure`, the peak of a
        second step (`PeakMeter(allocator=True)`), else 0. The joint graph's cut, the step (its decision's
        solutions, compile time) and the peak; Dynamo's caches are reset after."""
        from memplan.runtime.measure.meter import PeakMeter

        replica = copy.deepcopy(self.model)
        decide = (SegmentDecision(*segments) if segments is not None
                  else FractionDecision(self.solver, fraction) if fraction is not None else _inductor)
        step = CompiledStep(_step_of(self.loss_fn, replica), decide, exact_random=exact_random)
        peak = 0
        try:
            with torch.random.fork_rng(devices=[self.device] if self.device.startswith("cuda") else []):
                try:
                    step(*self.batch).backward()
                except GraphBreakError as exc:
                    raise CompiledGraphError(f"{self.name}: {exc}") from None
                if measure:
                    replica.zero_grad(set_to_none=True)
                    with PeakMeter(self.device, allocator=True) as meter:
                        step(*self.batch).backward()
                    peak = meter.peak_bytes
        finally:
            torch.compiler.reset()
        if len(step.partitioned) != 1:
            raise CompiledGraphError(f"{self.name}'s step compiled to {len(step.partitioned)} joint graphs, "
                                     f"not one: the compiled form plans a step torch.compile compiles whole.")
        return step.partitioned[0], step, peak

    def _measure(self, fraction: float | None,
                 segments: tuple[int, int, bool] | None = None) -> tuple[Probe, JointGraph]:
        """The plan at `fraction` (None: inductor's own), or the segment candidate `segments`, compiled and
        measured, kept in `probes`."""
        cut, step, peak = self._compiled(fraction, segments=segments)
        solution = None if fraction is None or segments is not None else step.partitioner.decide.solutions[0]
        cost = solution.objective if solution is not None and solution.feasible else None
        problem = joint_problem(cut.joint)
        tagged = cut.decision.recompute
        recompute_cost = float(sum(c for c, name in zip(problem.cost, problem.node_names) if name in tagged))
        probe = Probe(fraction, RegionDecision(cut.fingerprint, cut.decision), cut_peak(cut.joint, cut.saved_values),
                      cost, peak, step.compile_seconds, segments, recompute_cost)
        self.probes.append(probe)
        return probe, cut.joint

    def measure_segments(self) -> list[Probe]:
        """The segment candidates (`tasks.compiled.form.segment_candidates`), each compiled and measured once;
        those whose decision repeats another's are skipped."""
        seen = {p.region.decision for p in self.probes}
        out = []
        for candidate in self._segment_candidates():
            known = next((p for p in self.probes if p.segments == candidate), None)
            if known is None:
                decision = self._segment_decision(*candidate)
                if decision is None or decision in seen:
                    continue
                seen.add(decision)
                known = self._measure(None, candidate)[0]
            out.append(known)
        return out

    def _segment_candidates(self) -> list[tuple[int, int, bool]]:
        return segment_candidates(self.joint)

    def measure(self, fraction: float) -> Probe:
        """The plan solved at `fraction`, measured (once per fraction, to 4 decimals)."""
        fraction = round(min(1.0, max(LEAST_FRACTION, fraction)), 4)
        known = next((p for p in self.probes if p.fraction == fraction), None)
        return known if known is not None else self._measure(fraction)[0]

    def _segment_decision(self, stride: int, tail: int, lead: bool) -> Decision | None:
        return segment_decision(self.joint, stride, tail, lead)

    def best_within(self, budget: int) -> Probe | None:
        """The measured plan with the least recomputation within `budget`: the least estimated cost of what it
        tags to recompute (`Probe.recompute_cost`; inductor's own: 0), then the highest fraction, then the least
        measured peak; None where none is."""
        fitting = [p for p in self.probes if p.measured_peak_bytes <= budget]
        return min(fitting, key=lambda p: (p.recompute_cost, -_fraction(p), p.measured_peak_bytes), default=None)

    def next_fraction(self, budget: int, left: int) -> float | None:
        """The fraction to measure next for `budget` with `left` plans still to measure (module docstring), None
        when the search is done."""
        solved = [p for p in self.probes if p.segments is None]
        fits = [_fraction(p) for p in solved if p.measured_peak_bytes <= budget]
        if fits:
            above = [_fraction(p) for p in solved if p.measured_peak_bytes > budget and _fraction(p) > max(fits)]
            if not above or min(above) - max(fits) <= RESOLUTION:
                return None
            return (min(above) + max(fits)) / 2
        points = sorted((_fraction(p), p.measured_peak_bytes) for p in solved)
        (low, peak), rest = points[0], points[1:]
        if low <= LEAST_FRACTION:
            return None
        if not rest:
            return max(LEAST_FRACTION, min(budget / peak, low - RESOLUTION))
        spread = (low - LEAST_FRACTION) / left           # what is left of the range, evenly over the plans left
        step = spread
        (higher, higher_peak) = rest[0]
        if higher_peak > peak:                           # falling towards the budget: extrapolate the last step
            slope = (higher_peak - peak) / (higher - low)
            step = min(2 * spread, (peak - budget) / slope + RESOLUTION / 2)
        return max(LEAST_FRACTION, low - max(step, RESOLUTION))

    def search(self, budget: int, probes: int) -> Probe | None:
        """The plan for a budget in measured bytes (module docstring), measuring at most `probes` more solved
        plans, and the segment candidates where none of those fits."""
        for left in range(probes, 0, -1):
            fraction = self.next_fraction(budget, left)
            if fraction is None:
                break
            self.measure(fraction)
        if self.best_within(budget) is None:
            self.measure_segments()
        return self.best_within(budget)


def _fraction(probe: Probe) -> float:
    """A probe's fraction, inductor's own partition counted as above every solved one, a segment candidate as
    below."""
    if probe.segments is not None:
        return 0.0
    return 1.0 + RESOLUTION if probe.fraction is None else probe.fraction


def _inductor(joint: JointGraph) -> Decision:
    """Inductor's own partition: nothing tagged."""
    return Decision()


def _step_of(loss_fn: Callable[..., torch.Tensor], model: torch.nn.Module) -> Callable[..., torch.Tensor]:
    return lambda *batch: loss_fn(model, *batch)


@dataclass(frozen=True)
class CompiledCell:
    """One compiled-form cell to plan: its alias, budget (bytes, a fraction of `M`, or `max_overhead`) and where
    its plan file goes."""

    alias: str
    budget: Budget
    plan_path: str


def plan_cells(spec: ModelConfig, batch_size: int, cells: list[CompiledCell], solver: str, seed: int, device: str,
               probes: int, no_recompute_path: str) -> list[Solved]:
    """Search every cell's plan (module docstring), write each found plan and inductor's own partition (the
    no-recomputation plan they are timed against, at `no_recompute_path`), and say what was measured."""
    model = CompiledModel(spec.name, build_model(spec, seed).to(device), build_loss(spec),
                          build_batch(spec, batch_size, seed, device), device, solver)
    baseline = _plan(model, model.inductor, "inductor", model.inductor.measured_peak_bytes, None)
    baseline.save(no_recompute_path)
    searched = [_searched(model, cell, probes) for cell in cells]
    return [_solved(model, cell, budget, probe if cell.budget.max_overhead is not None else model.best_within(budget),
                    baseline, no_recompute_path)                # a budget's answer among every plan measured
            for cell, (budget, probe) in zip(cells, searched)]


def _searched(model: CompiledModel, cell: CompiledCell, probes: int) -> tuple[int, Probe | None]:
    """A cell's budget in measured bytes and its plan as its own search found it."""
    if cell.budget.max_overhead is None:
        budget = _budget_bytes(model, cell.budget)
        return budget, model.search(budget, probes)
    found = _overhead_plan(model, cell.budget.max_overhead)
    return found.measured_peak_bytes, found


def _budget_bytes(model: CompiledModel, budget: Budget) -> int:
    """A compiled cell's budget in measured bytes: bytes as given, or a fraction of inductor's measured peak."""
    return budget.resolve(model.inductor.measured_peak_bytes)


def _overhead_plan(model: CompiledModel, limit: float) -> Probe:
    """The plan of a `max_overhead` cell: measured at the fraction of the least-memory schedule predicted within
    `(1 + limit)` of the no-recomputation schedule's cost (`least_memory_within`)."""
    from memplan.tasks.solve_stage import least_memory_within

    found = least_memory_within(model.problem, model.solver, limit, model.simulated)
    if not found.feasible:
        return model.inductor
    return model.measure(found.predicted_peak_bytes / model.simulated.peak_bytes)


def _solved(model: CompiledModel, cell: CompiledCell, budget: int, found: Probe | None, baseline: Plan,
            no_recompute_path: str) -> Solved:
    """The `Solved` record of one cell, its plan `found` (within `budget`) written where there is one."""
    measured = ", ".join(f"{p.label}: {p.measured_peak_bytes:,} B" for p in model.probes)
    summary = (f"{cell.alias}: compiled by inductor in one graph ({model.inductor.compile_seconds:.0f} s to "
               f"compile); peaks measured by plan (the fraction solved at, or a segment candidate): {measured}")
    plan = None if found is None else _plan(model, found, model.solver, budget, cell.budget.max_overhead)
    if plan is not None:
        plan.save(cell.plan_path)
    return Solved(
        solver=model.solver, status="optimal" if plan is not None else "infeasible", feasible=plan is not None,
        budget_bytes=budget, checkpoint_all_peak_bytes=model.inductor.measured_peak_bytes,
        checkpoint_all_cost=model.simulated.compute_cost,
        predicted_peak_bytes=None if found is None else found.measured_peak_bytes, arena_bytes=None,
        objective=None if found is None else _cost(model, found), gap=None,
        solve_seconds=sum(p.compile_seconds for p in model.probes), backend=None,
        min_budget_lower_bound=None,
        smallest_feasible_budget=min(p.measured_peak_bytes for p in model.probes),
        message="" if plan is not None else f"no compiled plan measured within {budget:,} B ({summary})",
        plan_path=None if plan is None else cell.plan_path, plan_id=None if plan is None else plan_id(plan),
        profile_run_id=None, max_overhead=cell.budget.max_overhead,
        no_recompute_path=no_recompute_path, no_recompute_id=plan_id(baseline), measured_search=summary)


def _cost(model: CompiledModel, probe: Probe) -> float:
    """A plan's predicted cost (ms, the roofline estimate): its schedule's, or without one (inductor's own
    partition) the no-recomputation schedule's."""
    return model.simulated.compute_cost if probe.predicted_cost is None else probe.predicted_cost


def _plan(model: CompiledModel, probe: Probe, solver: str, budget: int, max_overhead: float | None) -> Plan:
    """The compiled-form plan of a measured probe."""
    predicted = {"peak_bytes": probe.measured_peak_bytes, "time_ms": _cost(model, probe)}
    provenance = {"solver": solver, "budget_bytes": int(budget), "device": model.device, "backend": "inductor",
                  "fraction": probe.fraction, "simulated_peak_bytes": probe.simulated_peak_bytes,
                  **({"segments": list(probe.segments)} if probe.segments is not None else {}),
                  "batch": [{"shape": list(t.shape), "dtype": str(t.dtype).removeprefix("torch.")}
                            for t in model.batch],
                  "torch_version": torch.__version__,
                  "created_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                  "memplan_version": memplan_version(),
                  **({"max_overhead": max_overhead} if max_overhead is not None else {})}
    exact = model.exact_random_region(probe)
    regions = (probe.region,) if exact is None else (probe.region, exact)
    return Plan(probe.region.fingerprint, [], predicted=predicted, provenance=provenance, compiled=regions)
