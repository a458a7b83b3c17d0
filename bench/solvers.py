"""Solver bench: every solver on the public benchmark graphs at fractions of the checkpoint-all peak.

    python bench/solvers.py                               # all graphs, 0.9 and 0.8, every solver
    python bench/solvers.py --graphs ResNet50_256_224_224_3_train --fractions 0.8 --time-limit 600 --ablation

Columns, side by side for one run: feasible, objective relative to no recomputation (sum of node costs,
checkpoint-all), proven gap, seconds to the first feasible schedule and to a proven 2% gap, total
seconds, model size. `--ablation` runs `checkmate` with each formulation change switched on in turn:
paper FREE linearization (eq. 7a-7c) without warm start, the tight linearization, the remat-greedy
warm start with the sum-of-costs bound, and the dtr warm start (the default).
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from memplan.tasks.solve import SOLVERS, solve  # noqa: E402
from memplan.tasks.solve.core.benchmarks import benchmark_graphs  # noqa: E402
from memplan.tasks.solve.core.problem import Problem  # noqa: E402
from memplan.tasks.solve.core.simulator import default_schedule, simulate  # noqa: E402
from memplan.tasks.solve.core.solution import Solution, SolveOptions  # noqa: E402

ABLATION = {
    "paper, no warm start": {"formulation": "paper", "warm_start": "none"},
    "tight, no warm start": {"formulation": "tight", "warm_start": "none"},
    "tight + greedy start": {"formulation": "tight", "warm_start": "greedy"},
    "tight + dtr start": {"formulation": "tight", "warm_start": "dtr"},
}


def times(sol: Solution) -> tuple[float | None, float | None]:
    """Seconds to the first feasible schedule and to a proven gap of at most 2%."""
    if not sol.feasible:
        return None, None
    if not sol.progress:
        return sol.solve_seconds, sol.solve_seconds if sol.gap is not None and sol.gap <= 0.02 else None
    first = next((p.seconds for p in sol.progress if p.incumbent is not None), sol.solve_seconds)
    two = next((p.seconds for p in sol.progress if p.gap is not None and p.gap <= 0.02), None)
    return first, two


def fmt(x, spec: str = ".3f") -> str:
    return "-" if x is None else format(x, spec)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--graphs", nargs="*", help="graph file stems (default: all benchmark graphs)")
    parser.add_argument("--fractions", nargs="*", type=float, default=[0.9, 0.8])
    parser.add_argument("--solvers", nargs="*", default=list(SOLVERS))
    parser.add_argument("--time-limit", type=float, default=60.0, help="seconds per solve (default 60)")
    parser.add_argument("--gap", type=float, default=1e-4)
    parser.add_argument("--ablation", action="store_true", help="checkmate formulation variants instead")
    parser.add_argument("--progress", action="store_true", help="log MILP progress on stderr")
    args = parser.parse_args()
    if args.progress:
        logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    paths = [p for p in benchmark_graphs() if not args.graphs or p.stem in args.graphs]
    runs = ABLATION if args.ablation else {name: None for name in args.solvers}

    console = Console(width=200)
    table = Table("graph", "budget", "solver", "feasible", "cost/no-remat", "gap", "t first", "t 2%", "seconds",
                  "variables", "constraints", title=f"solver bench (time limit {args.time_limit:g} s per solve)")
    for path in paths:
        problem = Problem.from_node_link(path)
        eager = simulate(problem, default_schedule(problem))
        for fraction in args.fractions:
            budget = int(fraction * eager.peak_bytes)
            for label, params in runs.items():
                solver = "checkmate" if args.ablation else label
                options = SolveOptions(time_limit=args.time_limit, gap=args.gap, params=dict(params or {}))
                sol = solve(problem, solver, budget, options)
                first, two = times(sol)
                table.add_row(path.stem, f"{fraction:g}", label, "yes" if sol.feasible else sol.status,
                              fmt(sol.objective / eager.compute_cost if sol.feasible else None, ".4f"),
                              fmt(sol.gap, ".4f"), fmt(first, ".1f"), fmt(two, ".1f"), f"{sol.solve_seconds:.1f}",
                              fmt(sol.num_variables, "d"), fmt(sol.num_constraints, "d"))
                console.print(f"{path.stem} {fraction:g} {label}: {sol.status} {sol.message}", style="dim")
    console.print(table)


if __name__ == "__main__":
    main()
