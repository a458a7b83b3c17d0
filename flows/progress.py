"""Progress over pipeline stages, advanced by Prefect task state hooks (declared on the tasks in `flows/steps.py`),
so `memplan run` shows which stage is running: a rich progress bar on a terminal, and where stderr is a file or a
pipe (a CI log, `2> run.log`) one line per stage as it starts and ends, with its time and the run's, and every
`HEARTBEAT_S` seconds a line naming the stages still running."""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager
from typing import Any, Iterator

_bar: dict[str, Any] = {}
_lines: dict[str, Any] = {}
_lock = threading.Lock()


@contextmanager
def stage_progress(total: int, description: str) -> Iterator[None]:
    """Progress over `total` pipeline stages, advanced by `stage_started`/`stage_finished`."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    console = Console(stderr=True)
    if not console.is_terminal:
        stop = threading.Event()
        _lines.update(console=console, total=total, done=0, start=time.monotonic(), started={})
        beat = threading.Thread(target=_heartbeat, args=(stop,), name="memplan-progress", daemon=True)
        beat.start()
        try:
            yield
        finally:
            stop.set()
            beat.join()
            with _lock:
                _lines.clear()
        return
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=console, transient=True) as progress:
        _bar.update(progress=progress, task=progress.add_task(description, total=total))
        try:
            yield
        finally:
            _bar.clear()


HEARTBEAT_S = 30.0
"""Where stderr is no terminal, a line every this many seconds names the stages still running."""


def _heartbeat(stop: threading.Event) -> None:
    """Until `stop`, every `HEARTBEAT_S` seconds: the stages running, for how long, and how many are done."""
    while not stop.wait(HEARTBEAT_S):
        with _lock:
            if _lines and _lines["started"]:
                now = time.monotonic()
                running = ", ".join(f"{name} for {now - since:.0f} s" for name, since in _lines["started"].items())
                _line(f"running: {running} ({_lines['done']} of about {_lines['total']} stages done)")


def _line(text: str) -> None:
    """One progress line, stamped with the run's elapsed time."""
    elapsed = time.monotonic() - _lines["start"]
    _lines["console"].print(f"[{elapsed:7.1f} s] {text}", markup=False, highlight=False, soft_wrap=True)


def stage_started(task: Any, task_run: Any, state: Any) -> None:
    """Prefect `on_running` hook: show the running stage."""
    if _bar:
        _bar["progress"].update(_bar["task"], description=task_run.name)
    with _lock:
        if _lines:
            _lines["started"][task_run.name] = time.monotonic()
            _line(f"{task_run.name}: started")


def stage_finished(task: Any, task_run: Any, state: Any) -> None:
    """Prefect `on_completion`/`on_failure` hook: count the stage as done."""
    if _bar:
        _bar["progress"].update(_bar["task"], advance=1, description=f"{task_run.name}: {state.name.lower()}")
    with _lock:
        if _lines:
            _lines["done"] += 1
            took = time.monotonic() - _lines["started"].pop(task_run.name, time.monotonic())
            _line(f"{task_run.name}: {state.name.lower()} in {took:.1f} s ({_lines['done']} of about "
                  f"{_lines['total']} stages)")
