"""The executor under DistributedDataParallel: per-rank gradients equal plain DDP's (2 gloo ranks, CPU, in
tests/runtime/executor_ddp_worker.py), the buckets follow the planned backward, and what it cannot run is
refused in one paragraph."""

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_executor_under_ddp_gets_the_gradients_of_plain_ddp_and_the_predicted_peak():
    # Unbuffered, as many CI runners set it: each line must still come out whole.
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    run = subprocess.run([sys.executable, str(Path(__file__).with_name("executor_ddp_worker.py"))], env=env,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr[-3000:]
    ranks = {r: (float(d), int(n), int(b), float(u), int(m), int(p)) for r, d, n, b, u, m, p in re.findall(
        r"rank (\d) max_abs_diff (\S+) recomputations (\d+) buckets (\d+) unreduced_diff (\S+) measured (\d+) "
        r"predicted (\d+)\n", run.stdout)}
    assert set(ranks) == {"0", "1"}, run.stdout
    for diff, recomputed, buckets, unreduced, measured, predicted in ranks.values():
        assert diff <= 1e-5 and unreduced > 1e-3, ranks       # the all-reduce happened, and matches DDP's
        assert recomputed > 0 and buckets > 1, ranks
        assert measured == predicted, ranks
