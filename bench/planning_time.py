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

With `--overhead-sizes 200 400 800 1600` (issue #55), the `max_overhead` search instead
(`tasks.solve_stage.overhead_ladder` at `--max-overhead`, default 0.1): GPT-2s of about that many nodes (128 wide,
4 x 128 tokens, no dropout, profiled here with every implementation variant the graph offers), captured as the
executor plans them for `dtr`, `hierarchical` and `checkmate-approx` and as eager PyTorch runs them
(`capture_eager`) for `selective-policy`; per solver the search's seconds and solves, one plain solve at the
budget it chose (the unit of "solves' worth"), the chosen peak and predicted overhead, the solver whose schedule
it is (a portfolio solver's may be a cheap solver's, `Solution.source`), and with `--before` the
bisection it replaced (one plain solve per probe, `bisect_budget`) for comparison. `--overhead-solvers` picks
the solvers, `--slow-up-to` the largest size at which `hierarchical` and `checkmate-approx` run (minutes).
Target: `dtr` and `selective-policy` within 10 s at 800 nodes, about 3 solves' worth.
"""

from __future__ import annotations

import argparse
import time
from unittest import mock

import torch
from rich.console import Console
from rich.table import Table

from memplan import runtime
from memplan.tasks.solve import solve
from memplan.tasks.solve.hierarchical import solver as hierarchical_solver
from memplan.tasks.solve.core.problem import Problem
from memplan.tasks.solve.core.simulator import Simulation, default_schedule, simulate
from memplan.tasks.solve.core.solution import SolveOptions, min_budget_lower_bound
from memplan.tasks import solve_stage
from memplan.tasks.solve_stage import bisect_budget, overhead_ladder

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


LAYERS = {200: (6, 4), 400: (12, 8), 800: (25, 16), 1600: (50, 33)}
"""GPT-2 layers giving about that many nodes: (executor graph, eager graph: selective checkpointing's, larger)."""


def gpt2_problems(layers: tuple[int, int]) -> tuple[Problem, Problem]:
    """The executor and eager-captured problems of `--overhead-sizes`' GPT-2s (module docstring), profiled here."""
    import transformers
    from peers import profiled_problem

    from memplan.runtime.policy.apply import capture_eager

    problems = []
    for capture, n_layer in zip((runtime.capture, capture_eager), layers):
        torch.manual_seed(0)
        config = transformers.GPT2Config(n_layer=n_layer, n_embd=128, n_head=4, n_positions=128, vocab_size=2048,
                                         bos_token_id=0, eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0,
                                         attn_pdrop=0.0)
        model = transformers.GPT2LMHeadModel(config)
        graph = capture(model, lambda m, x: m(input_ids=x, labels=x).loss, (torch.randint(0, 2048, (4, 128)),))
        problems.append(profiled_problem(graph, f"gpt2-{n_layer}L", "all" if capture is runtime.capture else "none"))
    return problems[0], problems[1]


def bisected(problem: Problem, solver: str, max_overhead: float, eager: Simulation) -> tuple[int, int]:
    """The search `overhead_ladder` replaced: a plain solve at the checkpoint-all peak, then `bisect_budget` with
    one plain solve per probe. Returns the least peak within the limit and the number of solves."""
    limit = (1 + max_overhead) * eager.compute_cost * (1 + 1e-12)
    solves = []

    def probe(budget: int) -> int | None:
        solves.append(solve(problem, solver, budget))
        found = solves[-1]
        return found.predicted_peak_bytes if found.feasible and found.objective <= limit else None

    top = probe(eager.peak_bytes)
    peak = bisect_budget(min(min_budget_lower_bound(problem), top) - 1, top, probe)
    return peak, len(solves)


def overhead_rows(size: int, solvers: list[str], max_overhead: float, before: bool, slow_up_to: int) -> list[list[str]]:
    """One row per solver: the `max_overhead` search on the GPT-2 of about `size` nodes (module docstring)."""
    executor, eager_graph = gpt2_problems(LAYERS[size])
    rows = []
    for solver in solvers:
        if solver in ("hierarchical", "checkmate-approx") and size > slow_up_to:
            continue
        problem = eager_graph if solver == "selective-policy" else executor
        eager = simulate(problem, default_schedule(problem))
        hierarchical_solver._LADDERS.clear()                   # the first solve pays for the block ladders
        solves = []

        def counted(*args, **kwargs):
            solves.append(args[2])
            return solve(*args, **kwargs)

        start = time.perf_counter()
        with mock.patch.object(solve_stage, "solve", counted):
            chosen = overhead_ladder(problem, solver, max_overhead, eager, SolveOptions(time_limit=300)).chosen
        seconds = time.perf_counter() - start
        hierarchical_solver._LADDERS.clear()
        start = time.perf_counter()
        solve(problem, solver, chosen.budget_bytes, SolveOptions(time_limit=300))
        one = time.perf_counter() - start
        row = [f"{problem.num_nodes}", solver, f"{seconds:.1f}", f"{len(solves)}", f"{seconds / one:.1f}", f"{one:.1f}",
               f"{chosen.predicted_peak_bytes / eager.peak_bytes:.4f}" if chosen.feasible else "none",
               f"{chosen.objective / eager.compute_cost - 1:+.2%}" if chosen.feasible else "-", chosen.source or solver]
        if before:
            start = time.perf_counter()
            peak, count = bisected(problem, solver, max_overhead, eager)
            row += [f"{time.perf_counter() - start:.1f}", f"{count}", f"{peak / eager.peak_bytes:.4f}"]
        rows.append(row)
        print(*row, flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workloads", nargs="*", default=["gpt2", "resnet50"])
    ap.add_argument("--deep", type=int, default=24, help="layers of the deep GPT-2 (0: skip it)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--overhead-sizes", type=int, nargs="*", choices=sorted(LAYERS), default=[],
                    help="time the max_overhead search on GPT-2s of about these many nodes instead")
    ap.add_argument("--overhead-solvers", nargs="*",
                    default=["dtr", "selective-policy", "hierarchical", "checkmate-approx"])
    ap.add_argument("--max-overhead", type=float, default=0.1)
    ap.add_argument("--before", action="store_true", help="also time the bisection the search replaced")
    ap.add_argument("--slow-up-to", type=int, default=400, help="largest size for hierarchical, checkmate-approx")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.overhead_sizes:
        table = Table("nodes", "solver", "search s", "solves", "solves' worth", "one solve s", "peak / no-recompute",
                      "predicted overhead", "schedule by", *(("bisection s", "its solves", "its peak") if args.before else ()),
                      title=f"max_overhead = {args.max_overhead:g} search time")
        for size in args.overhead_sizes:
            for row in overhead_rows(size, args.overhead_solvers, args.max_overhead, args.before, args.slow_up_to):
                table.add_row(*row)
        Console(width=200).print(table)
        return
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
