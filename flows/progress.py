"""A rich progress bar over pipeline stages, advanced by Prefect task state hooks (declared on the
tasks in `flows/steps.py`), so `memplan run` shows which stage is running."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator

_bar: dict[str, Any] = {}


@contextmanager
def stage_progress(total: int, description: str) -> Iterator[None]:
    """A progress bar over `total` pipeline stages, advanced by `stage_started`/`stage_finished`."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=Console(stderr=True), transient=True) as progress:
        _bar.update(progress=progress, task=progress.add_task(description, total=total))
        try:
            yield
        finally:
            _bar.clear()


def stage_started(task: Any, task_run: Any, state: Any) -> None:
    """Prefect `on_running` hook: show the running stage."""
    if _bar:
        _bar["progress"].update(_bar["task"], description=task_run.name)


def stage_finished(task: Any, task_run: Any, state: Any) -> None:
    """Prefect `on_completion`/`on_failure` hook: count the stage as done."""
    if _bar:
        _bar["progress"].update(_bar["task"], advance=1, description=f"{task_run.name}: {state.name.lower()}")
