"""Exact solvers side by side: time to a schedule, and to within 5% / 2% of the best known cost.

    python bench/exact_solvers.py --graphs random_layered_n250 random_layered_n500 --fractions 0.8 \
        --solvers moccasin checkmate --time-limit 600 --threads 1
    python bench/exact_solvers.py --graphs opgraph:resnet50 opgraph:gpt2 --fractions 0.7

A graph is a benchmark file stem (prefix match, shared/benchmarks/graphs) or `opgraph:NAME`, the
project's operator graph JSON cached at .cache/opgraph_NAME.json (bench/peers.py's workloads, captured
with `runtime.capture`; unit node costs). Budgets are fractions of the no-recomputation peak of the
default order. Each solver runs alone (no portfolio: the cheap solvers' answers are listed beside it).
Columns: feasible, cost relative to no recomputation (sum of node costs), proven gap, seconds to the
first schedule, to within 5% and 2% of the best known cost (the least cost any row of this run reached,
or `--best-known`), and in all. Progress comes from the solvers' incumbent logs.

Measured 2026-11-25 on the shared 2-core machine (load average 17-24 from other jobs: one solve got about
1/8 of a core), 1 thread, budget 0.8 of the eager peak; ap-greedy and acg find no schedule on any of them:
- random_layered_n250: moccasin (memory order) first schedule at 68 s, 1.0282x the no-recomputation cost at
  300 s, proven gap 2.7% (bound: sum of costs); within 5% of its best at 83 s. With the default order
  (Checkmate's space) phase 1 was still at 125550 bytes for a 117472 budget after 273 s, and with CP-SAT
  presolve on the first (hinted) solution came only after 277 s.
- random_layered_n500: no schedule in 600 s (phase 1 from 278270 to 277310 bytes, budget 227551).
- random_layered_n1000: not run (n500 already out of reach at this share of a core).
These moccasin rows predate its insertion start (phase 1 skipped): bench/random_layered.py has the newer ones.
Operator graphs at 0.7 (unit costs, 120 s limits, same machine): ResNet-50 (408 nodes): moccasin and
checkmate (MILP, 479k variables) find nothing; best known hierarchical 1.049x at 94 s (acg 1.22x, ap-greedy
1.28x). GPT-2 6L (320 nodes): moccasin nothing; checkmate 1.081x at 22 s (its remat-greedy start, gap
7.5%), best known hierarchical 1.050x at 87 s.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from memplan.tasks.solve import solve  # noqa: E402
from memplan.tasks.solve.core.benchmarks import benchmark_graphs  # noqa: E402
from memplan.tasks.solve.core.problem import Problem  # noqa: E402
from memplan.tasks.solve.core.simulator import default_schedule, simulate  # noqa: E402
from memplan.tasks.solve.core.solution import Solution, SolveOptions  # noqa: E402

CHEAP = ("remat-greedy", "ap-greedy", "acg")


def load(graph: str) -> Problem:
    if graph.startswith("opgraph:"):
        from memplan.runtime.format.graph import OpGraph

        name = graph.split(":", 1)[1]
        path = ROOT / ".cache" / f"opgraph_{name}.json"
        if not path.exists():
            raise SystemExit(f"{path} is missing: capture it first (bench/peers.py's workload {name!r}, "
                             f"runtime.capture(...).save(path)).")
        return Problem.from_graph(OpGraph.load(path))
    paths = [p for p in benchmark_graphs() if p.stem.startswith(graph)]
    if len(paths) != 1:
        raise SystemExit(f"graph {graph!r} matches {len(paths)} benchmark files; give a longer prefix.")
    return Problem.from_node_link(paths[0])


def seconds_to(sol: Solution, target: float | None) -> float | None:
    """First time the solver's incumbent cost was at most `target` (None: never)."""
    if target is None or not sol.feasible:
        return None
    hits = [p.seconds for p in sol.progress if p.incumbent is not None and p.incumbent <= target * (1 + 1e-9)]
    if hits:
        return min(hits)
    return sol.solve_seconds if sol.objective <= target * (1 + 1e-9) else None


