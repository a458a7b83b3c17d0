"""Plans by overhead, measured: each solver's published max_overhead plan against a budget sweep of that solver.

All of a solver's plans are validated side by side in shared timing rounds, as the pipeline validates.

    .venv/bin/python bench/max_overhead.py [--config pipeline.toml] [--models gpt2-tiny resnet18]
                                           [--solvers dtr ap-greedy acg] [--max-overhead 0.10] [--budgets 10]

For each model of `--config` (at its batch sizes) the pipeline's stage functions trace it (`tasks.trace`),
profile it with the file's [profile] settings (`tasks.profile.stage`, into a temporary store), measure the eager
reference (`tasks.validate.reference`) and, for each solver (default: those of the file's [[plans]] that give
`max_overhead`, with that plan entry's settings, e.g. acg's `addresses`), solve with `tasks.solve_stage.solve_case`:
- `ovh`: the plan the pipeline publishes at `max_overhead = --max-overhead`: the cell's predicted choice, then the
  walk along its ladder by measured overhead against the no-recomputation plan (`tasks.validate.overhead.refine`,
  each step one `validate_plans` call, as flows/refine.py validates them); `predicted`: the predicted choice,
  shown where the walk published another rung;
- `sweep`: `--budgets` fixed budgets spread evenly from the checkpoint-all peak down to the least budget the
  solver finds a schedule at (bisection to 0.5%), duplicates of one schedule dropped;
- `none`: the checkpoint-all plan (no recomputation), the reference point of the predicted overhead, and the
  top of the sweep.
Each solver's plans are validated in one `tasks.validate.stage.validate_plans` call with the file's [validate]
settings: one eager step and one step of each plan per round, overhead = median over rounds of plan /
eager - 1, its 95% interval from the order statistics (`median_interval`): what the pipeline publishes. Then
the same plans are timed again in the validation's rounds (`paired_step_times`) against the `none` plan
instead of eager: the overhead the limit is about. The ovh plan is *within* the limit when its interval's lower
end is at most the limit (overhead <= limit + the interval's lower half-width: the timing cannot tell it from
the limit); a sweep plan is *at* that overhead when its median is at most the limit (the allowance is the
published plan's, not the sweep's: an interval 75 points wide would otherwise admit any plan). Prints per model
a table of every plan (predicted and measured peak and overhead against both), and per solver and baseline
whether the ovh plan is within, the least-peak sweep plan at the limit, ovh peak / that peak
(must be <= 1.05) and, for a failure, its cause; then one verdict line per baseline. Timing on a shared host
is noisy: the intervals say how much.
"""

from __future__ import annotations

import argparse
import copy
import functools
import json
import statistics
import tempfile
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console
from rich.table import Table

from memplan import runtime
from memplan.runtime.format.graph import OpGraph
from memplan.runtime.format.plan import Plan
from memplan.tasks.config import Budget, ModelConfig, PipelineConfig, PlanConfig, PlanSettings, load_config
from memplan.tasks.models import build_batch, build_loss, build_model, resolve_device
from memplan.tasks.validate.overhead import Rung, predicted_choice, refine, with_rung
from memplan.tasks.problems import load_problem
from memplan.tasks.profile.stage import ProfileSettings, profile_graph
from memplan.tasks.records import Referenced, Solved, Validated
from memplan.tasks.validate.reference import measure_reference
from memplan.tasks.solve import solve
from memplan.tasks.solve.core.simulator import default_schedule, simulate
from memplan.tasks.solve.core.solution import min_budget_lower_bound
from memplan.tasks.solve_stage import bisect_budget, solve_case
from memplan.tasks.trace import trace
from memplan.tasks.validate.step_timing import median_interval, paired_step_times
from memplan.tasks.validate.stage import validate_plans

PEAK_RATIO_LIMIT = 1.05


@dataclass(frozen=True)
class Overhead:
    """A measured overhead: the median over timed rounds of plan / baseline - 1 and its 95% interval."""

    median: float
    interval: tuple[float, float] | None

    def within(self, limit: float) -> bool:
        """The interval reaches down to `limit` or below: overhead <= limit + the interval's lower half-width."""
        return (self.median if self.interval is None else self.interval[0]) <= limit

    def __str__(self) -> str:
        if self.interval is None:
            return f"{self.median:+.1%}"
        return f"{self.median:+.1%} [{self.interval[0]:+.1%}, {self.interval[1]:+.1%}]"


