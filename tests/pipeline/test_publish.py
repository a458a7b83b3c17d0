"""Publishing: content address, alias, Parquet index read by DuckDB, idempotence, refusals."""

from __future__ import annotations

import os

import pytest

from memplan.tasks.publish import PublishError, plan_id, publish, read_index, resolve


def snapshot(folder):
    """Every path under `folder` with its kind, size and modification time (ns)."""
    return {
        str(p.relative_to(folder)): (p.is_symlink(), os.lstat(p).st_size, os.lstat(p).st_mtime_ns)
        for p in sorted(folder.rglob("*"))
    }


def publish_toy(plans, plan, validation, alias="toy-b4-checkmate-200B"):
    return publish(plan, validation, plans, alias=alias, model="toy", batch_size=4, budget="200B")


def test_plan_id_ignores_creation_time_but_not_content(make_plan):
    assert plan_id(make_plan("2026-01-01T00:00:00+00:00")) == plan_id(make_plan("2027-05-05T12:00:00+00:00"))
    assert plan_id(make_plan()) != plan_id(make_plan(budget_bytes=300))


def test_publish_writes_plan_alias_and_index_row(tmp_path, make_plan, make_validation):
    from memplan.runtime.format.plan import Plan

    plan = make_plan()
    done = publish_toy(tmp_path, plan, make_validation(plan))
    pid = plan_id(plan)
    assert done.changed and done.plan_id == pid
    assert (tmp_path / f"{pid}.json").is_file()
    alias = tmp_path / "toy-b4-checkmate-200B.json"
    assert alias.is_symlink() and os.readlink(alias) == f"{pid}.json"
    assert Plan.load(alias).to_json() == plan.to_json()
    (row,) = read_index(tmp_path)
    assert (row["plan_id"], row["alias"], row["model"], row["batch_size"]) == (pid, alias.stem, "toy", 4)
    assert (row["solver"], row["budget"], row["budget_bytes"], row["fingerprint"]) == ("checkmate", "200B", 200, plan.fingerprint)
    assert (row["predicted_peak_bytes"], row["measured_peak_bytes"], row["eager_peak_bytes"]) == (196, 190, 260)
    assert (row["measured_step_ms"], row["eager_step_ms"], row["overhead"]) == (2.0, 1.6, 0.25)
    assert row["device"] == "cpu" and row["predicted_time_ms"] is None
    assert row["created_at"].isoformat() == "2026-01-01T00:00:00+00:00"


def test_publishing_the_same_plan_again_changes_nothing(tmp_path, make_plan, make_validation):
    publish_toy(tmp_path, make_plan(), make_validation(make_plan()))
    before = snapshot(tmp_path)
    later = make_plan("2030-01-01T00:00:00+00:00")
    again = publish_toy(tmp_path, later, make_validation(later, measured_step_ms=9.0))
    assert not again.changed
    assert snapshot(tmp_path) == before
    assert len(read_index(tmp_path)) == 1


def test_alias_moves_to_the_newest_plan_and_both_stay_indexed(tmp_path, make_plan, make_validation):
    first, second = make_plan(), make_plan(budget_bytes=300)
    publish_toy(tmp_path, first, make_validation(first))
    publish_toy(tmp_path, second, make_validation(second))
    assert os.readlink(tmp_path / "toy-b4-checkmate-200B.json") == f"{plan_id(second)}.json"
    assert {r["plan_id"] for r in read_index(tmp_path)} == {plan_id(first), plan_id(second)}
    assert [r["plan_id"] for r in read_index(tmp_path, "budget_bytes = ?", [300])] == [plan_id(second)]


def test_failed_validation_is_not_published(tmp_path, make_plan, make_validation):
    with pytest.raises(PublishError, match="grad:w differs from eager .* It was not published"):
        publish_toy(tmp_path / "plans", make_plan(), make_validation(make_plan(), passed=False))
    assert not (tmp_path / "plans").exists()


def test_only_the_plan_that_was_validated_is_published(tmp_path, make_plan, make_validation):
    with pytest.raises(PublishError, match="is not the plan that was validated .* it was not published"):
        publish_toy(tmp_path / "plans", make_plan(budget_bytes=300), make_validation(make_plan()))
    assert not (tmp_path / "plans").exists()


def test_bad_alias_is_refused_before_writing(tmp_path, make_plan, make_validation):
    with pytest.raises(PublishError, match="alias '../x'"):
        publish_toy(tmp_path, make_plan(), make_validation(make_plan()), alias="../x")
    assert snapshot(tmp_path) == {}


def test_no_temporary_files_are_left(tmp_path, make_plan, make_validation):
    publish_toy(tmp_path, make_plan(), make_validation(make_plan()))
    assert not [p for p in tmp_path.rglob(".*")]


def test_index_of_an_empty_folder_is_empty(tmp_path):
    assert read_index(tmp_path) == []


def test_resolve_by_alias_id_and_prefix(tmp_path, make_plan, make_validation):
    plan = make_plan()
    publish_toy(tmp_path, plan, make_validation(plan))
    pid = plan_id(plan)
    assert resolve(tmp_path, "toy-b4-checkmate-200B").resolve() == (tmp_path / f"{pid}.json").resolve()
    assert resolve(tmp_path, pid) == tmp_path / f"{pid}.json"
    assert resolve(tmp_path, pid[:10]) == tmp_path / f"{pid}.json"
    with pytest.raises(PublishError, match="no plan 'nothing'"):
        resolve(tmp_path, "nothing")