def first_feasible(sol: Solution) -> float | None:
    if not sol.feasible:
        return None
    return min((p.seconds for p in sol.progress if p.incumbent is not None), default=sol.solve_seconds)


def fmt(x, spec: str = ".1f") -> str:
    return "-" if x is None else format(x, spec)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--graphs", nargs="+", required=True)
    parser.add_argument("--fractions", nargs="+", type=float, default=[0.8])
    parser.add_argument("--solvers", nargs="+", default=["moccasin", "checkmate"])
    parser.add_argument("--time-limit", type=float, default=600.0, help="seconds per solve (default 600)")
    parser.add_argument("--cheap", nargs="*", default=list(CHEAP), help="cheap solvers listed beside (60 s each)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--gap", type=float, default=1e-4)
    parser.add_argument("--option", action="append", default=[], metavar="SOLVER.KEY=VALUE",
                        help="a solver option, e.g. moccasin.max_copies=3")
    parser.add_argument("--best-known", type=float, action="append", default=[], metavar="COST",
                        help="best known cost per (graph, fraction), in order; default: best of this run")
    parser.add_argument("--json", type=Path, help="also write the rows here")
    parser.add_argument("--progress", action="store_true", help="log solver progress on stderr")
    args = parser.parse_args()
    if args.progress:
        logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    params: dict[str, dict] = {}
    for item in args.option:
        key, value = item.split("=", 1)
        solver, name = key.split(".", 1)
        params.setdefault(solver, {})[name] = json.loads(value)

    console = Console(width=220)
    table = Table("graph", "nodes", "budget", "solver", "status", "cost/no-remat", "gap", "t first", "t 5%", "t 2%",
                  "seconds", "variables", "constraints",
                  title=f"exact solvers (time limit {args.time_limit:g} s, {args.threads} thread(s))")
    rows, known = [], list(args.best_known)
    for graph in args.graphs:
        problem = load(graph)
        eager = simulate(problem, default_schedule(problem))
        for fraction in args.fractions:
            budget = int(fraction * eager.peak_bytes)
            found: list[tuple[str, Solution]] = []
            for name in args.cheap:
                found.append((name, solve(problem, name, budget, SolveOptions(time_limit=60, threads=args.threads))))
            for name in args.solvers:
                options = SolveOptions(time_limit=args.time_limit, threads=args.threads, gap=args.gap,
                                       portfolio=False, params=params.get(name))
                sol = solve(problem, name, budget, options)
                found.append((name, sol))
                console.print(f"{graph} {fraction:g} {name}: {sol.status} {sol.objective} {sol.message}", style="dim")
            costs = [s.objective for _, s in found if s.feasible]
            best = known.pop(0) if known else min(costs, default=None)
            for name, sol in found:
                row = dict(graph=graph, nodes=problem.num_nodes, fraction=fraction, solver=name, status=sol.status,
                           ratio=sol.objective / eager.compute_cost if sol.feasible else None, gap=sol.gap,
                           first=first_feasible(sol), within5=seconds_to(sol, None if best is None else 1.05 * best),
                           within2=seconds_to(sol, None if best is None else 1.02 * best), seconds=sol.solve_seconds,
                           variables=sol.num_variables, constraints=sol.num_constraints,
                           best_known_ratio=None if best is None else best / eager.compute_cost)
                rows.append(row)
                table.add_row(graph, str(problem.num_nodes), f"{fraction:g}", name, sol.status, fmt(row["ratio"], ".4f"),
                              fmt(sol.gap, ".4f"), fmt(row["first"]), fmt(row["within5"]), fmt(row["within2"]),
                              f"{sol.solve_seconds:.1f}", fmt(sol.num_variables, "d"), fmt(sol.num_constraints, "d"))
    console.print(table)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
