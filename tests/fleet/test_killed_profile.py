"""A profiling process killed in the middle of a profile leaves no rows in the store; the re-run completes.

(A process killed in the middle of writing its file: tests/fleet/test_store_url.py.)
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import torch
from torch import nn

from memplan import runtime
from memplan.tasks.profile.stage import ProfileSettings, profile_graph
from memplan.tasks.store.profiles import locate
from memplan.tasks.store.query import query

from .conftest import REPO

NET = "nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))"

# argv: store. Profiles the MLP; the last node's first call announces itself and stalls until killed.
PROFILER = rf"""
import sys, time
import torch
from torch import nn
from memplan import runtime
from memplan.tasks.profile.stage import ProfileSettings, profile_graph

torch.manual_seed(0)
graph = runtime.capture({NET}, lambda m, x, y: nn.functional.cross_entropy(m(x), y),
                        (torch.randn(4, 8), torch.zeros(4, dtype=torch.long)))
last = graph.nodes[-1].id

def node_function(graph, node_id):
    call = runtime.node_function(graph, node_id)
    if node_id != last:
        return call
    def stalling(*args):
        print("mid-profile", flush=True)
        time.sleep(600)
    return stalling

profile_graph(graph, "cpu", ProfileSettings(warmup=0, repeats=1, rounds=1), model="mlp", root=sys.argv[1],
              node_function=node_function, progress=False)
"""


def test_a_profiler_killed_mid_profile_leaves_no_rows_and_the_rerun_completes(tmp_path):
    store = str(tmp_path / "store")
    proc = subprocess.Popen([sys.executable, "-c", PROFILER, store], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        line = proc.stdout.readline()
        assert line.strip() == "mid-profile", proc.stderr.read() if proc.poll() is not None else line
        os.killpg(proc.pid, signal.SIGKILL)
    finally:
        proc.kill()
        proc.communicate(timeout=30)
    assert locate(store).parquet_files() == []
    assert query("SELECT count(*) AS rows FROM profiles", store).to_pylist() == [{"rows": 0}]

    torch.manual_seed(0)
    graph = runtime.capture(eval(NET), lambda m, x, y: nn.functional.cross_entropy(m(x), y),
                            (torch.randn(4, 8), torch.zeros(4, dtype=torch.long)))
    run = profile_graph(graph, "cpu", ProfileSettings(warmup=0, repeats=1, rounds=1), model="mlp", root=store,
                        progress=False)
    assert query("SELECT run_id, nodes, complete FROM runs", store).to_pylist() == [
        {"run_id": run.run_id, "nodes": len(graph.nodes), "complete": True}]
