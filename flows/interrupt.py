"""Ctrl-C for every `memplan` command: stop at once, leave no process behind, and clean up after killed runs.

`run_cli` runs the command line in a worker thread and keeps the main thread free for signals: a
DuckDB query, a HiGHS or Gurobi solve or a torch kernel holds the worker inside native code, where
Python's own Ctrl-C (a KeyboardInterrupt at the next bytecode) would wait for it to return. On SIGINT,
SIGTERM or SIGHUP the main thread ends the command's process tree, prints one line and exits with 128 +
the signal number (130 for Ctrl-C) without waiting for the work to wind down: stages that finished have
their results stored already, and every file is written under a temporary name and renamed, so nothing
half-written is left.

Every process a run starts (Prefect's ephemeral uvicorn server first) inherits `MEMPLAN_RUN_OWNER`, the
run's pid and start time. A run killed with SIGKILL cannot end them; the next run ends the processes
whose owner run no longer exists (`reap_orphans`). What the run's child processes write to stderr
(Prefect's server, which gets the terminal's Ctrl-C too) goes to a log file, not the terminal.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator

OWNER = "MEMPLAN_RUN_OWNER"
MESSAGE = "interrupted; completed stages are cached"
SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
_said = ["interrupted"]                          # the line printed on a signal: MESSAGE while a run is on


def _stamp(process) -> str:
    return f"{process.pid}:{process.create_time():.2f}"


def _alive(stamp: str) -> bool:
    import psutil

    pid, _, created = stamp.partition(":")
    try:
        return pid.isdigit() and f"{float(created):.2f}" == f"{psutil.Process(int(pid)).create_time():.2f}"
    except (psutil.Error, ValueError):
        return False


def reap_orphans() -> list[int]:
    """End the processes left by memplan runs that no longer exist; return their pids."""
    import psutil

    reaped = []
    for process in psutil.process_iter():
        try:
            owner = process.environ().get(OWNER)
        except psutil.Error:
            continue
        if owner and not _alive(owner):
            reaped.append(process)
    _end(reaped)
    return [process.pid for process in reaped]


def _end(processes) -> None:
    import psutil

    for process in processes:
        try:
            process.terminate()
        except psutil.Error:
            pass
    _, alive = psutil.wait_procs(processes, timeout=3)
    for process in alive:
        try:
            process.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(alive, timeout=2)


def _on_signal(signum: int, frame) -> None:
    import psutil

    for other in SIGNALS:                           # a second Ctrl-C does not interrupt the clean-up
        signal.signal(other, signal.SIG_IGN)
    _end(psutil.Process().children(recursive=True))
    sys.stderr.write(_said[-1] + "\n")
    sys.stderr.flush()
    os._exit(128 + signum)


def run_cli(main: Callable[[], Any]) -> None:
    """Run `main` (the typer app) as the module says: in a worker thread, with SIGINT, SIGTERM and SIGHUP
    handled by this (the main) thread; exit with the command's status. Called from elsewhere than the main
    thread, `main` just runs."""
    if threading.current_thread() is not threading.main_thread():
        main()
        return
    outcome: dict[str, Any] = {}

    def work() -> None:
        try:
            main()
        except SystemExit as exc:
            outcome["code"] = exc.code
        except BaseException as exc:              # re-raised in the main thread: the traceback of --debug
            outcome["error"] = exc

    for signum in SIGNALS:
        signal.signal(signum, _on_signal)
    worker = threading.Thread(target=work, name="memplan-command", daemon=True)
    worker.start()
    while worker.is_alive():
        worker.join(0.2)
    if "error" in outcome:
        raise outcome["error"]
    sys.exit(outcome.get("code", 0))


def _signals_are_ours() -> bool:
    """Whether `run_cli` handles this process's signals (not so for a test's in-process CliRunner)."""
    return signal.getsignal(signal.SIGINT) is _on_signal and sys.stderr is sys.__stderr__


@contextmanager
def stopping_cleanly(log: Path) -> Iterator[None]:
    """Around a run: reap orphans of killed runs, mark the processes this run starts, say that completed
    stages are cached when a signal stops it, and send the children's stderr to `log`. Enter before
    Prefect is imported (its log handlers take `sys.stderr`). In-process callers (a test's CliRunner)
    get only the reaping: their file descriptors are not ours to change."""
    import psutil

    reap_orphans()
    if not _signals_are_ours():
        yield
        return
    owner, stderr = os.environ.get(OWNER), sys.stderr
    os.environ[OWNER] = _stamp(psutil.Process())
    terminal = _quiet_children(log)
    _said.append(MESSAGE)
    try:
        yield
    finally:
        _said.pop()
        sys.stderr.flush()
        os.dup2(terminal, 2)
        sys.stderr = stderr
        if owner is None:
            os.environ.pop(OWNER, None)
        else:
            os.environ[OWNER] = owner


def _quiet_children(log: Path) -> int:
    """Point file descriptor 2, which child processes inherit, at `log`; this process keeps writing to the
    terminal through a new `sys.stderr` on a duplicate of it (returned)."""
    sys.stderr.flush()
    terminal = os.dup(2)
    log.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 2)
    os.close(fd)
    sys.stderr = os.fdopen(terminal, "w", buffering=1, encoding=sys.__stderr__.encoding, errors="backslashreplace",
                           closefd=False)
    return terminal
