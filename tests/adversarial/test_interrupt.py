"""Ctrl-C stops `memplan run` at once with one line and exit status 130, leaving no process behind; the
processes of a run killed outright are ended by the next run."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest

from memplan.flows.interrupt import MESSAGE, OWNER, reap_orphans

from .conftest import tiny_pipeline

REPO = Path(__file__).resolve().parents[2]


def _memplan_run(folder: Path) -> subprocess.Popen:
    """`memplan run` of `folder/pipeline.toml` in its own process group, with a Prefect home of its own."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "PREFECT_HOME": str(folder / "prefect-home")}
    return subprocess.Popen([sys.executable, "-m", "memplan.flows.cli", "run"], cwd=folder, env=env,
                            start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _start_run(folder: Path) -> tuple[subprocess.Popen, list[psutil.Process]]:
    """`memplan run` of the tiny pipeline, once it has started Prefect's server; returns the run and its process
    tree at that moment."""
    tiny_pipeline(folder, factory="torch.nn:Linear")
    run = _memplan_run(folder)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and run.poll() is None:
        children = psutil.Process(run.pid).children(recursive=True)
        if any("uvicorn" in " ".join(_cmdline(c)) for c in children):
            return run, [psutil.Process(run.pid), *children]
        time.sleep(0.2)
    run.kill()
    pytest.fail(f"memplan run started no server within 120 s: {run.communicate()}")


def _cmdline(process: psutil.Process) -> list[str]:
    try:
        return process.cmdline()
    except psutil.Error:
        return []


def _alive(processes: list[psutil.Process]) -> list[psutil.Process]:
    return [p for p in processes if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]


def _left_after(processes: list[psutil.Process], seconds: float = 5.0) -> list[psutil.Process]:
    """The processes of `processes` still alive `seconds` from now, or [] as soon as none is."""
    deadline = time.monotonic() + seconds
    while _alive(processes) and time.monotonic() < deadline:
        time.sleep(0.1)
    return _alive(processes)


def test_ctrl_c_stops_the_run_within_seconds_with_one_line_and_no_process_left(tmp_path):
    run, tree = _start_run(tmp_path)
    stamp = f"{run.pid}:{tree[0].create_time():.2f}"
    assert all(p.environ().get(OWNER) == stamp for p in tree[1:])    # what a later run reaps if this one is killed
    sent = time.monotonic()
    os.killpg(run.pid, signal.SIGINT)
    out, err = run.communicate(timeout=10)
    assert time.monotonic() - sent < 10
    assert run.returncode == 130
    assert err == MESSAGE + "\n" and out == ""
    assert _left_after(tree) == []


LONG_VALIDATION = """
[[models]]
name = "wide"
factory = "torch.nn:Linear"
kwargs = {{ in_features = 1024, out_features = 1024 }}
loss = "mse"
batch_sizes = [256]
inputs = [{{ shape = [1024] }}, {{ shape = [1024] }}]
[[plans]]
solver = "checkpoint-all"
budgets = [1.0]
[validate]
steps = {steps}
max_steps = {steps}
"""


def _stderr_lines(process: subprocess.Popen) -> list[str]:
    """The lines `process` writes to stderr, collected by a thread as they come."""
    lines: list[str] = []
    threading.Thread(target=lambda: lines.extend(iter(process.stderr.readline, "")), daemon=True).start()
    return lines


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["int", "term"])
def test_a_signal_during_validation_stops_the_run_within_two_seconds(tmp_path, signum):
    (tmp_path / "pipeline.toml").write_text('device = "cpu"\n' + LONG_VALIDATION.format(steps=5000))
    run = _memplan_run(tmp_path)
    lines = _stderr_lines(run)
    deadline = time.monotonic() + 300
    while run.poll() is None and time.monotonic() < deadline and not any(
            "validate" in line and line.rstrip().endswith(": started") for line in lines):
        time.sleep(0.2)
    assert run.poll() is None, (run.returncode, lines)
    time.sleep(1.0)                                            # inside the timing rounds' torch kernels
    tree = [psutil.Process(run.pid), *psutil.Process(run.pid).children(recursive=True)]
    sent = time.monotonic()
    os.killpg(run.pid, signum)
    run.wait(timeout=30)
    stopped_s = time.monotonic() - sent
    assert run.returncode == 128 + signum, lines
    assert stopped_s < 2, f"the run took {stopped_s:.1f} s to stop"
    assert _left_after(tree) == []
    assert lines[-1].strip() == MESSAGE, lines[-3:]


