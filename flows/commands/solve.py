"""`memplan solve`: one solver, one graph, one budget; prints the solve report and writes the plan."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer


def register(app: typer.Typer) -> None:
    @app.command()
    def solve(
        graph: Annotated[Path, typer.Option(help="A memplan-graph JSON (costs from the profile store) or a "
                                                 "node-link benchmark graph.")],
        solver: Annotated[str, typer.Option(help="Solver name: checkmate, checkmate-approx, checkpoint-all, "
                                                  "chen-sqrt-n, chen-greedy, griewank-log-n, ap-sqrt-n, ap-greedy, "
                                                  "linearized-sqrt-n, linearized-greedy, ...")],
        budget: Annotated[str, typer.Option(help="Memory budget: bytes (2000000000, '1.5 GiB') or a fraction of "
                                                  "the checkpoint-all peak ('80%', 0.8).")],
        time_limit: Annotated[Optional[float], typer.Option(help="Seconds for MILP solvers (incumbent kept).")] = None,
        gap: Annotated[float, typer.Option(help="Relative optimality gap at which MILP solvers stop.")] = 1e-4,
        backend: Annotated[str, typer.Option(help="MILP backend: auto (Gurobi if fully licensed), highs, gurobi.")] = "auto",
        threads: Annotated[Optional[int], typer.Option(help="Solver threads (default: the backend's choice).")] = None,
        device: Annotated[Optional[str], typer.Option(help="Device whose profile supplies the costs of a "
                                                           "memplan graph (default: newest profile).")] = None,
        json_output: Annotated[bool, typer.Option("--json", help="Print one JSON object (the solve report).")] = False,
        out: Annotated[Optional[Path], typer.Option(help="Write the plan JSON here.")] = None,
        progress: Annotated[bool, typer.Option(help="Log solver progress (incumbent, bound, gap) on stderr.")] = True,
    ) -> None:
        """Solve for a schedule within a memory budget and report objective, peak, bound and gap."""
        import json
        import logging

        from flows.console import console, errors, exit_on_error

        with exit_on_error():
            from runtime.plan import Plan
            from tasks.config import parse_budget
            from tasks.solve import SOLVERS, solve as run_solver
            from tasks.solve.milp import BACKENDS
            from tasks.solve.simulator import default_schedule, simulate
            from tasks.solve.solution import SolveOptions

            if solver not in SOLVERS:
                raise typer.BadParameter(f"unknown solver {solver!r}; choose one of {', '.join(SOLVERS)}.",
                                         param_hint="--solver")
            if progress:
                handler = logging.StreamHandler()
                handler.setFormatter(logging.Formatter("%(message)s"))
                logging.getLogger("memplan.solve").addHandler(handler)
                logging.getLogger("memplan.solve").setLevel(logging.INFO)
            problem, costs = _load_problem(graph, device)
            eager = simulate(problem, default_schedule(problem))
            try:
                budget_bytes = parse_budget(_budget_value(budget)).resolve(eager.peak_bytes)
            except ValueError as exc:
                raise typer.BadParameter(str(exc), param_hint="--budget") from None
            if backend not in BACKENDS:
                raise typer.BadParameter(f"unknown backend {backend!r}; choose one of {', '.join(BACKENDS)}.",
                                         param_hint="--backend")
            try:
                solution = run_solver(problem, solver, budget_bytes, SolveOptions(
                    time_limit=time_limit, gap=gap, backend=backend, threads=threads))
            except RuntimeError as exc:          # a requested backend that cannot run this model
                errors().print(f"error: {exc}", style="red")
                raise typer.Exit(1) from None
            report = {**solution.report(), "checkpoint_all_peak_bytes": eager.peak_bytes,
                      "checkpoint_all_cost": eager.compute_cost, "graph": str(graph)}
            if out is not None and solution.feasible:
                plan = Plan.load(solution.to_plan(problem, device=costs.device if costs else None,
                                                  profile_run_id=costs.run_id if costs else None))
                plan.save(out)
                report["plan"] = str(out)
            if json_output:
                typer.echo(json.dumps(report))
            else:
                _print_report(console(), report)
            if out is not None and not solution.feasible:
                errors().print(f"error: no plan written to {out}: {solver} found no schedule within "
                               f"{budget_bytes} bytes ({solution.status}).", style="red")
                raise typer.Exit(1)


def _budget_value(text: str) -> int | float | str:
    """`2000000000` -> bytes, `0.8` -> fraction, anything else ('80%', '1.5 GiB') as text."""
    try:
        return int(text)
    except ValueError:
        try:
            return float(text)
        except ValueError:
            return text


def _load_problem(path: Path, device: str | None):
    """The Problem of a graph file, with the profile store's costs for a memplan graph."""
    import json

    from tasks.solve.problem import Problem, ProblemError

    try:
        head = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ProblemError(f"cannot read graph file {path}: {exc}. Pass a memplan-graph JSON or a node-link "
                           f"benchmark graph.") from None
    if isinstance(head, dict) and head.get("format") == "memplan-graph":
        from runtime.graph import OpGraph
        from tasks.store import load_costs

        graph = OpGraph.from_json(head, source=f"graph file {path}")
        costs = load_costs(graph.fingerprint, device)
        return Problem.from_graph(graph, costs), costs
    return Problem.from_node_link(path), None


def _print_report(console, report: dict) -> None:
    from rich.table import Table

    table = Table("key", "value", title=f"memplan solve: {report['solver']} on {report['graph']}")
    for key, value in report.items():
        if key not in ("solver", "graph") and value not in (None, ""):
            table.add_row(key, f"{value:.6g}" if isinstance(value, float) else str(value))
    console.print(table)
