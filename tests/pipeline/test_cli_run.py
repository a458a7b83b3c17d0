"""`memplan run` from the command line on a tiny project (one linear layer at batch 1024, checkpoint-all at
the full budget, one validation step): the success table and the published plan, `--refresh` re-running
the cached stages, and a plan that fails validation giving exit status 1, the reason, and nothing published."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from memplan.flows.cli import app

runner = CliRunner(env={"COLUMNS": "250"})
MIB = 2**20

DRIFTING_LOSS = Path(__file__).with_name("drift.py")

PIPELINE = '''
device = "cpu"

[[models]]
name = "{name}"
factory = "torch.nn:Linear"
kwargs = {{ in_features = 256, out_features = 256 }}
loss = "{loss}"
batch_sizes = [1024]
inputs = [{{ shape = [256] }}, {{ shape = [], dtype = "int64", high = 256 }}]

[profile]
warmup = 0
repeats = 1

[[plans]]
solver = "checkpoint-all"
budgets = [1.0]

[validate]
steps = 1
max_steps = 1
warmup = 0
'''


def write_project(folder: Path, name: str, loss: str) -> Path:
    shutil.copy(DRIFTING_LOSS, folder / "drift.py")
    config = folder / "pipeline.toml"
    config.write_text(PIPELINE.format(name=name, loss=loss))
    return config


@pytest.fixture(scope="module")
def quiet_prefect():
    """`memplan run` sets Prefect's log defaults in os.environ (flows.console.prepare): unset after the module."""
    with pytest.MonkeyPatch.context() as patch:
        for key in ("PREFECT_LOGGING_LEVEL", "PREFECT_LOGGING_HANDLERS_CONSOLE_LEVEL"):
            patch.delenv(key, raising=False)                    # recorded as unset, so restored as unset
        yield


@pytest.fixture(scope="module")
def first_run(tmp_path_factory, harness, quiet_prefect):
    """A project folder and the result of its first `memplan run`."""
    folder = tmp_path_factory.mktemp("run")
    config = write_project(folder, "mlp", "cross_entropy")
    return folder, config, runner.invoke(app, ["run", str(config)])


def table_row(output: str, alias: str) -> list[str]:
    """The cells of `alias`'s row in the rich outcome table."""
    (line,) = [line for line in output.splitlines() if line.startswith(f"│ {alias} ")]
    return [cell.strip() for cell in line.strip("│ ").split("│")]


def parquet_files(folder: Path) -> list[Path]:
    return sorted(folder.rglob("*.parquet"))


def test_run_prints_the_table_and_publishes_the_plan(first_run):
    from memplan.runtime.format.plan import Plan
    from memplan.tasks.publish import plan_id, read_index

    folder, _, result = first_run
    assert result.exit_code == 0, result.output
    alias = "mlp-b1024-checkpoint-all-100pct"
    (row,) = read_index(folder / "plans")
    assert row["alias"] == alias and row["model"] == "mlp" and row["solver"] == "checkpoint-all"
    assert row["batch_size"] == 1024 and row["budget"] == "100pct" and row["device"] == "cpu"
    plan = Plan.load(folder / "plans" / f"{alias}.json")
    assert plan_id(plan) == row["plan_id"] and plan.provenance["solver"] == "checkpoint-all"
    assert plan.provenance["budget_bytes"] == row["budget_bytes"] > MIB          # a budget the table shows
    cells = table_row(result.output, alias)
    assert cells == [alias, "executor", f"{row['budget_bytes'] / MIB:.1f}", f"{row['predicted_peak_bytes'] / MIB:.1f}",
                     f"{row['measured_peak_bytes'] / MIB:.1f}", f"{row['eager_peak_bytes'] / MIB:.1f}",
                     "not measurable here (under 6 rounds)", "", "published"]    # one timed step; no max_overhead
    assert f"published 1 of 1 plans into {folder / 'plans'}/" in " ".join(result.output.split())
    assert "To train with them: executor plans, memplan.load(plan, model, loss_fn)." in " ".join(result.output.split())


