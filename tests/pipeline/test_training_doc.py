"""docs/training.md's examples run as written: make a policy plan and train in a plain loop, under
torch.compile, and under DDP on two gloo ranks (each example as a script, as a user runs it)."""

import os
import re
import socket
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "training.md"


def run(script: str, cwd: Path, port: int) -> str:
    path = cwd / "example.py"
    path.write_text(script)
    # Unbuffered, as many CI runners set it: output must still come out whole.
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
           "MASTER_PORT": str(port)}
    done = subprocess.run([sys.executable, str(path)], cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    return done.stdout


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_training_doc_examples_run(tmp_path):
    blocks = re.findall(r"```python\n(.*?)```", DOC.read_text(), re.S)
    assert len(blocks) == 3
    plain_and_compiled = run(blocks[0] + blocks[1], tmp_path, free_port())
    losses = [float(line) for line in plain_and_compiled.split()]
    assert len(losses) == 6 and losses[-1] < losses[0]
    assert (tmp_path / "gpt2-policy.json").exists()
    ddp = run(blocks[2], tmp_path, free_port())
    assert re.fullmatch(r"mean loss over 2 ranks: \d+\.\d{4}\n", ddp), ddp
