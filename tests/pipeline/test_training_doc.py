"""docs/training.md's examples run as written, each as a script as a user runs it. Every ```python block
starts with a marker line `# example: NAME`; each name has its own expected output here (the DDP and FSDP2
examples load the plan file the plain example writes, so all run in one folder)."""

import os
import re
import socket
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "training.md"
MARKER = re.compile(r"# example: ([\w-]+)")


def examples() -> dict[str, str]:
    """The doc's ```python blocks by the name on their first line."""
    named: dict[str, str] = {}
    for block in re.findall(r"```python\n(.*?)```", DOC.read_text(), re.S):
        marker = MARKER.match(block)
        assert marker, f"a ```python block of {DOC.name} does not start with '# example: NAME': {block[:80]!r}"
        assert marker[1] not in named, f"two examples named {marker[1]!r} in {DOC.name}"
        named[marker[1]] = block
    return named


def run(script: str, cwd: Path) -> str:
    path = cwd / "example.py"
    path.write_text(script)
    # Unbuffered, as many CI runners set it: output must still come out whole.
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
           "MASTER_PORT": str(free_port()), "HF_HUB_OFFLINE": "1"}
    done = subprocess.run([sys.executable, str(path)], cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    return done.stdout


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def losses(stdout: str, count: int) -> list[float]:
    values = [float(line) for line in stdout.split()]
    assert len(values) == count and all(v > 0 for v in values), stdout
    return values


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("training-doc")


@pytest.fixture(scope="module")
def plain_and_compiled(folder) -> str:
    """The plain example then the compile example in one script (the second continues the first)."""
    blocks = examples()
    return run(blocks["plain"] + blocks["compile"], folder)


def test_every_block_is_a_named_example_with_a_test():
    assert set(examples()) == {"pipeline", "plain", "compile", "ddp", "fsdp", "mixed-precision", "trainer",
                                 "optimizer-in-step", "optimizer-in-step-policy", "executor-ddp",
                                 "compiled-form", "compiled-pipeline", "chunked-loss",
                                 "python-api"}                     # tests/pipeline/test_python_api.py runs it


FAST = "\n[profile]\nwarmup = 0\nrepeats = 1\n\n[validate]\nsteps = 1\nmax_steps = 1\n"
"""Appended to the doc's pipeline.toml: one profiling call and one timed step (the plan is the same)."""


def test_pipeline_publishes_a_policy_plan_the_example_trains_with(tmp_path, harness):
    from memplan.flows.plan import run_plan

    toml = re.findall(r"```toml\n(.*?)```", DOC.read_text(), re.S)[0]      # the first: a whole pipeline.toml
    (tmp_path / "pipeline.toml").write_text(toml + FAST)
    outcome, = run_plan(tmp_path / "pipeline.toml")
    assert (outcome["alias"], outcome["form"], outcome["status"]) == ("gpt2-b8-selective-policy-70pct", "policy",
                                                                      "published"), outcome
    values = losses(run(examples()["pipeline"], tmp_path), 3)
    assert values[-1] < values[0]


def test_plain_loop_and_torch_compile(plain_and_compiled, folder):
    values = losses(plain_and_compiled, 6)
    assert values[2] < values[0] and values[5] < values[3]          # the compile example trains a fresh model
    assert (folder / "gpt2-policy.json").exists()


@pytest.mark.parametrize("name", ["ddp", "fsdp"])
def test_distributed_examples_print_one_mean_loss(name, plain_and_compiled, folder):
    out = run(examples()[name], folder)
    assert re.fullmatch(r"mean loss over 2 ranks: \d+\.\d{4}\n", out), out


def test_mixed_precision(tmp_path):
    values = losses(run(examples()["mixed-precision"], tmp_path), 3)
    assert values[-1] < values[0]


def test_chunked_loss(tmp_path):
    values = losses(run(examples()["chunked-loss"], tmp_path), 3)
    assert values[-1] < values[0]


def test_hugging_face_trainer(tmp_path):
    out = run(examples()["trainer"], tmp_path)            # Trainer prints its run's metrics first
    assert re.fullmatch(r"trained 3 steps, mean loss \d+\.\d{4}", out.splitlines()[-1]), out


def test_optimizer_in_step(tmp_path):
    out = run(examples()["optimizer-in-step"], tmp_path).splitlines()
    peak = re.fullmatch(r"peak (\d+\.\d) MiB with the optimizer inside the step, (\d+\.\d) MiB without; "
                        r"momentum (\d+\.\d) MiB", out[0])
    assert peak and float(peak[1]) < float(peak[2]) and float(peak[3]) > 40, out[0]
    values = losses("\n".join(out[1:]), 3)
    assert values[-1] < values[0]


def test_optimizer_in_step_in_the_policy_form(tmp_path):
    out = run(examples()["optimizer-in-step-policy"], tmp_path).splitlines()
    peak = re.fullmatch(r"predicted peak (\d+\.\d) MiB with AdamW inside the step, (\d+\.\d) MiB with it after the "
                        r"step", out[0])
    assert peak and float(peak[1]) < float(peak[2]), out[0]
    values = losses("\n".join(out[1:]), 3)
    assert values[-1] < values[0]


def test_the_policy_forms_pipeline_settings_for_the_optimizer_parse():
    """The doc's toml fragment for the optimizer inside the step in the policy form, completed with a model."""
    from memplan.tasks.config import expand_matrix, parse_config

    fragment, = (t for t in re.findall(r"```toml\n(.*?)```", DOC.read_text(), re.S) if "optimizer_in_step" in t)
    model = ('[[models]]\nname = "linear"\nfactory = "torch.nn:Linear"\n'
             'kwargs = { in_features = 4, out_features = 3 }\nloss = "mse"\n'
             'inputs = [{ shape = [4] }, { shape = [3] }]\n\n')
    config = parse_config(tomllib.loads(fragment.replace("[[plans]]", model + "[[plans]]", 1)))
    case, = expand_matrix(config)
    settings = case.plan.solve_settings(config.optimizer)
    assert (settings.form, settings.optimizer) == ("policy", "adamw")


def test_executor_under_ddp(tmp_path):
    out = run(examples()["executor-ddp"], tmp_path)
    assert re.fullmatch(r"predicted peak \d+\.\d MiB with the DDP buckets\nmean loss over 2 ranks: \d+\.\d{4}\n", out), out


def test_pipeline_publishes_a_compiled_plan_the_example_trains_with(tmp_path, harness):
    from memplan.flows.plan import run_plan

    toml, = (t for t in re.findall(r"```toml\n(.*?)```", DOC.read_text(), re.S) if 'form = "compiled"' in t)
    (tmp_path / "pipeline.toml").write_text(toml + FAST)
    outcome, = run_plan(tmp_path / "pipeline.toml")
    assert (outcome["alias"], outcome["form"], outcome["status"]) == ("gpt2-b8-dtr-compiled-90pct", "compiled",
                                                                      "published"), outcome
    assert outcome["measured_peak_bytes"] <= outcome["budget_bytes"] * 1.05
    values = losses(run(examples()["compiled-pipeline"], tmp_path), 3)
    assert values[-1] < values[0]


def test_the_compiled_form(tmp_path):
    out = run(examples()["compiled-form"], tmp_path).splitlines()
    values = losses("\n".join(out[:3]), 3)
    assert values[-1] < values[0]
    cut = re.fullmatch(r"recomputed (\d+) forward nodes; saved (\d+) KiB", out[3])
    assert cut and int(cut[1]) > 0, out[3]
