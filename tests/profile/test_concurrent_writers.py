"""Eight processes profile and write to one store at the same time; every row of every run arrives."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from memplan.tasks.store.query import connect, load_costs

WORKERS = 8

# One process imports torch and memplan once and forks the workers (each import would cost a worker 3-4
# CPU-seconds). Each worker captures an MLP, profiles it, waits until all workers have measured (a file
# barrier), then writes its run and its rows as JSON to `<index>.json`; the parent exits non-zero if any failed.
WORKERS_SCRIPT = r"""
import json, multiprocessing, sys, time
from pathlib import Path
import torch
from torch import nn
from memplan import runtime
from memplan.tasks.profile.stage import ProfileSettings, measure_graph
from memplan.tasks.store.profiles import write_run

root, barrier, out, workers = Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3]), int(sys.argv[4])


def work(index):
    torch.set_num_threads(1)
    torch.manual_seed(index)
    net = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 8))
    graph = runtime.capture(net, lambda m, x, y: nn.functional.cross_entropy(m(x), y),
                            (torch.randn(16, 32), torch.zeros(16, dtype=torch.long)))
    rows = measure_graph(graph, "cpu", ProfileSettings(warmup=1, repeats=3), model=f"mlp-{index % 2}", progress=False)
    (barrier / str(index)).touch()
    deadline = time.monotonic() + 300
    while len(list(barrier.iterdir())) < workers:
        if time.monotonic() > deadline:
            sys.exit("barrier timed out")
        time.sleep(0.01)
    write_run(rows, root)
    (out / f"{index}.json").write_text(json.dumps(
        [[r["run_id"], r["fingerprint"], r["node_id"], r["time_ms"], r["output_bytes"]] for r in rows]))


if __name__ == "__main__":
    procs = [multiprocessing.get_context("fork").Process(target=work, args=(i,)) for i in range(workers)]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(540)
    sys.exit(sum(proc.exitcode != 0 for proc in procs))
"""


def test_eight_processes_profile_and_write_at_once(tmp_path):
    root, barrier, out = tmp_path / "profiles_db", tmp_path / "barrier", tmp_path / "rows"
    barrier.mkdir()
    out.mkdir()
    repo = Path(__file__).resolve().parents[2]
    done = subprocess.run([sys.executable, "-c", WORKERS_SCRIPT, str(root), str(barrier), str(out), str(WORKERS)],
                          cwd=repo, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    written = sorted(tuple(row) for i in range(WORKERS) for row in json.loads((out / f"{i}.json").read_text()))
    runs = {row[0] for row in written}
    assert len(runs) == WORKERS
    con = connect(root)
    stored = con.execute("SELECT run_id, fingerprint, node_id, time_ms, output_bytes FROM profiles "
                         "ORDER BY ALL").fetchall()
    assert stored == written
    assert con.execute("SELECT count(*), bool_and(complete) FROM runs").fetchall() == [(WORKERS, True)]
    assert sorted(p.name for p in root.rglob("*") if p.is_file()) == sorted(f"run-{r}.parquet" for r in runs)
    fingerprint = written[0][1]
    assert load_costs(fingerprint, root=root).run_id in runs