def test_duckdb_sees_the_index_as_a_table(tmp_path, make_plan, make_validation):
    import duckdb

    publish_toy(tmp_path, make_plan(), make_validation(make_plan()))
    publish_toy(tmp_path, make_plan(budget_bytes=300), make_validation(make_plan(budget_bytes=300)), alias="toy-b4-checkmate-300B")
    with duckdb.connect() as con:
        rows = con.execute(
            "SELECT alias, measured_peak_bytes <= budget_bytes FROM read_parquet(?) ORDER BY budget_bytes",
            [str(tmp_path / "index" / "*.parquet")],
        ).fetchall()
    assert rows == [("toy-b4-checkmate-200B", True), ("toy-b4-checkmate-300B", True)]


def test_index_row_holds_the_overhead_a_max_overhead_limit_is_about(tmp_path, make_plan, make_validation):
    plan = make_plan()
    plan.provenance["max_overhead"] = 0.1
    publish_toy(tmp_path, plan, make_validation(plan, overhead_vs_no_recompute=0.04,
                                                overhead_vs_no_recompute_interval=[0.01, 0.07]))
    other = make_plan(budget_bytes=300)
    publish_toy(tmp_path, other, make_validation(other), alias="toy-b4-checkmate-300B")
    rows = {r["alias"]: r for r in read_index(tmp_path)}
    limited, plain = rows["toy-b4-checkmate-200B"], rows["toy-b4-checkmate-300B"]
    assert (limited["max_overhead"], limited["overhead_vs_no_recompute"]) == (0.1, 0.04)
    assert limited["overhead_vs_no_recompute_interval"] == [0.01, 0.07]
    assert (plain["max_overhead"], plain["overhead_vs_no_recompute"], plain["overhead_vs_no_recompute_interval"]) == \
        (None, None, None)
    within = read_index(tmp_path, "overhead_vs_no_recompute <= max_overhead")
    assert [r["alias"] for r in within] == ["toy-b4-checkmate-200B"]


def test_index_row_names_the_optimizer_a_plan_runs_inside_the_step(tmp_path, make_plan, make_validation):
    plan = make_plan()
    plan.provenance["optimizer_in_step"] = "adamw"
    publish_toy(tmp_path, plan, make_validation(plan))
    other = make_plan(budget_bytes=300)
    publish_toy(tmp_path, other, make_validation(other), alias="toy-b4-checkmate-300B")
    rows = {r["alias"]: r["optimizer_in_step"] for r in read_index(tmp_path)}
    assert rows == {"toy-b4-checkmate-200B": "adamw", "toy-b4-checkmate-300B": None}
    assert [r["alias"] for r in read_index(tmp_path, "optimizer_in_step = 'adamw'")] == ["toy-b4-checkmate-200B"]


def test_index_rows_written_before_the_overhead_columns_still_load(tmp_path, make_plan, make_validation):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from memplan.tasks.publish import INDEX_SCHEMA

    plan = make_plan()
    publish_toy(tmp_path, plan, make_validation(plan))
    (path,) = (tmp_path / "index").glob("*.parquet")
    newer = {"max_overhead", "overhead_vs_no_recompute", "overhead_vs_no_recompute_interval", "device_class", "form",
             "optimizer_in_step"}
    older = pa.schema([f for f in INDEX_SCHEMA if f.name not in newer])
    pq.write_table(pq.read_table(path).select(older.names).cast(older), path)       # as an older memplan wrote it
    (row,) = read_index(tmp_path)
    assert row["plan_id"] == plan_id(plan) and row["overhead"] == 0.25
    assert all(row[name] is None for name in newer)


def test_plans_list_and_query_show_the_overhead_against_no_recomputation(tmp_path, make_plan, make_validation,
                                                                         monkeypatch):
    from typer.testing import CliRunner

    from memplan.flows.cli import app

    monkeypatch.setenv("COLUMNS", "300")
    plan = make_plan()
    plan.provenance["max_overhead"] = 0.1
    publish_toy(tmp_path, plan, make_validation(plan, overhead_vs_no_recompute=0.04,
                                                overhead_vs_no_recompute_interval=[0.01, 0.07]))
    listed = CliRunner().invoke(app, ["plans", "list", "--dir", str(tmp_path)])
    assert listed.exit_code == 0, listed.output
    assert "vs no recompute" in listed.output and "+4% (limit +10%)" in listed.output
    (tmp_path / "store").mkdir()
    query = CliRunner().invoke(app, ["query", "--plans", str(tmp_path), "--store", str(tmp_path / "store"), "-f", "csv",
                                     "SELECT max_overhead, overhead_vs_no_recompute, "
                                     "overhead_vs_no_recompute_interval[2] AS high FROM plans"])
    assert query.exit_code == 0, query.output
    assert query.stdout.endswith("max_overhead,overhead_vs_no_recompute,high\n0.1,0.04,0.07\n")
