"""`memplan query` and `memplan profiles list`."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import typer
from typer.testing import CliRunner

from memplan.flows.commands import profiles, query
from memplan.tasks.store.profiles import write_run


@pytest.fixture
def cli():
    """The two commands of this folder on a fresh app (other command modules are not needed here)."""
    app = typer.Typer()
    query.register(app)
    profiles.register(app)
    runner = CliRunner()
    return lambda *args: runner.invoke(app, list(args))


@pytest.fixture
def filled(store, make_run):
    runs = [make_run("fp-a", nodes=3, model="resnet18"), make_run("fp-b", nodes=2, model="gpt2", device="cuda-h100",
                                                                   minutes=5)]
    for rows in runs:
        write_run(rows)
    return runs


def test_query_group_by_model_as_csv_json_and_table(cli, filled):
    sql = "select model, count(*) as n from profiles group by model order by model"
    result = cli("query", sql, "--format", "csv")
    assert result.exit_code == 0, result.output
    assert result.stdout == "model,n\ngpt2,2\nresnet18,3\n"
    result = cli("query", sql, "--format", "json")
    assert json.loads(result.stdout) == [{"model": "gpt2", "n": 2}, {"model": "resnet18", "n": 3}]
    result = cli("query", sql)
    assert result.exit_code == 0 and "resnet18" in result.stdout and "gpt2" in result.stdout


def test_query_writes_parquet_to_a_file(cli, filled, tmp_path):
    out = tmp_path / "slowest.parquet"
    result = cli("query", "select node_id, time_ms from latest_costs where model = 'resnet18' order by time_ms desc",
                 "--format", "parquet", "--output", str(out))
    assert result.exit_code == 0, result.output
    assert pq.read_table(out).to_pylist() == [{"node_id": i, "time_ms": float(i + 1)} for i in (2, 1, 0)]
    assert [p.name for p in tmp_path.iterdir()] == ["profiles_db", "slowest.parquet"]


@pytest.mark.parametrize("args, message", [
    (["selec 1"], "Parser Error"),
    (["select nope from profiles"], 'Referenced column "nope" not found'),
    (["copy profiles to 'x.csv'"], "read-only: a COPY statement"),
    (["create table t as select 1"], "read-only: a CREATE statement"),
    (["select 1; select 2"], "exactly one SQL statement"),
    (["select 1", "--format", "parquet"], "needs --output"),
])
def test_query_errors_print_the_cause_and_exit_non_zero(cli, filled, args, message):
    result = cli("query", *args)
    assert result.exit_code != 0
    assert message in result.stderr


def test_query_warns_about_a_truncated_file_and_still_answers(cli, filled, store):
    bad = store / "device=cpu" / "model=resnet18" / "run-broken.parquet"
    bad.write_bytes(b"PAR1 not really")
    result = cli("query", "select count(*) as n from profiles", "--format", "csv")
    assert result.exit_code == 0
    assert result.stdout == "n\n5\n"
    assert "Skipping" in result.stderr and "run-broken.parquet" in result.stderr


def test_profiles_list_shows_runs_newest_first_and_filters(cli, filled):
    result = cli("profiles", "list", "--format", "json")
    assert result.exit_code == 0, result.output
    runs = json.loads(result.stdout)
    assert [(r["run_id"], r["device"], r["model"], r["rows"], r["complete"]) for r in runs] == [
        (filled[1][0]["run_id"], "cuda-h100", "gpt2", 2, True), (filled[0][0]["run_id"], "cpu", "resnet18", 3, True)]
    assert runs[1]["created_at"] == "2026-01-01 00:00:00"
    only_gpu = json.loads(cli("profiles", "list", "--device", "cuda:0", "--format", "json").stdout)
    assert [r["model"] for r in only_gpu] == ["gpt2"]
    by_print = json.loads(cli("profiles", "list", "--fingerprint", "fp-a", "--format", "json").stdout)
    assert [r["model"] for r in by_print] == ["resnet18"]
    table = cli("profiles", "list")
    assert table.exit_code == 0 and "resnet18" in table.stdout


def test_store_option_overrides_the_environment(cli, filled, tmp_path):
    (tmp_path / "elsewhere").mkdir()
    result = cli("profiles", "list", "--store", str(tmp_path / "elsewhere"), "--format", "csv")
    assert result.exit_code == 0
    assert result.stdout.splitlines() == ["run_id,device,model,created_at,rows,complete,fingerprint"]


def test_command_modules_import_no_heavy_library():
    code = ("import sys, flows.commands.query, flows.commands.profiles; "
            "print(sorted(m for m in ('torch', 'duckdb', 'pyarrow', 'rich') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_query_reads_the_plans_index_next_to_the_profiles(cli, filled, tmp_path):
    from datetime import datetime, timezone

    from memplan.tasks.publish import INDEX_SCHEMA

    plans = tmp_path / "plans"
    empty = cli("query", "select count(*) as n, count(solver) as s from plans", "--plans", str(plans), "-f", "csv")
    assert empty.exit_code == 0, empty.output
    assert empty.stdout == "n,s\n0,0\n"
    (plans / "index").mkdir(parents=True)
    row = {f.name: None for f in INDEX_SCHEMA}
    now = datetime(2026, 1, 2, tzinfo=timezone.utc)
    row.update(plan_id="ab" * 32, alias="resnet18-60pct", model="resnet18", batch_size=8, fingerprint="fp-a",
               solver="checkmate", budget="60pct", budget_bytes=1000, predicted_peak_bytes=900,
               measured_peak_bytes=910, measured_step_ms=5.0, eager_peak_bytes=1500, eager_step_ms=4.0,
               overhead=0.25, device="cpu", created_at=now, published_at=now, path="plans/x.json")
    pq.write_table(pa.Table.from_pylist([row], schema=INDEX_SCHEMA), plans / "index" / "one.parquet")
    sql = ("select p.alias, p.solver, r.rows from plans p join runs r using (fingerprint)")
    result = cli("query", sql, "--plans", str(plans), "-f", "csv")
    assert result.exit_code == 0, result.output
    assert result.stdout == "alias,solver,rows\nresnet18-60pct,checkmate,3\n"


def test_documented_example_queries_run(cli, filled):
    docs = (Path(__file__).resolve().parents[2] / "docs" / "profile-schema.md").read_text()
    queries = re.findall(r'memplan query "(.*?)"', docs, flags=re.S)
    assert len(queries) >= 5
    outputs = []
    for sql in queries:
        result = cli("query", sql, "--format", "json")
        assert result.exit_code == 0, (sql, result.stderr)
        outputs.append(json.loads(result.stdout))
    slowest, by_op = outputs[0], outputs[1]
    assert [r["ms"] for r in slowest] == [3.0, 2.0, 2.0, 1.0, 1.0]
    assert by_op == [{"op": "aten.mm.default", "nodes": 5, "max_workspace": 2, "total_workspace": 4, "total_ms": 9.0}]


@pytest.mark.parametrize("text", ["[bold]x[/bold]", "[/]", "[red", "a[0] = [1, 2]"])
def test_query_tables_print_data_not_markup(cli, filled, text):
    """Brackets in values and column names are data: printed as typed, never styled or refused."""
    sql = f"SELECT '{text}' AS \"{text}\""
    result = cli("query", sql)
    assert result.exit_code == 0, result.output
    assert result.stdout.count(text) == 2


def test_profiles_list_reads_the_store_of_the_given_pipeline_file(cli, filled, make_run, tmp_path):
    project = tmp_path / "proj"
    project.mkdir()
    (project / "pipeline.toml").write_text('store = "mystore"\n[[models]]\nname = "m"\nfactory = "torch.nn:Linear"\n'
                                           'inputs = [{ shape = [4] }]\n[[plans]]\nsolver = "dtr"\nbudgets = [0.5]\n')
    write_run(make_run("fp-c", nodes=1, model="vit"), project / "mystore")
    result = cli("profiles", "list", "--config", str(project / "pipeline.toml"), "--format", "json")
    assert result.exit_code == 0, result.output
    assert [r["model"] for r in json.loads(result.stdout)] == ["vit"]
    assert f"profile store {project / 'mystore'} (store of {project / 'pipeline.toml'})" in result.stderr
    given = cli("profiles", "list", "--config", str(project / "pipeline.toml"), "--store", str(tmp_path / "profiles_db"),
                "--format", "csv")
    assert given.exit_code == 0 and len(given.stdout.splitlines()) == 3              # --store wins: the two runs
