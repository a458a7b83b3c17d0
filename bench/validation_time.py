"""Validation time of a sweep of plans: each plan measuring eager PyTorch itself (before) against one eager
reference per cell (after), side by side in one run, with each plan's verdict.

    .venv/bin/python bench/validation_time.py [--layers 6] [--plans 10] [--steps 6] [--max-steps 20]
                                              [--before-commit e0ac469] [--modes before after shared]

Workload: GPT-2 as in bench/peers.py (`--layers` layers, 256 wide, seq 256, batch 4, no dropout), traced
and profiled once; `--plans` plans solved on its profile (dtr, ap-greedy and acg at max_overhead 0.05 and
0.25, ap-greedy and linearized-greedy at 70% and 50% of the checkpoint-all peak, in that order). Each plan
is validated on the graph the trace captured (as `memplan run` does on one process), with the [validate]
settings of pipeline.toml (`--steps`, `--max-steps`) by:
- before: `tasks/validate/stage.py` as of `--before-commit` (read from git), one `validate_plan` per plan: each
  builds the model, runs eager's exact and metered steps, and pairs every timed round with an eager step;
- after: one `tasks.validate.reference.measure_reference` for the cell, then the pipeline's `validate_plan` per plan
  (no eager correctness or peak steps; timed rounds still paired with eager);
- shared: one reference, then `validate_plans` of all plans at once (each round one eager step and one
  step of every plan).
Prints seconds per mode and their ratio to before, the median over plans of the larger half of each
overhead's 95% interval (how precise the timing was), and one row per plan: verdict and measured overhead by
each mode (the verdicts must agree; overheads are noisy on a busy host).
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
import types
from pathlib import Path

from rich.console import Console
from rich.table import Table

from memplan.runtime.format.plan import Plan
from memplan.tasks.config import Budget, ModelConfig, PlanSettings, ValidateConfig
from memplan.tasks.profile.stage import ProfileSettings, profile_graph
from memplan.tasks.validate.reference import measure_reference
from memplan.tasks.solve_stage import solve_case
from memplan.tasks.trace import trace
from memplan.tasks.validate.stage import validate_plan, validate_plans

ROOT = Path(__file__).resolve().parents[1]
CELLS = [("dtr", Budget(max_overhead=0.05)), ("dtr", Budget(max_overhead=0.25)),
         ("ap-greedy", Budget(max_overhead=0.05)), ("ap-greedy", Budget(max_overhead=0.25)),
         ("acg", Budget(max_overhead=0.05)), ("acg", Budget(max_overhead=0.25)),
         ("ap-greedy", Budget(fraction=0.7)), ("ap-greedy", Budget(fraction=0.5)),
         ("linearized-greedy", Budget(fraction=0.7)), ("linearized-greedy", Budget(fraction=0.5))]


def gpt2(layers: int) -> ModelConfig:
    return ModelConfig(name=f"gpt2-{layers}l", transformers="gpt2", loss="causal_lm", batch_sizes=[4],
                       kwargs=dict(n_layer=layers, n_embd=256, n_head=4, n_positions=256, vocab_size=2048,
                                   bos_token_id=0, eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0),
                       inputs=[{"shape": [256], "dtype": "int64", "high": 2048}])


def old_validate_module(commit: str) -> types.ModuleType:
    """tasks/validate/stage.py as of `commit`, imported under another name."""
    source = subprocess.run(["git", "show", f"{commit}:tasks/validate/stage.py"], cwd=ROOT, check=True,
                            capture_output=True, text=True).stdout
    module = types.ModuleType("validate_before")
    sys.modules[module.__name__] = module
    exec(compile(source, f"{commit}:tasks/validate/stage.py", "exec"), module.__dict__)
    return module


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--plans", type=int, default=10)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--max-steps", type=int, default=20)
    ap.add_argument("--before-commit", default="e0ac469")
    ap.add_argument("--modes", nargs="+", default=["before", "after", "shared"])
    args = ap.parse_args()
    console = Console()
    spec, batch, device, seed = gpt2(args.layers), 4, "cpu", 0
    settings = ValidateConfig(steps=args.steps, max_steps=args.max_steps)
    work = Path(tempfile.mkdtemp(prefix="memplan-validation-time-"))

    start = time.perf_counter()
    traced, graph = trace(spec, batch, device, seed, work / "cache")
    run = profile_graph(graph, device, ProfileSettings(1, 3, seed), model=spec.name, root=work / "store",
                        progress=False)
    plans, names = [], []
    for solver, budget in CELLS[: args.plans]:
        solved = solve_case(traced.path, solver, budget, PlanSettings(), run.device, str(work / "store"),
                            str(work / f"{solver}-{budget.label}.json"))
        if solved.feasible:
            plans.append(Plan.load(solved.plan_path))
            names.append(f"{solver} {budget.label}")
    console.print(f"{spec.name} b{batch}: {traced.nodes} nodes; traced, profiled and solved {len(plans)} plans in "
                  f"{time.perf_counter() - start:.0f} s; validate steps {args.steps}, max_steps {args.max_steps}")

    seconds, results = {}, {}
    for mode in args.modes:
        start = time.perf_counter()
        if mode == "before":
            old = old_validate_module(args.before_commit)
            results[mode] = [old.validate_plan(p, spec, batch, device, seed, settings, graph=graph) for p in plans]
        else:
            reference = measure_reference(spec, batch, device, seed, work / f"{mode}-reference.safetensors")
            if mode == "after":
                results[mode] = [validate_plan(p, spec, batch, device, seed, settings, reference, graph) for p in plans]
            else:
                results[mode] = validate_plans(plans, spec, batch, device, seed, settings, reference, graph)
        seconds[mode] = time.perf_counter() - start
        console.print(f"{mode}: {seconds[mode]:.0f} s", highlight=False)

    first = args.modes[0]
    totals = Table("mode", "validation s", f"ratio to {first}", "timed rounds (sum)", "median ± of overheads",
                   "passed")
    for mode in args.modes:
        halves = [max(v.overhead - v.overhead_interval[0], v.overhead_interval[1] - v.overhead)
                  for v in results[mode] if v.overhead_interval is not None]
        totals.add_row(mode, f"{seconds[mode]:.0f}", f"{seconds[mode] / seconds[first]:.2f}",
                       str(sum(v.timed_steps or 0 for v in results[mode])),
                       f"{statistics.median(halves):.1%}" if halves else "",
                       f"{sum(v.passed for v in results[mode])} of {len(plans)}")
    console.print(totals)
    rows = Table("plan", *(f"{m} verdict / overhead" for m in args.modes), "same verdicts")
    for i, name in enumerate(names):
        cells = [results[m][i] for m in args.modes]
        rows.add_row(name, *(f"{'pass' if v.passed else 'FAIL'} {v.overhead:+.1%}" for v in cells),
                     "yes" if len({v.passed for v in cells}) == 1 else "NO")
    console.print(rows)


if __name__ == "__main__":
    main()
