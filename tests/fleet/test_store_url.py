"""The profile store at a URL: the same guarantees in a local folder and in an S3 bucket (moto on loopback).

Two processes write runs at once and every run arrives whole; a writer killed in the middle of its write
leaves nothing a reader sees; `memplan query` reads the store by URL.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from memplan.tasks.store.profiles import locate, read_runs, write_run
from memplan.tasks.store.query import query

from .conftest import REPO

# argv: store, writer index, runs to write. Prints the run ids it wrote as JSON.
WRITER = r"""
import json, sys
sys.path.insert(0, "tests/fleet")
from conftest import rows_of_run
from memplan.tasks.store.profiles import write_run
root, index, runs = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
ids = []
for i in range(runs):
    rows = rows_of_run(f"fp-{index}", nodes=4, device=f"class-{index}", minutes=i)
    write_run(rows, root)
    ids.append(rows[0]["run_id"])
print(json.dumps(ids))
"""

# argv: store. Writes one large run but stalls (forever) after handing half of the file to the store's
# filesystem, so that the test can kill it mid-write. The real write_run and StoreLocation.put run; only
# the byte sink is wrapped.
STALLING_WRITER = r"""
import builtins, sys, time
sys.path.insert(0, "tests/fleet")
from conftest import rows_of_run
import memplan.tasks.store.profiles as store

class Stalling:
    def __init__(self, sink):
        self.sink = sink
    def __enter__(self):
        return self
    def __exit__(self, *exc):
        self.sink.close()
    def write(self, data):
        self.sink.write(data[: len(data) // 2])
        self.sink.flush()
        print("half written", flush=True)
        time.sleep(600)

class StallingFS:
    def __init__(self, fs):
        self.fs = fs
    def __getattr__(self, name):
        return getattr(self.fs, name)
    def open_output_stream(self, path, *args, **kwargs):
        return Stalling(self.fs.open_output_stream(path, *args, **kwargs))

real_locate = store.locate
store.locate = lambda root=None: store.StoreLocation(*(lambda w: (w.root, StallingFS(w.fs), w.base))(real_locate(root)))
store.open = lambda path, mode: Stalling(builtins.open(path, mode))
store.write_run(rows_of_run("fp-killed", nodes=200, payload=60_000), sys.argv[1])
"""


@pytest.fixture(params=["folder", "s3"])
def store_url(request, tmp_path):
    if request.param == "folder":
        return str(tmp_path / "profiles_db")
    return request.getfixturevalue("s3_store")


def _python(script: str, *args: str, **kwargs) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", script, *args], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True, **kwargs)


def test_two_processes_write_at_once_and_every_run_arrives_whole(s3_store):
    """(In a folder: tests/profile/test_concurrent_writers.py, with eight profiling processes.)"""
    store_url = s3_store
    writers = [_python(WRITER, store_url, str(i), "4") for i in range(2)]
    try:
        outputs = [w.communicate(timeout=120) for w in writers]
    finally:
        for w in writers:
            w.kill()
    for w, (_, err) in zip(writers, outputs):
        assert w.returncode == 0, err
    written = {run for out, _ in outputs for run in json.loads(out)}
    files, rows = read_runs(store_url)
    assert len(written) == 8 and len(files) == 8 and all(str(f).startswith(store_url) for f in files)
    assert set(rows.column("run_id").to_pylist()) == written
    by_device = query("SELECT device, count(*) AS runs, bool_and(complete) AS complete FROM runs "
                      "GROUP BY device ORDER BY device", store_url).to_pylist()
    assert by_device == [{"device": "class-0", "runs": 4, "complete": True},
                         {"device": "class-1", "runs": 4, "complete": True}]


def test_a_writer_killed_mid_write_leaves_no_visible_file(store_url, make_run):
    writer = _python(STALLING_WRITER, store_url)
    try:
        line = writer.stdout.readline()          # blocks until half the file went to the store
        assert line.strip() == "half written", writer.stderr.read() if writer.poll() is not None else line
        os.killpg(writer.pid, signal.SIGKILL)
    finally:
        writer.kill()
        writer.communicate(timeout=30)
    where = locate(store_url)
    assert where.parquet_files() == []
    assert read_runs(store_url)[1].num_rows == 0
    rows = make_run("fp-after", nodes=5)
    write_run(rows, store_url)                  # the store works as before: the next run lands whole
    assert query("SELECT run_id, rows, complete FROM runs", store_url).to_pylist() == [
        {"run_id": rows[0]["run_id"], "rows": 5, "complete": True}]


def test_memplan_query_reads_the_store_by_url(s3_store, make_run, tmp_path):
    from memplan.flows.cli import app

    store_url = s3_store
    for device in ("h100", "a100"):
        write_run(make_run("fp-a", nodes=3, device=device), store_url)
    result = CliRunner().invoke(app, ["query", "--store", store_url, "--plans", str(tmp_path / "plans"),
                                      "--format", "json",
                                      "SELECT device, sum(time_ms) AS ms FROM profiles GROUP BY device ORDER BY device"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout) == [{"device": "a100", "ms": 6.0}, {"device": "h100", "ms": 6.0}]
