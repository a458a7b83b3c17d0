"""The largest batch size (or, for a sequence model at a given batch, the largest sequence length) that fits a
device memory limit: eager PyTorch's, per-block checkpointing's and memplan's within a predicted overhead
(`memplan fit`, flows/fit.py). A sequence length is the first per-sample dimension of every integer input
that has one (token ids: `inputs = [{ shape = [128], dtype = "int64", ... }]`).

Each size tried is traced, profiled and solved with the pipeline's own stage functions
(`tasks.trace.trace`, `tasks.profile.stage.profile_graph`, `tasks.solve_stage.overhead_ladder`), and judged
by the shared simulator's predicted peaks: eager is the no-recomputation schedule (`default_schedule`),
per-block checkpointing is `module-checkpoint` with `every = 1` (`torch.utils.checkpoint` around each
repeated block), memplan is the least-memory schedule of `solver` within `max_overhead`. A batch fits when
its predicted peak plus the resident bytes (`MemoryLimit.graph_resident_bytes`: parameters, buffers,
batch, optimizer state) is at most the limit. The search doubles the size from 1 until it does not fit
(or reaches `max_size`), then bisects; the three searches share the sizes they evaluate. Only the
answer is validated, by measured overhead (flows/fit_refine.py)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Callable, Literal

from pydantic import BaseModel, ConfigDict

from memplan.tasks.config import MemplanError, ModelConfig, PipelineConfig
from memplan.tasks.fit.memory_limit import MemoryLimit
from memplan.tasks.validate.overhead import no_recompute_path
from memplan.tasks.records import Candidate

PER_BLOCK = "module-checkpoint"
Dimension = Literal["batch", "sequence"]


class FitError(MemplanError):
    """`memplan fit` cannot answer: bad settings, or not even batch 1 fits."""


class SizePoint(BaseModel):
    """The predicted memory of one size searched (`size`: the batch size, or the sequence length at
    `batch_size`): resident bytes and each schedule's step peak (None: that schedule does not exist, e.g. no
    repeated blocks, or nothing within the overhead)."""

    model_config = ConfigDict(frozen=True)

    size: int
    batch_size: int
    resident_bytes: int
    eager_peak_bytes: int
    checkpoint_peak_bytes: int | None
    memplan_peak_bytes: int | None
    memplan_overhead: float | None          # predicted, over the no-recomputation schedule
    plan_path: str | None
    candidates: list[Candidate] = []        # memplan's ladder (tasks/validate/overhead.py), most memory first,
    no_recompute_path: str | None = None    # and the no-recomputation plan its overheads are measured against

    def total(self, peak: int | None) -> int | None:
        """`peak` plus the resident bytes."""
        return None if peak is None else peak + self.resident_bytes


class FitSearch(BaseModel):
    """The searches' answers, the largest size each schedule fits (0: not even size 1), and every size
    evaluated, in order. `dimension`: batch sizes, or sequence lengths at batch `batch_size`."""

    model: str
    dimension: Dimension = "batch"
    batch_size: int | None = None
    limit_bytes: int
    optimizer: str
    solver: str
    max_overhead: float
    max_size: int
    eager_largest: int
    checkpoint_largest: int
    memplan_largest: int
    points: list[SizePoint]

    def point(self, size: int) -> SizePoint:
        return next(p for p in self.points if p.size == size)


def sequence_inputs(spec: ModelConfig) -> list[int]:
    """The inputs whose first per-sample dimension is a sequence length: integer inputs with a shape."""
    return [i for i, item in enumerate(spec.inputs) if item.high is not None and item.shape]


def at_size(spec: ModelConfig, dimension: Dimension, size: int, batch_size: int | None) -> tuple[ModelConfig, int]:
    """The model entry and batch size of one size searched: (`spec`, `size`) for batch sizes; for sequence
    lengths, `spec` with its sequence inputs `size` long, at `batch_size`."""
    if dimension == "batch":
        return spec, size
    long = sequence_inputs(spec)
    inputs = [item.model_copy(update={"shape": [size, *item.shape[1:]]}) if i in long else item
              for i, item in enumerate(spec.inputs)]
    return spec.model_copy(update={"inputs": inputs}), int(batch_size)


def largest_fitting(fits: Callable[[int], bool], max_size: int) -> int:
    """The largest size in 1..`max_size` that `fits` (0 when 1 does not), assuming that fitting is
    monotone: doubling from 1, then bisection between the last fit and the first miss."""
    if not fits(1):
        return 0
    low = 1
    while low < max_size:
        high = min(2 * low, max_size)
        if not fits(high):
            break
        low = high
    else:
        return low
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if fits(middle) else (low, middle)
    return low


def evaluate_size(spec: ModelConfig, batch_size: int, size: int, label: str, config: PipelineConfig, device: str,
                  limit: MemoryLimit, solver: str, max_overhead: float) -> SizePoint:
    """Trace, profile and solve `spec` at `batch_size` (`size`: the size searched); memplan's plan lands under
    `<cache_dir>/fit/`, named after the model, `label` (`b64`, or `b2-s512` for a sequence length) and solver."""
    from memplan.tasks.config import Budget, PlanSettings
    from memplan.tasks.problems import load_problem
    from memplan.tasks.profile.stage import ProfileSettings, profile_graph
    from memplan.tasks.solve import solve
    from memplan.tasks.solve.core.simulator import default_schedule, simulate
    from memplan.tasks.solve.core.solution import SolveOptions
    from memplan.tasks.solve_stage import overhead_ladder, plan_of, write_ladder
    from memplan.tasks.trace import trace

    traced, graph = trace(spec, batch_size, device, config.seed, config.cache_dir)
    run = profile_graph(graph, device, ProfileSettings(config.profile.warmup, config.profile.repeats, config.seed),
                        model=spec.name, root=config.store, progress=False)
    loaded = load_problem(traced.path, device=run.device, store=config.store)
    problem = loaded.problem
    eager = simulate(problem, default_schedule(problem))
    per_block = solve(problem, PER_BLOCK, eager.peak_bytes, SolveOptions(params={"every": 1}))
    ladder = overhead_ladder(problem, solver, max_overhead, eager)
    memplan, plan_path, candidates, baseline = ladder.chosen, None, [], None
    if memplan.feasible:
        plan = plan_of(loaded, memplan, run.device)
        plan.provenance["max_overhead"] = max_overhead
        plan_path = Path(config.cache_dir) / "fit" / f"{spec.name}-{label}-{solver}-{graph.fingerprint[:12]}.json"
        plan.save(plan_path)
        candidates, baseline = write_ladder(loaded, ladder, eager, Budget(max_overhead=max_overhead), PlanSettings(),
                                            run.device, str(plan_path), plan)
    return SizePoint(
        size=size,
        batch_size=batch_size,
        resident_bytes=limit.graph_resident_bytes(graph),
        eager_peak_bytes=eager.peak_bytes,
        checkpoint_peak_bytes=per_block.predicted_peak_bytes if per_block.feasible else None,
        memplan_peak_bytes=memplan.predicted_peak_bytes if memplan.feasible else None,
        memplan_overhead=memplan.objective / eager.compute_cost - 1 if memplan.feasible else None,
        plan_path=None if plan_path is None else str(plan_path),
        candidates=candidates,
        no_recompute_path=None if baseline is None else no_recompute_path(plan_path),
    )


def search_fit(spec: ModelConfig, config: PipelineConfig, device: str, limit: MemoryLimit, solver: str,
               max_overhead: float, max_size: int, dimension: Dimension = "batch", batch_size: int | None = None,
               evaluate: Callable[[int], SizePoint] | None = None,
               report: Callable[[str], None] = lambda line: None) -> FitSearch:
    """The largest size (batch, or sequence length at `batch_size`) of eager, per-block checkpointing and
    memplan under `limit` (module docstring); raises `FitError` when memplan fits not even size 1. `report` gets
    a line per size evaluated: its time and what fits."""
    points: dict[int, SizePoint] = {}

    def evaluate_at(size: int) -> SizePoint:
        entry, batch = at_size(spec, dimension, size, batch_size)
        label = f"b{size}" if dimension == "batch" else f"b{batch}-s{size}"
        return evaluate_size(entry, batch, size, label, config, device, limit, solver, max_overhead)

    def point(size: int) -> SizePoint:
        if size not in points:
            started = time.monotonic()
            points[size] = (evaluate or evaluate_at)(size)
            report(size_line(points[size], dimension, limit.limit_bytes, time.monotonic() - started))
        return points[size]

    def fits(peak_of: Callable[[SizePoint], int | None]) -> Callable[[int], bool]:
        def check(size: int) -> bool:
            total = point(size).total(peak_of(point(size)))
            return total is not None and total <= limit.limit_bytes
        return check

    memplan = largest_fitting(fits(lambda p: p.memplan_peak_bytes), max_size)
    if memplan == 0:
        one = point(1)
        least = one.memplan_peak_bytes if one.memplan_peak_bytes is not None else one.eager_peak_bytes
        where = "batch 1" if dimension == "batch" else f"sequence length 1 at batch {batch_size}"
        raise FitError(
            f"model {spec.name!r} does not fit device_memory = {limit.limit_bytes:,} B even at {where}: its "
            f"parameters, buffers, batch and {limit.optimizer} state take {one.resident_bytes:,} B and the step at "
            f"least {least:,} B more ({solver} within +{max_overhead:.0%} predicted overhead); raise device_memory "
            f"or --max-overhead, or pick a smaller model.")
    eager = largest_fitting(fits(lambda p: p.eager_peak_bytes), memplan)
    checkpoint = largest_fitting(fits(lambda p: p.checkpoint_peak_bytes), max_size)
    return FitSearch(model=spec.name, dimension=dimension, batch_size=batch_size if dimension == "sequence" else None,
                     limit_bytes=limit.limit_bytes, optimizer=limit.optimizer, solver=solver, max_overhead=max_overhead,
                     max_size=max_size, eager_largest=eager, checkpoint_largest=checkpoint, memplan_largest=memplan,
                     points=[points[size] for size in sorted(points)])


def size_line(point: SizePoint, dimension: Dimension, limit_bytes: int, seconds: float) -> str:
    """One size's progress line: what eager, per-block checkpointing and memplan need at it against the limit."""
    def need(peak: int | None) -> str:
        total = point.total(peak)
        return "none" if total is None else f"{total / 2**20:,.1f} MiB ({'fits' if total <= limit_bytes else 'over'})"

    name = "batch" if dimension == "batch" else "sequence length"
    return (f"{name} {point.size}: eager {need(point.eager_peak_bytes)}, per-block {need(point.checkpoint_peak_bytes)}, "
            f"memplan {need(point.memplan_peak_bytes)} of {limit_bytes / 2**20:,.1f} MiB ({seconds:.0f} s)")
