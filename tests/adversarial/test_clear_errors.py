"""Bad input of every kind gets one clear line from memplan, never a traceback."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from memplan.flows.cli import app

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

    from memplan import runtime
    from memplan.runtime.format.plan import PlanError

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


def test_an_error_inside_a_stage_prints_memplan_s_message_once(tmp_path, harness):
    """A factory that raises fails the trace stage inside Prefect: one message, no Prefect traceback
    (a real `memplan run` in a process of its own, reporting to a running server, so that Prefect's logging is
    what a user sees)."""
    (tmp_path / "boom.py").write_text("def make(**kwargs):\n    raise RuntimeError('out of memory in the factory')\n")
    config = tiny_pipeline(tmp_path, factory="boom:make")
    run = subprocess.run([sys.executable, "-m", "memplan.flows.cli", "run", str(config)], capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": str(REPO), "PREFECT_API_URL": harness}, cwd=tmp_path,
                         timeout=300)
    output = run.stdout + run.stderr
    assert run.returncode == 1 and "Traceback" not in output, output
    assert output.count("out of memory in the factory") == 1, output


def _pipeline(tmp_path: Path, models: str, head: str = "", tail: str = "") -> Path:
    config = tmp_path / "pipeline.toml"
    config.write_text(f'device = "cpu"\n{head}\n[[models]]\nname = "mlp"\nfactory = "torch.nn:Linear"\n'
                      f'kwargs = {{ in_features = 4, out_features = 3 }}\n{models}\n'
                      f'[[plans]]\nsolver = "checkpoint-all"\nbudgets = [1.0]\n{tail}')
    return config


MSE = 'loss = "mse"\ninputs = [{ shape = [4] }, { shape = [3] }]\n'


@pytest.mark.parametrize("models, head, tail, fragment", [
    ('loss = "mse"\ninputs = [{ shape = [5] }, { shape = [3] }]\n', "", "",
     "its training step fails on the batch pipeline.toml declares ([8, 5] float32, [8, 3] float32) with RuntimeError"),
    ('inputs = [{ shape = [4] }, { shape = [], dtype = "int64", high = 20 }]\n', "", "",
     "IndexError: Target"),
    (MSE + "batch_sizes = [100000000000]\n", "", "", "lower `batch_sizes` in pipeline.toml"),
    (MSE, 'cache_dir = "afile"', "", "cache_dir = "),
    (MSE, 'store = "afile"', "", "store = "),
    (MSE, "", '[publish]\ndir = "afile/sub"\n', "lies under"),
], ids=["shape", "labels", "batch", "cache-file", "store-file", "publish-under-file"])
def test_bad_models_and_locations_fail_before_any_stage_in_a_few_lines(tmp_path, monkeypatch, models, head, tail,
                                                                         fragment):
    """A bad location fails the run before any stage; a bad model fails its cells at their trace (the outcome
    table says so, and the run goes on with other models' cells)."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "afile").write_text("not a folder")
    result = runner.invoke(app, ["run", str(_pipeline(tmp_path, models, head, tail))])
    assert result.exit_code == 1 and fragment in " ".join(result.output.split()), result.output
    error = result.output[result.output.index("error: "):]
    assert "Traceback" not in result.output and len(error.strip().splitlines()) <= 5, result.output
    assert not list(tmp_path.rglob("*.parquet"))                       # nothing profiled


def test_an_unreachable_prefect_api_is_named_before_any_stage(tmp_path):
    config = _pipeline(tmp_path, MSE)
    run = subprocess.run([sys.executable, "-m", "memplan.flows.cli", "run", str(config)], capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": str(REPO), "PREFECT_API_URL": "http://127.0.0.1:9/api"},
                         cwd=tmp_path, timeout=120)
    assert run.returncode == 1 and "PREFECT_API_URL = 'http://127.0.0.1:9/api' does not answer" in run.stderr
    assert "Traceback" not in run.stderr + run.stdout and not (tmp_path / ".cache" / "memplan" / "graphs").exists()


def test_a_long_model_name_is_named_not_printed(tmp_path):
    config = _pipeline(tmp_path, MSE).read_text().replace('name = "mlp"', f'name = "{"m" * 5000}"')
    (tmp_path / "pipeline.toml").write_text(config)
    result = runner.invoke(app, ["run", str(tmp_path / "pipeline.toml")])
    assert result.exit_code == 1 and "is 5000 characters long; give at most 100" in result.output
    assert len(result.output) < 1000


def _plan_file(tmp_path: Path) -> Path:
    """The default plan of a captured linear layer, saved as a plan file."""
    import torch

    from memplan import runtime

    graph = runtime.capture(torch.nn.Linear(4, 3), lambda m, x, y: torch.nn.functional.mse_loss(m(x), y),
                            (torch.randn(2, 4), torch.randn(2, 3)))
    path = tmp_path / "plan.json"
    runtime.default_plan(graph).save(path)
    return path


def test_edited_plan_numbers_and_bad_aliases_are_refused_in_one_line(tmp_path):
    from memplan.runtime.format.jsonio import sha256_hex

    make_plan_file = _plan_file(tmp_path)
    plan = json.loads(make_plan_file.read_text())
    for key, value, fragment in (("predicted", {"peak_bytes": float("nan")}, "holds NaN, which JSON does not allow"),
                                 ("provenance", {"budget_bytes": "abc"}, "is not a number of bytes")):
        edited = dict(plan, **{key: value})
        edited["checksum"] = "0" * 64 if key == "predicted" else sha256_hex({k: v for k, v in edited.items()
                                                                             if k != "checksum"})
        path = tmp_path / f"{key}.json"
        path.write_text(json.dumps(edited))
        _fails_with(["validate", str(path), "--config", str(tiny_pipeline(tmp_path))], fragment)
    _fails_with(["publish", str(make_plan_file), "--config", str(tiny_pipeline(tmp_path)), "--alias", "../../x"],
                "it is a file name inside the plans folder, not a path")


def test_a_query_result_parquet_cannot_hold_is_one_line(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "profiles_db").mkdir()
    _fails_with(["query", "SELECT INTERVAL 1 DAY AS i", "-f", "parquet", "-o", str(tmp_path / "x.parquet")],
                "cannot be written as Parquet")
    assert not list(tmp_path.glob("*parquet*"))
