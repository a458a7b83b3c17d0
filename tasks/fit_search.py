"""The largest batch size that fits a device memory limit: eager PyTorch's, per-block checkpointing's and
memplan's within a predicted overhead (`memplan fit`, flows/fit.py).

Each batch size tried is traced, profiled and solved with the pipeline's own stage functions
(`tasks.trace.trace`, `tasks.profile.profile_graph`, `tasks.solve_stage.least_memory_within`), and judged
by the shared simulator's predicted peaks: eager is the no-recomputation schedule (`default_schedule`),
per-block checkpointing is `module-checkpoint` with `every = 1` (`torch.utils.checkpoint` around each
repeated block), memplan is the least-memory schedule of `solver` within `max_overhead`. A batch fits when
its predicted peak plus the resident bytes (`MemoryLimit.graph_resident_bytes`: parameters, buffers,
batch, optimizer state) is at most the limit. The search doubles the batch from 1 until it does not fit
(or reaches `max_batch`), then bisects; the three searches share the batches they evaluate. Only the
answer is validated (flows/fit.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from pydantic import BaseModel, ConfigDict

from tasks.config import MemplanError, ModelConfig, PipelineConfig
from tasks.memory_limit import MemoryLimit

PER_BLOCK = "module-checkpoint"


class FitError(MemplanError):
    """`memplan fit` cannot answer: bad settings, or not even batch 1 fits."""


class BatchPoint(BaseModel):
    """The predicted memory of one batch size: resident bytes and each schedule's step peak (None: that
    schedule does not exist, e.g. no repeated blocks, or nothing within the overhead)."""

    model_config = ConfigDict(frozen=True)

    batch_size: int
    resident_bytes: int
    eager_peak_bytes: int
    checkpoint_peak_bytes: int | None
    memplan_peak_bytes: int | None
    memplan_overhead: float | None          # predicted, over the no-recomputation schedule
    plan_path: str | None

    def total(self, peak: int | None) -> int | None:
        """`peak` plus the resident bytes."""
        return None if peak is None else peak + self.resident_bytes


class FitSearch(BaseModel):
    """The searches' answers (0: not even batch 1 fits) and every batch size evaluated, in batch order."""

    model: str
    limit_bytes: int
    optimizer: str
    solver: str
    max_overhead: float
    max_batch: int
    eager_batch: int
    checkpoint_batch: int
    memplan_batch: int
    points: list[BatchPoint]

    def point(self, batch_size: int) -> BatchPoint:
        return next(p for p in self.points if p.batch_size == batch_size)


def largest_fitting(fits: Callable[[int], bool], max_batch: int) -> int:
    """The largest batch size in 1..`max_batch` that `fits` (0 when 1 does not), assuming that fitting is
    monotone: doubling from 1, then bisection between the last fit and the first miss."""
    if not fits(1):
        return 0
    low = 1
    while low < max_batch:
        high = min(2 * low, max_batch)
        if not fits(high):
            break
        low = high
    else:
        return low
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if fits(middle) else (low, middle)
    return low


def evaluate_batch(spec: ModelConfig, batch_size: int, config: PipelineConfig, device: str, limit: MemoryLimit,
                   solver: str, max_overhead: float) -> BatchPoint:
    """Trace, profile and solve `spec` at `batch_size`; memplan's plan lands under `<cache_dir>/fit/`."""
    from tasks.problems import load_problem
    from tasks.profile import ProfileSettings, profile_graph
    from tasks.solve import solve
    from tasks.solve.core.simulator import default_schedule, simulate
    from tasks.solve.core.solution import SolveOptions
    from tasks.solve_stage import least_memory_within, plan_of
    from tasks.trace import trace

    traced, graph = trace(spec, batch_size, device, config.seed, config.cache_dir)
    run = profile_graph(graph, device, ProfileSettings(config.profile.warmup, config.profile.repeats, config.seed),
                        model=spec.name, root=config.store, progress=False)
    loaded = load_problem(traced.path, device=run.device, store=config.store)
    problem = loaded.problem
    eager = simulate(problem, default_schedule(problem))
    per_block = solve(problem, PER_BLOCK, eager.peak_bytes, SolveOptions(params={"every": 1}))
    memplan = least_memory_within(problem, solver, max_overhead, eager)
    plan_path = None
    if memplan.feasible:
        plan = plan_of(loaded, memplan, run.device)
        plan.provenance["max_overhead"] = max_overhead
        plan_path = Path(config.cache_dir) / "fit" / f"{spec.name}-b{batch_size}-{solver}-{graph.fingerprint[:12]}.json"
        plan.save(plan_path)
    return BatchPoint(
        batch_size=batch_size,
        resident_bytes=limit.graph_resident_bytes(graph),
        eager_peak_bytes=eager.peak_bytes,
        checkpoint_peak_bytes=per_block.predicted_peak_bytes if per_block.feasible else None,
        memplan_peak_bytes=memplan.predicted_peak_bytes if memplan.feasible else None,
        memplan_overhead=memplan.objective / eager.compute_cost - 1 if memplan.feasible else None,
        plan_path=None if plan_path is None else str(plan_path),
    )


def search_fit(spec: ModelConfig, config: PipelineConfig, device: str, limit: MemoryLimit, solver: str,
               max_overhead: float, max_batch: int,
               evaluate: Callable[[int], BatchPoint] | None = None) -> FitSearch:
    """The largest batch of eager, per-block checkpointing and memplan under `limit` (module docstring);
    raises `FitError` when memplan fits not even batch 1."""
    points: dict[int, BatchPoint] = {}

    def point(batch_size: int) -> BatchPoint:
        if batch_size not in points:
            points[batch_size] = (evaluate or (lambda b: evaluate_batch(spec, b, config, device, limit, solver,
                                                                        max_overhead)))(batch_size)
        return points[batch_size]

    def fits(peak_of: Callable[[BatchPoint], int | None]) -> Callable[[int], bool]:
        def check(batch_size: int) -> bool:
            total = point(batch_size).total(peak_of(point(batch_size)))
            return total is not None and total <= limit.limit_bytes
        return check

    memplan = largest_fitting(fits(lambda p: p.memplan_peak_bytes), max_batch)
    if memplan == 0:
        one = point(1)
        least = one.memplan_peak_bytes if one.memplan_peak_bytes is not None else one.eager_peak_bytes
        raise FitError(
            f"model {spec.name!r} does not fit device_memory = {limit.limit_bytes:,} B even at batch 1: its "
            f"parameters, buffers, batch and {limit.optimizer} state take {one.resident_bytes:,} B and the step at "
            f"least {least:,} B more ({solver} within +{max_overhead:.0%} predicted overhead); raise device_memory "
            f"or --max-overhead, or pick a smaller model.")
    eager = largest_fitting(fits(lambda p: p.eager_peak_bytes), memplan)
    checkpoint = largest_fitting(fits(lambda p: p.checkpoint_peak_bytes), max_batch)
    return FitSearch(model=spec.name, limit_bytes=limit.limit_bytes, optimizer=limit.optimizer, solver=solver,
                     max_overhead=max_overhead, max_batch=max_batch, eager_batch=eager, checkpoint_batch=checkpoint,
                     memplan_batch=memplan, points=[points[b] for b in sorted(points)])
