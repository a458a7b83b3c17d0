"""`memplan solve`: one solver, one graph, one budget; prints the solve report and writes the plan."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional, get_args

import typer

from memplan.flows.commands.query import StoreOption
from memplan.flows.locations import ConfigOption, locate
from memplan.tasks.solve.core.solution import DEFAULT_BACKEND, DEFAULT_GAP, DEFAULT_TIME_LIMIT_S


def solvers_help() -> str:
    """The registry as help text: each solver, its summary and its options."""
    from memplan.tasks.solve import SOLVERS, describe_options

    lines = ["Solvers and their options (--option KEY=VALUE):", ""]
    for spec in SOLVERS.values():
        lines.append(f"  {spec.name}: {spec.summary}")
        for o in describe_options(spec):
            lines.append(f"      {o.name} ({o.type}, default {o.default!r}): {o.help}")
    return "\n".join(lines)


def register(app: typer.Typer) -> None:
    @app.command(epilog=solvers_help(), context_settings={"help_option_names": ["--help", "-h"]})
    def solve(
        graph: Annotated[Path, typer.Option(help="A memplan-graph JSON (costs from the profile store) or a "
                                                 "node-link benchmark graph.")],
        solver: Annotated[str, typer.Option(help="Solver name (listed below).")],
        budget: Annotated[str, typer.Option(help="Memory budget, as in pipeline.toml: bytes (2000000000), a size "
                                                  "('1.5 GiB'), or a fraction of the checkpoint-all peak (0.8, '80%').")],
        option: Annotated[Optional[list[str]], typer.Option(
            "--option", help="A solver option KEY=VALUE (VALUE as in TOML: mode=memory, keep=[1,2]); repeatable.")] = None,
        time_limit: Annotated[float, typer.Option(help="Seconds for the solve (incumbent kept).")] = DEFAULT_TIME_LIMIT_S,
        gap: Annotated[float, typer.Option(help="Relative optimality gap at which MILP solvers stop.")] = DEFAULT_GAP,
        backend: Annotated[str, typer.Option(help="MILP backend: auto (Gurobi when its license covers the model, "
                                                  "else HiGHS), highs, gurobi.")] = DEFAULT_BACKEND,
        threads: Annotated[Optional[int], typer.Option(help="Solver threads (default: the backend's choice).")] = None,
        addresses: Annotated[str, typer.Option(help="Arena addresses for the plan's value copies: none, greedy or olla "
                                                          "(location ILP).")] = "none",
        variants: Annotated[str, typer.Option(help="Implementation variants the solver may choose: all, "
                                                   "bit-identical (the variants the profile found to give the "
                                                   "captured op's bits) or none "
                                                   "(as a plan's `variants` in pipeline.toml).")] = "all",
        device: Annotated[Optional[str], typer.Option(help="Device whose profile supplies the costs of a "
                                                           "memplan graph (default: newest profile).")] = None,
        store: StoreOption = None,
        config: ConfigOption = None,
        json_output: Annotated[bool, typer.Option("--json", help="Print one JSON object (the solve report).")] = False,
        out: Annotated[Optional[Path], typer.Option(help="Write the plan JSON here.")] = None,
        progress: Annotated[bool, typer.Option(help="Log solver progress (incumbent, bound, gap) on stderr.")] = True,
    ) -> None:
        """Solve for a schedule within a memory budget and report objective, peak, bound and gap."""
        import json
        import logging

        from memplan.flows.console import console, errors, exit_on_error, stdout_for_results_only

        with exit_on_error(), stdout_for_results_only(json_output):
            from memplan.tasks.config import Addresses, parse_budget_text, parse_option_text
            from memplan.tasks.problems import VARIANT_RULES, load_problem
            from memplan.tasks.solve import SOLVERS, OptionError, parse_options
            from memplan.tasks.solve.core.milp import BACKENDS
            from memplan.tasks.solve.core.solution import Gap, SolveOptions, Threads, TimeLimit, check_solve_value
            from memplan.tasks.solve_stage import plan_of, solve_loaded

            if solver not in SOLVERS:
                raise typer.BadParameter(f"unknown solver {solver!r}; choose one of {', '.join(SOLVERS)}.",
                                         param_hint="--solver")
            if backend not in BACKENDS:
                raise typer.BadParameter(f"unknown backend {backend!r}; choose one of {', '.join(BACKENDS)}.",
                                         param_hint="--backend")
            if out is not None and out.is_dir():
                errors().print(f"error: --out {out} is a folder; give a file name for the plan.", style="red",
                               markup=False)
                raise typer.Exit(1)
            if addresses not in get_args(Addresses):
                raise typer.BadParameter(f"{addresses!r}; choose none, greedy or olla.", param_hint="--addresses")
            if variants not in VARIANT_RULES:
                raise typer.BadParameter(f"{variants!r}; choose {', '.join(VARIANT_RULES)}.", param_hint="--variants")
            try:
                budget_spec = parse_budget_text(budget)
                if budget_spec.eager_fraction is not None:
                    raise ValueError(f"{budget!r} is a fraction of eager PyTorch's measured peak, which `memplan run` "
                                     "measures (its reference stage); give memplan solve bytes ('512 MiB') or a "
                                     "fraction of the checkpoint-all peak ('60%').")
            except ValueError as exc:
                raise typer.BadParameter(str(exc), param_hint="--budget") from None
            try:
                pairs = [parse_option_text(o) for o in option or []]
                repeated = sorted({key for key, _ in pairs if sum(k == key for k, _ in pairs) > 1})
                if repeated:
                    raise ValueError(f"option {', '.join(repeated)} given more than once; give each option once.")
                params = parse_options(SOLVERS[solver], dict(pairs), "--option")
            except (OptionError, ValueError) as exc:
                raise typer.BadParameter(str(exc), param_hint="--option") from None
            for flag, rule, value in (("--time-limit", TimeLimit, time_limit), ("--gap", Gap, gap),
                                      ("--threads", Threads, threads)):
                if value is not None:
                    try:
                        check_solve_value(rule, value)
                    except ValueError as exc:
                        raise typer.BadParameter(str(exc), param_hint=flag) from None
            options = SolveOptions(time_limit=time_limit, gap=gap, backend=backend, threads=threads, params=params)
            if progress:
                handler = logging.StreamHandler()
                handler.setFormatter(logging.Formatter("%(message)s"))
                logging.getLogger("memplan.solve").addHandler(handler)
                logging.getLogger("memplan.solve").setLevel(logging.INFO)
            where = locate(config, store)
            if progress and not json_output:
                where.say(plans=False)
            loaded = load_problem(graph, device=device, store=where.store, variants=variants)
            try:
                solution, eager = solve_loaded(loaded, solver, budget_spec, options, addresses)
            except RuntimeError as exc:          # a requested backend that cannot run this model
                errors().print(f"error: {exc}", style="red", markup=False)
                raise typer.Exit(1) from None
            report = {**solution.report(), "checkpoint_all_peak_bytes": eager.peak_bytes,
                      "checkpoint_all_cost": eager.compute_cost, "graph": str(graph)}
            if out is not None and solution.feasible:
                plan_of(loaded, solution, loaded.device).save(out)
                report["plan"] = str(out)
        with exit_on_error():
            if json_output:
                typer.echo(json.dumps(report))
            else:
                _print_report(console(), report)
            if not solution.feasible:
                written = f"no plan written to {out}: " if out is not None else ""
                errors().print(f"error: {written}{solver} found no schedule within {solution.budget_bytes} bytes "
                               f"({solution.status}).", style="red", markup=False)
                raise typer.Exit(1)


def _print_report(console, report: dict) -> None:
    from rich.table import Table

    table = Table("key", "value", title=f"memplan solve: {report['solver']} on {report['graph']}")
    for key, value in report.items():
        if key not in ("solver", "graph") and value not in (None, ""):
            table.add_row(key, f"{value:.6g}" if isinstance(value, float) else str(value))
    console.print(table)
