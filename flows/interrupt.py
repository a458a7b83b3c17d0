"""Ctrl-C for `memplan run`: stop at once, leave no process behind, and clean up after killed runs.

Every process a run starts (Prefect's ephemeral uvicorn server first) inherits `MEMPLAN_RUN_OWNER`, the
run's pid and start time. On SIGINT or SIGTERM the run ends its own process tree, prints one line and
exits with 128 + the signal number (130 for Ctrl-C) without waiting for Prefect to wind down: stages
that finished have their results stored already, and every file is written under a temporary name and
renamed, so nothing half-written is left. A run killed with SIGKILL cannot do this; the next run ends
the processes whose owner run no longer exists (`reap_orphans`). What the run's child processes write
to stderr (Prefect's server, which gets the terminal's Ctrl-C too) goes to a log file, not the terminal.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

OWNER = "MEMPLAN_RUN_OWNER"
MESSAGE = "interrupted; completed stages are cached"


def _stamp(process) -> str:
    return f"{process.pid}:{process.create_time():.2f}"


def _alive(stamp: str) -> bool:
    import psutil

    pid, _, created = stamp.partition(":")
    try:
        return pid.isdigit() and f"{float(created):.2f}" == f"{psutil.Process(int(pid)).create_time():.2f}"
    except (psutil.Error, ValueError):
        return False


def reap_orphans() -> int:
    """End the processes left by memplan runs that no longer exist; return how many."""
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
    return len(reaped)


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

    signal.signal(signum, signal.SIG_IGN)           # a second Ctrl-C does not interrupt the clean-up
    _end(psutil.Process().children(recursive=True))
    sys.stderr.write(MESSAGE + "\n")
    sys.stderr.flush()
    os._exit(128 + signum)


@contextmanager
def stopping_cleanly(log: Path) -> Iterator[None]:
    """Around a run: reap orphans of killed runs, mark the processes this run starts, stop on SIGINT and
    SIGTERM as the module says, and send the children's stderr to `log`. Enter before Prefect is
    imported (its log handlers take `sys.stderr`). In-process callers (a test's CliRunner, another
    thread) get only the reaping: their signals and file descriptors are not ours to change."""
    import psutil

    reap_orphans()
    if threading.current_thread() is not threading.main_thread() or sys.stderr is not sys.__stderr__:
        yield
        return
    previous = {signum: signal.signal(signum, _on_signal) for signum in (signal.SIGINT, signal.SIGTERM)}
    owner, stderr = os.environ.get(OWNER), sys.stderr
    os.environ[OWNER] = _stamp(psutil.Process())
    terminal = _quiet_children(log)
    try:
        yield
    finally:
        sys.stderr.flush()
        os.dup2(terminal, 2)
        sys.stderr = stderr
        for signum, handler in previous.items():
            signal.signal(signum, handler)
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