@dataclass(frozen=True)
class Row:
    """One plan of a solver's group: its kind (`none`, `ovh`, `sweep`), solve and validation records, and its
    overhead against the no-recompute plan timed in shared rounds."""

    kind: str
    solved: Solved
    validated: Validated
    vs_none: Overhead

    @property
    def predicted_overhead(self) -> float:
        return self.solved.objective / self.solved.checkpoint_all_cost - 1

    @property
    def vs_eager(self) -> Overhead:
        v = self.validated
        return Overhead(v.overhead, None if v.overhead_interval is None else tuple(v.overhead_interval))

    def within(self, limit: float, baseline: str) -> bool:
        """Passed validation and its overhead against `baseline` ("eager" or "none") is within `limit`."""
        return self.validated.passed and (self.vs_eager if baseline == "eager" else self.vs_none).within(limit)

    def at(self, limit: float, baseline: str) -> bool:
        """Passed validation and the median of its overhead against `baseline` is at most `limit`."""
        return self.validated.passed and (self.vs_eager if baseline == "eager" else self.vs_none).median <= limit


def overhead_plans(config: PipelineConfig, model: str, solvers: list[str] | None) -> list[PlanConfig]:
    """The [[plans]] entries of `model` that give max_overhead (one per solver), or entries for `solvers`:
    theirs where the file has one, else the defaults."""
    own = {p.solver: p for p in config.plans if p.max_overhead is not None and (p.models is None or model in p.models)}
    if solvers is None:
        return list(own.values())
    return [own.get(s) or PlanConfig(solver=s, max_overhead=[0.1]) for s in solvers]


def least_budget(graph_path: str, entry: PlanConfig, device: str, store: str) -> int:
    """The least budget (to 0.5%) at which `entry`'s solver finds a schedule, between the lower bound and the
    checkpoint-all peak."""
    settings = entry.solve_settings()
    problem = load_problem(graph_path, device=device, store=store, variants=settings.variants).problem
    top = simulate(problem, default_schedule(problem)).peak_bytes

    def probe(budget: int) -> int | None:
        solution = solve(problem, entry.solver, budget, settings.solve_options())
        return solution.predicted_peak_bytes if solution.feasible else None

    return bisect_budget(min(min_budget_lower_bound(problem), top) - 1, top, probe)


def solver_rows(spec: ModelConfig, batch: int, entry: PlanConfig, graph_path: str, graph: OpGraph, device: str,
                store: str, reference: Referenced, config: PipelineConfig, limit: float, count: int,
                work: Path) -> list[Row]:
    """Solve the none, ovh and sweep plans of one solver and validate them together."""
    settings = entry.solve_settings(config.optimizer)
    if settings.optimizer != "none" or settings.ddp_bucket_mb is not None:
        raise SystemExit(f"{entry.solver}: plans with optimizer_in_step or ddp_bucket_mb are not benchmarked here")
    least = least_budget(graph_path, entry, device, store)

    def solved_at(kind: str, solver: str, budget: Budget, chosen: PlanSettings, index: int = 0) -> tuple[str, Solved]:
        path = work / f"{spec.name}-{entry.solver}-{kind}-{index}.json"
        return kind, solve_case(graph_path, solver, budget, chosen, device, store, str(path))

    cells = [solved_at("none", "checkpoint-all", Budget(fraction=1.0), PlanSettings())]
    top = cells[0][1].checkpoint_all_peak_bytes
    predicted = solved_at("ovh", entry.solver, Budget(max_overhead=limit), settings)[1]
    walked = walk(predicted, limit, spec, batch, graph, device, reference, config)
    if walked.plan_id != predicted.plan_id:
        cells.append(("predicted", predicted))
    cells.append(("ovh", walked))
    sweep = [int(top - (top - least) * i / max(1, count - 1)) for i in range(count)]
    cells += [solved_at("sweep", entry.solver, Budget(bytes=budget), settings, i) for i, budget in enumerate(sweep)]
    plans, schedules = [], set()
    for kind, solved in cells:
        if not solved.feasible:
            continue
        plan = Plan.load(solved.plan_path)
        schedule = json.dumps(plan.schedule)
        if kind == "sweep" and schedule in schedules:       # the schedule of a larger budget (or of none) again
            continue
        if kind != "ovh":
            schedules.add(schedule)
        plans.append((kind, solved, plan))
    validations = validate_plans([p for _, _, p in plans], spec, batch, device, config.seed, config.validation,
                                 reference, graph)
    against_none = overheads_against_first([p for _, _, p in plans], spec, batch, device, config, graph)
    return [Row(kind, solved, v, o) for (kind, solved, _), v, o in zip(plans, validations, against_none)]