def test_refresh_re_runs_the_cached_stages(first_run):
    """A plain second run serves the profile and the solution from Prefect's cache (tests/pipeline/test_flows.py);
    `--refresh` measures the model again (a second profile run in the store), solves on that profile and
    publishes the new plan under the same alias."""
    from memplan.runtime.format.plan import Plan

    folder, config, _ = first_run
    alias, solutions = "mlp-b1024-checkpoint-all-100pct", folder / ".cache" / "memplan" / "solutions"
    assert len(parquet_files(folder / "profiles_db")) == 1 and len(list(solutions.glob("*.json"))) == 1
    before = Plan.load(folder / "plans" / f"{alias}.json").provenance["profile_run_id"]
    refreshed = runner.invoke(app, ["run", str(config), "--refresh"])
    assert refreshed.exit_code == 0, refreshed.output
    profiles = parquet_files(folder / "profiles_db")
    assert len(profiles) == 2 and len(list(solutions.glob("*.json"))) == 2
    after = Plan.load(folder / "plans" / f"{alias}.json").provenance["profile_run_id"]
    assert after != before and {before, after} == {p.stem.removeprefix("run-") for p in profiles}
    assert table_row(refreshed.output, alias)[-1] == "published"


def test_a_plan_failing_validation_exits_1_and_publishes_nothing(tmp_path, harness, quiet_prefect):
    from memplan.tasks.publish import read_index

    config = write_project(tmp_path, "drift", "drift:drifting_loss")
    result = runner.invoke(app, ["run", str(config)])
    assert result.exit_code == 1, result.output
    text = " ".join(result.output.split())
    assert "error: 1 of 1 plans were not published (0 were): " in text, result.output
    assert "plan drift-b1024-checkpoint-all-100pct failed validation on cpu: loss differs from eager" in text
    assert "published 1 of 1 plans" not in result.output      # (no traceback: tests/adversarial/test_clear_errors.py)
    assert table_row(result.output, "drift-b1024-checkpoint-all-100pct")[-1] == "rejected"
    assert read_index(tmp_path / "plans") == [] and not list(tmp_path.glob("plans/*.json"))


def test_a_budget_this_device_cannot_meet_is_reported_and_does_not_fail_the_run(tmp_path, harness, quiet_prefect):
    """A second budget of 1000 bytes is below what the step must hold: the cell is infeasible, its row gives
    the least budget known to fit, the 100% plan is published, and the run exits 0 (docs/config.md)."""
    from memplan.tasks.publish import read_index

    config = write_project(tmp_path, "mlp", "cross_entropy")
    config.write_text(config.read_text().replace("budgets = [1.0]", "budgets = [1.0, 1000]"))
    result = runner.invoke(app, ["run", str(config)])
    assert result.exit_code == 0, result.output
    status = table_row(result.output, "mlp-b1024-checkpoint-all-1000B")[-1]
    assert status.startswith("infeasible here (feasible from ") and status.endswith(" MiB)"), status
    assert table_row(result.output, "mlp-b1024-checkpoint-all-100pct")[-1] == "published"
    assert "published 1 of 2 plans into" in " ".join(result.output.split())
    assert [r["alias"] for r in read_index(tmp_path / "plans")] == ["mlp-b1024-checkpoint-all-100pct"]


def test_a_dask_runner_without_prefect_dask_is_refused_before_any_stage(tmp_path, monkeypatch, quiet_prefect):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "prefect_dask" else real(name, *a))
    config = write_project(tmp_path, "mlp", "cross_entropy")
    config.write_text(config.read_text() + '\n[run]\ntask_runner = "dask"\n')
    result = runner.invoke(app, ["run", str(config)])
    assert result.exit_code == 1
    assert "pip install -c constraints.txt -e '.[fleet]'" in " ".join(result.output.split())
    assert not (tmp_path / ".cache" / "memplan" / "graphs").exists()
