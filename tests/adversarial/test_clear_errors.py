"""Bad input of every kind gets one clear line from memplan, never a traceback."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from flows.cli import app

from .conftest import tiny_pipeline

REPO = Path(__file__).resolve().parents[2]
BENCHMARK = Path("/work/shared/benchmarks/graphs/MobileNet_512_224_224_3_test.json")
runner = CliRunner()


def _fails_with(args: list[str], fragment: str) -> None:
    result = runner.invoke(app, args)
    assert result.exit_code in (1, 2), result.output
    assert fragment in result.output and "Traceback" not in result.output, result.output
    assert not isinstance(result.exception, Exception) or isinstance(result.exception, SystemExit), result.exception


def test_unreadable_pipeline_files(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_bytes(b'device = "cpu"\n# caf\xe9\n')
    _fails_with(["trace", str(bad)], "is not UTF-8 text (byte 0xe9 at offset 20)")
    _fails_with(["trace", str(tmp_path)], "is a folder; pass the pipeline.toml file itself")


def test_a_binary_plan_file(tmp_path):
    import torch

    import runtime
    from runtime.plan import PlanError

    plan = tmp_path / "plan.json"
    plan.write_bytes(bytes(range(256)))
    with pytest.raises(PlanError, match="is not text .* binary or corrupt"):
        runtime.load(plan, torch.nn.Linear(2, 2), lambda m, x: m(x).sum())
    _fails_with(["validate", str(plan), "--config", str(tiny_pipeline(tmp_path))], "binary or corrupt")


def test_output_at_a_folder_or_in_a_missing_folder(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "profiles_db").mkdir()
    query = ["query", "SELECT 1", "-f", "csv", "-o"]
    _fails_with(query + [str(tmp_path)], "is a folder")
    _fails_with(query + [str(tmp_path / "missing" / "x.csv")], "does not exist")
    solve = ["solve", "--graph", str(BENCHMARK), "--solver", "checkpoint-all", "--budget", "1.0", "--out"]
    _fails_with(solve + [str(tmp_path)], "is a folder")


@pytest.mark.parametrize("change, fragment", [
    (lambda g: g["nodes"][1].update(cost_cpu="abc"), "cost must be a non-negative number below 2^63, got 'abc'"),
    (lambda g: g["nodes"][2].update(cost_ram=1e30), "byte size must be a non-negative number below 2^63, got 1e+30"),
    (lambda g: g.update(nodes=[], links=[]), "the graph has no nodes"),
])
def test_bad_benchmark_graphs(tmp_path, monkeypatch, change, fragment):
    monkeypatch.chdir(tmp_path)
    graph = json.loads(BENCHMARK.read_text())
    change(graph)
    (tmp_path / "g.json").write_text(json.dumps(graph))
    _fails_with(["solve", "--graph", "g.json", "--solver", "checkpoint-all", "--budget", "1.0"], fragment)


def test_an_error_inside_a_stage_prints_memplan_s_message_once(tmp_path):
    """A factory that raises fails the trace stage inside Prefect: one message, no Prefect traceback
    (a real `memplan run`, so that Prefect's logging is what a user sees)."""
    (tmp_path / "boom.py").write_text("def make(**kwargs):\n    raise RuntimeError('out of memory in the factory')\n")
    config = tiny_pipeline(tmp_path, factory="boom:make")
    run = subprocess.run([sys.executable, "-m", "flows.cli", "run", str(config)], capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": str(REPO)}, cwd=tmp_path, timeout=300)
    output = run.stdout + run.stderr
    assert run.returncode == 1 and "Traceback" not in output, output
    assert output.count("out of memory in the factory") == 1, output