def walk(solved: Solved, limit: float, spec: ModelConfig, batch: int, graph: OpGraph, device: str,
         reference: Referenced, config: PipelineConfig) -> Solved:
    """The cell's published rung: its ladder walked by overhead measured against its no-recomputation plan,
    each step one `validate_plans` call with the [validate] settings (flows/refine.py's walk). Prints the walk."""
    if not solved.feasible:
        return solved
    baseline = Plan.load(solved.no_recompute_path)

    def validated(rungs: list[int]) -> list[float | None]:
        plans = [Plan.load(solved.candidates[i].plan_path) for i in rungs]
        results = validate_plans(plans, spec, batch, device, config.seed, config.validation, reference, graph,
                                 no_recompute=[baseline] * len(plans))
        return [v.limited_overhead() if v.passed else None for v in results]

    ladder = [Rung(c.predicted_overhead) for c in solved.candidates]
    start = predicted_choice(ladder, limit)
    (index, within, measured), = refine([(ladder, limit)], validated([start]),
                                        lambda wanted: validated([i for _, i in wanted]))
    steps = ", ".join(f"{solved.candidates[i].predicted_peak_bytes / 1e6:.2f} MB predicted "
                      f"{solved.candidates[i].predicted_overhead:+.1%} measured "
                      f"{'failed' if m is None else f'{m:+.1%}'}" for i, m in sorted(measured.items()))
    print(f"{spec.name} {solved.solver}: walk published rung {index} (predicted choice {start}, "
          f"{'within' if within else 'NOT within'}): {steps}", flush=True)
    if index is None or index == start:
        return solved
    return with_rung(solved, solved.candidates[index])


def overheads_against_first(plans: list[Plan], spec: ModelConfig, batch_size: int, device: str,
                            config: PipelineConfig, graph: OpGraph) -> list[Overhead]:
    """Each plan's overhead against the first (the no-recompute plan), timed as validation times against eager
    (`paired_step_times` with the [validate] settings, `median_interval`)."""
    base = build_model(spec, config.seed).to(device)
    loss_fn, batch = build_loss(spec), build_batch(spec, batch_size, config.seed, device)
    runs = []
    for plan in plans:
        model = copy.deepcopy(base)
        runs.append((model, functools.partial(runtime.load(plan, model, loss_fn, graph=graph), *batch)))
    settings = config.validation
    times = paired_step_times(runs, device, settings.warmup, settings.steps, settings.max_steps,
                              settings.overhead_precision)
    overheads = []
    for measured in times:
        ratios = [t / n for t, n in zip(measured, times[0])]
        interval = median_interval(ratios)
        overheads.append(Overhead(statistics.median(ratios) - 1,
                                  None if interval is None else (interval[0] - 1, interval[1] - 1)))
    return overheads


def cause(ovh: Row, best: Row, limit: float, ratio: float) -> str:
    """Why a cell fails: the ovh plan measured above the limit, or a smaller sweep plan measured within it
    although its predicted overhead is above the limit (the timing cannot separate them: no search miss),
    or one whose predicted overhead is within the limit too (the search missed it)."""
    if ratio <= PEAK_RATIO_LIMIT:
        return "ovh plan measured above the limit"
    if best.predicted_overhead > limit:
        return (f"smaller sweep plan predicted {best.predicted_overhead:+.1%}, measured within: timing noise or "
                "misprediction")
    return "search missed a smaller plan predicted within the limit"