def test_the_next_run_ends_the_processes_of_a_killed_run_and_no_other(tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead_stamp = f"{dead.pid}:{psutil.Process(dead.pid).create_time():.2f}"
    dead.wait()                                              # a run that was killed: its stamp names no process
    me = psutil.Process()
    sleeper = [sys.executable, "-c", "import time; time.sleep(60)"]
    orphan = subprocess.Popen(sleeper, env={**os.environ, OWNER: dead_stamp})
    owned = subprocess.Popen(sleeper, env={**os.environ, OWNER: f"{me.pid}:{me.create_time():.2f}"})
    try:
        time.sleep(0.5)
        reaped = reap_orphans()                              # what `memplan run` does first
        # A `memplan run` of another test running alongside reaps every orphan too and may end this one
        # first, so the orphan may be missing from `reaped`; the owned process must never be in it.
        assert owned.pid not in reaped
        assert orphan.wait(timeout=5) is not None and owned.poll() is None
    finally:
        orphan.kill()
        owned.kill()


def test_sighup_ends_a_run_and_its_prefect_server(tmp_path):
    run, tree = _start_run(tmp_path)
    os.kill(run.pid, signal.SIGHUP)                      # the terminal closed: only the run gets the signal
    out, err = run.communicate(timeout=10)
    assert run.returncode == 128 + signal.SIGHUP and err == MESSAGE + "\n"
    assert _left_after(tree) == []


def _resnet50() -> str:
    from memplan.tasks.solve.core.benchmarks import benchmark_graphs

    return str(next(p for p in benchmark_graphs() if p.name == "ResNet50_256_224_224_3_train.json"))


def _in_native_code(process: subprocess.Popen, library: str, busy_s: float = 1.5, timeout: float = 60) -> None:
    """Wait until `process` has loaded the extension module `library` and then spent `busy_s` more seconds of
    CPU: the command's few Python lines between the import and the call (milliseconds; HiGHS's model build
    for resnet50 takes 0.4 s) are behind it, and it runs inside the native query or solve."""
    watched = psutil.Process(process.pid)
    deadline, loaded_at = time.monotonic() + timeout, None
    while time.monotonic() < deadline and process.poll() is None:
        try:
            used = sum(watched.cpu_times()[:2])
            if loaded_at is None and any(library in m.path for m in watched.memory_maps()):
                loaded_at = used
        except psutil.Error:
            break
        if loaded_at is not None and used - loaded_at >= busy_s:
            return
        time.sleep(0.1)
    assert process.poll() is None, process.communicate()
    pytest.fail(f"{library} was not busy in the command within {timeout} s")


@pytest.mark.parametrize("command, library, banner", [
    (["query", "SELECT sum(range) FROM range(100000000000000)"], "/_duckdb.", ""),      # DuckDB: in it for hours
    (["solve", "--graph", _resnet50(), "--solver", "checkmate", "--budget", "55%", "--backend", "highs",
      "--time-limit", "600", "--no-progress", "--json"], "/highspy/_core", "Running HiGHS"),   # HiGHS: minutes
], ids=["query", "solve"])
@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP], ids=["int", "term", "hup"])
def test_every_long_command_stops_within_seconds(tmp_path, command, library, banner, signum):
    (tmp_path / "store").mkdir()
    args = [*command, "--store", str(tmp_path / "store")]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    started = subprocess.Popen([sys.executable, "-m", "memplan.flows.cli", *args], cwd=tmp_path, env=env,
                               start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _in_native_code(started, library)
    sent = time.monotonic()
    os.kill(started.pid, signum)
    out, err = started.communicate(timeout=10)
    assert time.monotonic() - sent < 5
    assert started.returncode == 128 + signum and err.strip().endswith("interrupted")
    assert banner in err                                  # the solve was inside HiGHS (its banner opens a run)
