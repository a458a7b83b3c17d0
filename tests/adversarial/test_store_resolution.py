"""The reading commands read the store and plans folder the user means: `--store`, else the pipeline file
(`--config` or ./pipeline.toml), else $MEMPLAN_PROFILES_DB; and they say which."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq
from typer.testing import CliRunner

from memplan.flows.cli import app
from memplan.tasks.publish import INDEX_SCHEMA
from memplan.tasks.store.profiles import ENV_VAR, write_run

from .conftest import index_row, profile_rows, tiny_pipeline


def _project(root):
    """A project folder whose pipeline.toml names its own store and plans folder, with a run and a plan."""
    config = tiny_pipeline(root / "proj", store="mystore", plans="myplans")
    write_run(profile_rows(nodes=2), root / "proj" / "mystore")
    (root / "proj" / "myplans" / "index").mkdir(parents=True)
    pq.write_table(pa.Table.from_pylist([index_row()], schema=INDEX_SCHEMA),
                   root / "proj" / "myplans" / "index" / "one.parquet")
    return config


def test_commands_read_the_store_of_the_pipeline_file_here_or_given(tmp_path, monkeypatch):
    config = _project(tmp_path)
    write_run(profile_rows(nodes=5), tmp_path / "envstore")
    monkeypatch.setenv(ENV_VAR, str(tmp_path / "envstore"))
    runner = CliRunner()
    count = ["query", "SELECT count(*) AS n FROM profiles", "-f", "csv"]

    monkeypatch.chdir(tmp_path / "proj")                          # ./pipeline.toml comes first
    here = runner.invoke(app, count)
    assert here.exit_code == 0 and here.stdout == "n\n2\n"
    assert f"profile store {tmp_path / 'proj' / 'mystore'} (store of pipeline.toml)" in here.stderr
    listed = runner.invoke(app, ["plans", "list"])
    assert listed.exit_code == 0 and "mlp-b4-checkmate-60pct" in listed.stdout
    runs = runner.invoke(app, ["profiles", "list", "-f", "csv"])
    assert runs.exit_code == 0 and len(runs.stdout.splitlines()) == 2

    monkeypatch.chdir(tmp_path)                                    # no pipeline.toml: the environment
    assert runner.invoke(app, count).stdout == "n\n5\n"
    given = runner.invoke(app, count + ["--config", str(config)])
    assert given.stdout == "n\n2\n"
    plans = runner.invoke(app, ["query", "SELECT count(*) AS n FROM plans", "-f", "csv", "--config", str(config)])
    assert plans.stdout == "n\n1\n"


def test_a_missing_store_folder_is_an_error_not_zero_rows(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    runner = CliRunner()
    for args in (["query", "SELECT count(*) FROM profiles"], ["profiles", "list"],
                 ["solve", "--graph", "g.json", "--solver", "checkpoint-all", "--budget", "1.0"]):
        result = runner.invoke(app, args + ["--store", str(tmp_path / "nonexistent")])
        assert result.exit_code == 1, (args, result.output)
        assert result.stderr.count("--store") >= 1 and "no such folder" in result.stderr