def report(console: Console, title: str, groups: dict[str, list[Row]], limit: float) -> dict[str, list[bool]]:
    """Print the plans table and the per-solver verdict table of one model; returns each solver's verdicts by
    baseline."""
    plans = Table("solver", "plan", "budget MB", "predicted peak MB", "measured peak MB", "predicted ovh",
                  "measured ovh vs eager [95%]", "measured ovh vs no-recompute [95%]", "valid", title=title)
    verdicts = Table("solver", "baseline", f"ovh plan within +{limit:.0%}", "ovh peak MB",
                     "least-peak sweep plan at the limit", "its peak MB", "peak ratio", "verdict",
                     title=f"{title}: max_overhead = {limit:g}")
    results: dict[str, list[bool]] = {"eager": [], "none": []}
    for solver, rows in groups.items():
        for r in rows:
            v = r.validated
            plans.add_row(solver, r.kind, f"{r.solved.budget_bytes / 1e6:.2f}", f"{v.predicted_peak_bytes / 1e6:.2f}",
                          f"{v.measured_peak_bytes / 1e6:.2f}", f"{r.predicted_overhead:+.1%}", str(r.vs_eager),
                          str(r.vs_none), "yes" if v.passed else "NO")
        ovh = next((r for r in rows if r.kind == "ovh"), None)
        for baseline in ("eager", "none"):
            within = [r for r in rows if r.kind in ("none", "sweep") and r.at(limit, baseline)]
            best = min(within, key=lambda r: r.validated.measured_peak_bytes, default=None)
            if ovh is None or best is None:
                verdicts.add_row(solver, baseline, "no plan" if ovh is None else "", "",
                                 "none" if best is None else "", "", "", "FAIL")
                ok = False
            else:
                ratio = ovh.validated.measured_peak_bytes / best.validated.measured_peak_bytes
                ok = ovh.within(limit, baseline) and ratio <= PEAK_RATIO_LIMIT
                measured = ovh.vs_eager if baseline == "eager" else ovh.vs_none
                best_measured = best.vs_eager if baseline == "eager" else best.vs_none
                verdicts.add_row(solver, baseline, f"{'yes' if ovh.within(limit, baseline) else 'NO'} ({measured})",
                                 f"{ovh.validated.measured_peak_bytes / 1e6:.2f}",
                                 f"{best.kind} {best.solved.budget_bytes / 1e6:.2f} MB, predicted "
                                 f"{best.predicted_overhead:+.1%}, measured {best_measured}",
                                 f"{best.validated.measured_peak_bytes / 1e6:.2f}", f"{ratio:.3f}",
                                 "pass" if ok else f"FAIL ({cause(ovh, best, limit, ratio)})")
            results[baseline].append(ok)
    console.print(plans)
    console.print(verdicts)
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="pipeline.toml")
    ap.add_argument("--models", nargs="+", default=None, help="model names of the config (default: all)")
    ap.add_argument("--solvers", nargs="+", default=None,
                    help="default: the solvers of the config's max_overhead plans for each model")
    ap.add_argument("--max-overhead", type=float, default=0.10)
    ap.add_argument("--budgets", type=int, default=10, help="budgets of each solver's sweep")
    args = ap.parse_args()
    console = Console(width=200)
    config = load_config(args.config)
    device = resolve_device(config.device)
    work = Path(tempfile.mkdtemp(prefix="memplan-max-overhead-"))
    store = str(work / "store")
    verdicts: dict[str, list[bool]] = {"eager": [], "none": []}
    for spec, batch in config.model_batches():
        if args.models is not None and spec.name not in args.models:
            continue
        traced, graph = trace(spec, batch, device, config.seed, work / "cache")
        profile_graph(graph, device, ProfileSettings(config.profile.warmup, config.profile.repeats, config.seed),
                      model=spec.name, root=store, progress=False)
        reference = measure_reference(spec, batch, device, config.seed, work / f"{spec.name}-b{batch}.safetensors")
        groups = {entry.solver: solver_rows(spec, batch, entry, traced.path, graph, device, store, reference, config,
                                            args.max_overhead, args.budgets, work)
                  for entry in overhead_plans(config, spec.name, args.solvers)}
        for baseline, oks in report(console, f"{spec.name} b{batch} ({traced.nodes} nodes, {device})", groups,
                                    args.max_overhead).items():
            verdicts[baseline] += oks
    for baseline, oks in verdicts.items():
        against = "eager PyTorch (as validation publishes)" if baseline == "eager" else "the no-recompute plan"
        console.print(f"verdict against {against}: "
                      f"{sum(oks)} of {len(oks)} solver x model cells pass (ovh plan within +{args.max_overhead:.0%} "
                      f"measured, its peak <= {PEAK_RATIO_LIMIT:.2f}x the least-peak sweep plan at it)",
                      highlight=False)


if __name__ == "__main__":
    main()
