"""docs/training.md's examples run as written: make a policy plan and train in a plain loop, under
torch.compile, and under DDP on two gloo ranks, and train with the optimizer inside the step (each example as
a script, as a user runs it). Examples are found by their first line, `# example: <name>`, so blocks added
elsewhere on the page do not shift them; a block without that line, or one this test does not run, fails."""

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


def examples() -> dict[str, str]:
    """Each ```python block of the page by the name on its `# example: <name>` first line."""
    blocks = re.findall(r"```python\n(.*?)```", DOC.read_text(), re.S)
    named = {}
    for block in blocks:
        marker = re.match(r"# example: ([\w-]+)", block)
        assert marker, f"docs/training.md has a python block without an `# example: <name>` first line:\n{block[:200]}"
        named[marker.group(1)] = block
    return named


RUN = ("policy-loop", "policy-compile", "ddp", "optimizer-in-step")


def test_every_example_is_run():
    assert sorted(examples()) == sorted(RUN), "run each docs/training.md example in this file"


def test_policy_examples_run(tmp_path):
    blocks = examples()
    plain_and_compiled = run(blocks["policy-loop"] + blocks["policy-compile"], tmp_path, free_port())
    losses = [float(line) for line in plain_and_compiled.split()]
    assert len(losses) == 6 and losses[-1] < losses[0]
    assert (tmp_path / "gpt2-policy.json").exists()
    ddp = run(blocks["ddp"], tmp_path, free_port())
    assert re.fullmatch(r"mean loss over 2 ranks: \d+\.\d{4}\n", ddp), ddp


def test_optimizer_in_step_example_runs(tmp_path):
    out = run(examples()["optimizer-in-step"], tmp_path, free_port()).splitlines()
    peak = re.fullmatch(r"peak (\d+\.\d) MiB with the optimizer inside the step, (\d+\.\d) MiB without; "
                        r"momentum (\d+\.\d) MiB", out[0])
    assert peak and float(peak[1]) < float(peak[2]) and float(peak[3]) > 40, out[0]
    losses = [float(line) for line in out[1:]]
    assert len(losses) == 3 and losses[-1] < losses[0]
