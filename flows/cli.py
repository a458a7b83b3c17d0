"""The `memplan` command line.

Each command lives in its own module under `flows/commands/` and registers itself on `app` through a
`register(app)` function. Heavy libraries (torch, Prefect, DuckDB, HiGHS) are imported inside the
command bodies so that `memplan --help` stays fast.
"""

from __future__ import annotations

import importlib
import pkgutil

import typer

import memplan.flows.commands

app = typer.Typer(
    name="memplan",
    help="Memory planner for PyTorch training: trace, profile, solve, validate, publish.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

for _module in sorted(pkgutil.iter_modules(memplan.flows.commands.__path__), key=lambda m: m.name):
    importlib.import_module(f"memplan.flows.commands.{_module.name}").register(app)


def main() -> None:  # pragma: no cover - console entry point
    """`memplan`: the app, stopped promptly by Ctrl-C, SIGTERM or SIGHUP in any command (flows/interrupt.py)."""
    from memplan.flows.interrupt import run_cli

    run_cli(app)


if __name__ == "__main__":  # pragma: no cover
    main()
