"""Planning time on real operator graphs (issue #12 targets, 2 cores): how long `hierarchical` and `dtr`
take to plan, and how close their plans are to the best known cost.

    .venv/bin/python bench/planning_time.py [--workloads gpt2 resnet50] [--deep 24] [--threads 1]

For each workload of bench/peers.py (captured and profiled in this run) and each budget (0.7 of the
no-recomputation peak, and the least peak the cheap solvers below and `dtr` reach): the first
`hierarchical` solve of the graph (block ladders solved from scratch, so the time includes them) and a
second one at the other budget (ladders reused), and `dtr`'s solve, each against the best known cost at
that budget: the cheapest schedule of every solver run here (`hierarchical`, `dtr`, `module-checkpoint`,
`ap-greedy`, `linearized-greedy`, `acg`, `remat-greedy`). Target: within 5% of the best known cost in at most 60 s.
With `--deep N`, a GPT-2 of N layers (same width; unit costs, since profiling thousands of nodes takes
longer than the plan) is planned at 0.7 and 0.3 of its peak. Target: at most 5 minutes.
"""

from __future__ import annotations

import argparse
import time

import torch
from rich.console import Console
from rich.table import Table

from memplan import runtime
from memplan.tasks.solve import solve
from memplan.tasks.solve.hierarchical import solver as hierarchical_solver
from memplan.tasks.solve.core.problem import Problem
from memplan.tasks.solve.core.simulator import default_schedule, simulate
from memplan.tasks.solve.core.solution import SolveOptions

OURS = ("hierarchical", "dtr")
RIVALS = ("module-checkpoint", "ap-greedy", "linearized-greedy", "acg", "remat-greedy")
TRY_SMALLEST = (0.9, 0.7, 0.5, 0.4, 0.35, 0.3, 0.26, 0.22, 0.2, 0.18, 0.15, 0.12, 0.1)


def timed(problem: Problem, solver: str, budget: int):
    start = time.perf_counter()
    sol = solve(problem, solver, budget, SolveOptions(time_limit=300, portfolio=False))
    return sol, time.perf_counter() - start


def smallest(problem: Problem, full: int) -> float:
    """The least predicted peak (fraction of `full`) a rival solver (cheap, seconds) reaches at the
    budgets of TRY_SMALLEST, tried in turn until none fits."""
    least = 1.0
    for f in TRY_SMALLEST:
        found = [sol.predicted_peak_bytes / full for s in (*RIVALS, "dtr")
                 if (sol := timed(problem, s, int(f * full))[0]).feasible]
        if not found:
            break
        least = min(least, *found)
    return least


def rows_for(name: str, problem: Problem, fractions: list[float]) -> list[list[str]]:
    """One row per solver of OURS and budget: its seconds, its cost and the best known cost (sum of costs
    = 1)."""
    full = simulate(problem, default_schedule(problem)).peak_bytes
    total = problem.cost.sum()
    hierarchical_solver._LADDERS.clear()                   # the first solve pays for the block ladders
    rows = []
    for fraction in fractions:
        budget = int(fraction * full)
        results = {s: timed(problem, s, budget) for s in (*OURS, *RIVALS)}
        known = {s: sol.objective for s, (sol, _) in results.items() if sol.feasible}
        best_name = min(known, key=known.get, default="-")
        best = known.get(best_name, float("nan"))
        for solver in OURS:
            sol, seconds = results[solver]
            gap = sol.objective / best - 1 if sol.feasible else float("nan")
            rows.append([name, f"{problem.num_nodes}", f"{fraction:.2f}", solver, f"{seconds:.1f}",
                         f"{sol.objective / total:.3f}" if sol.feasible else "none", f"{best / total:.3f}",
                         best_name, f"{100 * gap:.1f}%",
                         "yes" if sol.feasible and seconds <= 60 and gap <= 0.05 else "no"])
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workloads", nargs="*", default=["gpt2", "resnet50"])
    ap.add_argument("--deep", type=int, default=24, help="layers of the deep GPT-2 (0: skip it)")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from peers import profiled_problem, workload

    table = Table("graph", "nodes", "budget", "solver", "seconds", "its cost", "best known", "best by", "gap",
                  "target met", title="planning time (hierarchical's first solve includes the block ladders)")
    for name in args.workloads:
        model, loss_fn, batch, *_ = workload(name)
        problem = profiled_problem(runtime.capture(model, loss_fn, batch), name)
        full = simulate(problem, default_schedule(problem)).peak_bytes
        for row in rows_for(name, problem, [0.7, smallest(problem, full)]):
            table.add_row(*row)
    if args.deep:
        import transformers

        config = transformers.GPT2Config(n_layer=args.deep, n_embd=256, n_head=4, n_positions=256, vocab_size=2048,
                                         bos_token_id=0, eos_token_id=0)
        model = transformers.GPT2LMHeadModel(config)
        graph = runtime.capture(model, lambda m, x: m(input_ids=x, labels=x).loss, (torch.randint(0, 2048, (4, 256)),))
        for row in rows_for(f"gpt2-{args.deep}L (unit costs)", Problem.from_graph(graph), [0.7, 0.3]):
            table.add_row(*row[:-1], "yes" if row[5] != "none" and float(row[4]) <= 300 else "no")
    Console(width=200).print(table)


if __name__ == "__main__":
    main()
