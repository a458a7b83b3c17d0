"""Random layered graphs (MOCCASIN's n100..n1000) at fractions of the no-recomputation peak of their order.

    python bench/random_layered.py                                   # dtr, n250/n500/n1000, 0.9 and 0.8
    python bench/random_layered.py --sizes 250 --solvers dtr moccasin --time-limit 600

Columns, side by side for one run: status, cost / sum of node costs (a lower bound on any schedule's
cost, so <= 1.05 proves a schedule within 5% of the optimum), peak / budget (the simulator's), solve
seconds, and seconds to within 5% of sum(cost) (the first incumbent doing so, for the solvers that
report progress; else the solve time when the answer is within 5%).

Measured 2026-11-25 on the shared 2-core machine (load average 2.5-4 from other jobs), 1 thread
(OMP_NUM_THREADS=1), budgets 0.9 and 0.8 of the default order's no-recomputation peak. cost / sum(cost)
(within 5% of the optimum when <= 1.05), seconds to the first schedule (= to within 5% in every row) and
in all:

    graph   budget  dtr (600 s limit)        moccasin (300 s limit)
    n100    0.9     1.0079  0.1 s / 0.3 s
    n100    0.8     1.0230  0.1 s / 0.5 s
    n250    0.9     1.0000  0.1 s / 0.5 s
    n250    0.8     1.0236  0.3 s / 1.1 s    1.0160  1.0 s / 300 s
    n500    0.9     1.0064  0.5 s / 2.2 s
    n500    0.8     1.0319  0.9 s / 5.9 s    1.0369  3.9 s / 300 s
    n1000   0.9     1.0043  2.2 s / 21 s
    n1000   0.8     1.0241  4.8 s / 36 s     1.0240  32 s / 300 s

dtr's schedules at these budgets come from its peak-directed insertion greedy (tasks/solve/core/peak_insertion.py;
before it dtr found none within 5% at 0.8 and none for n1000); moccasin starts from that greedy's schedule
made frontier-advancing (max_copies 2) and CP-SAT lowers the cost from there (n250: 1.0236 -> 1.0160;
n500: 1.0441, its start with at most 2 copies, -> 1.0369; n1000: 1.0241 -> 1.0240). Before that start
moccasin found no schedule for n500 in 600 s (bench/exact_solvers.py). The eight dtr rows take about 70 s.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from memplan.tasks.solve import solve  # noqa: E402
from memplan.tasks.solve.core.benchmarks import benchmark_graphs  # noqa: E402
from memplan.tasks.solve.core.problem import Problem  # noqa: E402
from memplan.tasks.solve.core.simulator import default_schedule, simulate  # noqa: E402
from memplan.tasks.solve.core.solution import Solution, SolveOptions  # noqa: E402

WITHIN = 1.05


def seconds_to_within(sol: Solution, lower: float) -> float | None:
    """Seconds until the solver held a schedule costing at most WITHIN x `lower`."""
    if not sol.feasible or sol.objective > WITHIN * lower:
        return None
    hit = next((p.seconds for p in sol.progress if p.incumbent is not None and p.incumbent <= WITHIN * lower), None)
    return sol.solve_seconds if hit is None else hit


def fmt(x, spec: str = ".3f") -> str:
    return "-" if x is None else format(x, spec)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", nargs="*", type=int, default=[250, 500, 1000])
    parser.add_argument("--fractions", nargs="*", type=float, default=[0.9, 0.8])
    parser.add_argument("--solvers", nargs="*", default=["dtr"])
    parser.add_argument("--time-limit", type=float, default=600.0, help="seconds per solve (default 600)")
    args = parser.parse_args()
    paths = [p for n in args.sizes for p in benchmark_graphs() if p.stem.startswith(f"random_layered_n{n}_")]

    table = Table("graph", "budget", "solver", "status", "cost/sum(cost)", "peak/budget", "seconds", "t within 5%",
                  title=f"random layered graphs (time limit {args.time_limit:g} s per solve)")
    for path in paths:
        problem = Problem.from_node_link(path)
        lower = float(problem.cost.sum())
        peak = simulate(problem, default_schedule(problem)).peak_bytes
        for fraction in args.fractions:
            budget = int(fraction * peak)
            for solver in args.solvers:
                sol = solve(problem, solver, budget, SolveOptions(time_limit=args.time_limit, portfolio=False))
                print(f"{path.stem} {fraction:g} {solver}: {sol.status} {sol.objective} in {sol.solve_seconds:.1f} s",
                      file=sys.stderr, flush=True)
                table.add_row(path.stem.split("_w")[0], f"{fraction:g}", solver, sol.status,
                              fmt(None if sol.objective is None else sol.objective / lower, ".4f"),
                              fmt(None if sol.predicted_peak_bytes is None else sol.predicted_peak_bytes / budget),
                              f"{sol.solve_seconds:.1f}", fmt(seconds_to_within(sol, lower), ".1f"))
    Console(width=160).print(table)


if __name__ == "__main__":
    main()
