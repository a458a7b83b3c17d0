"""What the pipeline commands share: the rich consoles, turning known failures into one red paragraph
and exit status 1, and Prefect's environment."""

from __future__ import annotations

import os
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import typer
from rich.console import Console
from rich.markup import escape


WIDTH_OFF_TERMINAL = 160


def console() -> Console:
    """The console for results (stdout). Its width follows `COLUMNS` at call time; off a terminal (logs,
    pipes) without `COLUMNS` it is WIDTH_OFF_TERMINAL rather than rich's 80, so tables are not cut."""
    width = None if "COLUMNS" in os.environ or sys.stdout.isatty() else WIDTH_OFF_TERMINAL
    return Console(soft_wrap=True, width=width)


@contextmanager
def stdout_for_results_only(active: bool = True) -> Iterator[None]:
    """While open (and `active`), everything written to file descriptor 1 (a native solver's banner, a
    library's print) goes to stderr instead, so that what the command prints after it, its `--json` or
    `--format` output, is all that stdout carries."""
    if not active:
        yield
        return
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    try:
        yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)


def errors() -> Console:
    """The console for errors (stderr)."""
    return Console(stderr=True, soft_wrap=True)


def known_errors() -> tuple[type[BaseException], ...]:
    """Failures with a message meant for the user (config, model, device, graph, plan, profile, solve)."""
    from memplan.runtime.format.graph import GraphFormatError
    from memplan.runtime.format.plan import PlanError
    from memplan.tasks.config import MemplanError

    found: list[type[BaseException]] = [MemplanError, PlanError, GraphFormatError]
    for module, name in (("memplan.tasks.store.profiles", "ProfileNotFoundError"), ("memplan.tasks.solve.core.problem", "ProblemError"),
                         ("memplan.tasks.solve.core.simulator", "InvalidSchedule"), ("memplan.runtime.tracing.capture", "CaptureError")):
        if module in sys.modules:  # only errors of modules that ran can have been raised
            found.append(getattr(sys.modules[module], name))
    return tuple(found)


@contextmanager
def exit_on_error(debug: bool = False) -> Iterator[None]:
    """Print a known failure as one paragraph on stderr and exit with status 1 (with `debug`, raise it: its
    traceback)."""
    try:
        yield
    except Exception as exc:
        if debug or not isinstance(exc, known_errors()):
            raise
        errors().print(f"error: {escape(str(exc))}", style="red")
        raise typer.Exit(1) from None


def prepare(config_path: Path, debug: bool = False) -> None:
    """Make modules next to `config_path` importable (model factories) and set Prefect's defaults:
    a patient ephemeral server, no analytics, warnings-only logs; unless `debug`, nothing of Prefect's
    on the terminal below CRITICAL (a failed stage's traceback stays in the Prefect logs of the run, and
    memplan prints its message once)."""
    from memplan.tasks.models import allow_imports_from

    allow_imports_from(Path(config_path).parent)
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")
    if not debug:
        os.environ.setdefault("PREFECT_LOGGING_HANDLERS_CONSOLE_LEVEL", "CRITICAL")
