"""DDP with the policy form: per-rank gradients equal DDP without checkpointing (2 gloo ranks, CPU)."""

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_policy_model_under_ddp_gets_the_gradients_of_ddp_without_checkpointing():
    # Unbuffered, as many CI runners set it: each line must still come out whole.
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    run = subprocess.run([sys.executable, str(Path(__file__).with_name("policy_ddp_worker.py"))], env=env,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr[-3000:]
    ranks = {r: (float(d), int(n)) for r, d, n in
             re.findall(r"rank (\d) max_abs_diff (\S+) recomputations (\d+)", run.stdout)}
    assert set(ranks) == {"0", "1"}, run.stdout
    assert all(diff <= 1e-6 and recomputed > 0 for diff, recomputed in ranks.values()), ranks
