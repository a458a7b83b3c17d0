"""Profile store: atomic hive-partitioned writes, DuckDB views, skipped bad files, `load_costs`."""

from __future__ import annotations

import shutil
import warnings

import duckdb
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from memplan.tasks.store.profiles import ProfileNotFoundError, ProfileStoreWarning, run_files, store_root, write_run
from memplan.tasks.store.query import connect, load_costs


def test_write_run_is_hive_partitioned_and_leaves_no_temp_files(store, make_run):
    path = write_run(make_run("fp-a", model="pkg.models:tiny net"), store)
    assert path.parent.relative_to(store).as_posix() == "device=cpu/model=pkg.models%3Atiny%20net"
    assert path.name.startswith("run-") and path.suffix == ".parquet"
    assert [p.name for p in path.parent.iterdir()] == [path.name]
    hive = duckdb.connect().execute(
        f"SELECT DISTINCT device, model FROM read_parquet('{store}/**/*.parquet', hive_partitioning = true)"
    ).fetchall()
    assert hive == [("cpu", "pkg.models:tiny net")]


def test_views_read_every_row_with_its_values(store, make_run):
    rows_a, rows_b = make_run("fp-a", nodes=3, model="mlp"), make_run("fp-b", nodes=5, model="gpt", device="cuda-h100")
    write_run(rows_a)
    write_run(pa.Table.from_pylist(rows_b))
    con = connect()
    assert con.execute("SELECT model, count(*) FROM profiles GROUP BY model ORDER BY model").fetchall() == [
        ("gpt", 5), ("mlp", 3)]
    got = con.execute("SELECT node_id, time_ms, output_bytes, workspace_bytes FROM profiles "
                      "WHERE fingerprint = 'fp-b' ORDER BY node_id").fetchall()
    assert got == [(r["node_id"], r["time_ms"], r["output_bytes"], r["workspace_bytes"]) for r in rows_b]
    runs = con.execute("SELECT run_id, device, rows, nodes, complete FROM runs ORDER BY device").fetchall()
    assert runs == [(rows_a[0]["run_id"], "cpu", 3, 3, True), (rows_b[0]["run_id"], "cuda-h100", 5, 5, True)]


def test_truncated_and_foreign_files_are_skipped_with_a_warning_naming_them(store, make_run):
    rows = make_run("fp-a")
    good = write_run(rows)
    truncated = good.parent / "run-truncated.parquet"
    shutil.copyfile(good, truncated)
    with open(truncated, "r+b") as f:
        f.truncate(truncated.stat().st_size // 2)
    foreign = store / "device=cpu" / "model=mlp" / "other.parquet"
    pq.write_table(pa.table({"a": [1, 2]}), foreign)
    (good.parent / ".run-x.123.partial").write_bytes(b"half a file")
    with pytest.warns(ProfileStoreWarning) as caught:
        con = connect()
        assert con.execute("SELECT count(*) FROM profiles").fetchall() == [(3,)]
        assert load_costs("fp-a").run_id == rows[0]["run_id"]
    messages = " ".join(str(w.message) for w in caught)
    assert str(truncated) in messages and str(foreign) in messages and ".partial" not in messages
    assert len(caught) == 4  # two files, seen by connect() and again by load_costs()


def test_load_costs_picks_the_newest_complete_run(store, make_run):
    old = make_run("fp-a", minutes=0, scale=1.0)
    new = make_run("fp-a", minutes=10, scale=2.0)
    newer_incomplete = make_run("fp-a", minutes=20, scale=3.0, skip={1})
    for rows in (new, old, newer_incomplete):
        write_run(rows)
    costs = load_costs("fp-a")
    assert costs.run_id == new[0]["run_id"] and costs.fingerprint == "fp-a" and costs.device == "cpu"
    assert dict(costs) == {r["node_id"]: (r["time_ms"], r["workspace_bytes"]) for r in new}
    assert costs[2].time_ms == 6.0 and costs[2].workspace_bytes == 2
    assert costs.variants[2]["default"] == (6.0, 2, 12, None) and costs.variants[2]["default"].output_bytes == 12


def test_load_costs_never_uses_another_fingerprint(store, make_run):
    mine = make_run("fp-a", minutes=0)
    write_run(mine)
    write_run(make_run("fp-b", minutes=60, scale=100.0))
    write_run(make_run("fp-a-longer", minutes=90, scale=100.0))
    costs = load_costs("fp-a")
    assert costs.run_id == mine[0]["run_id"]
    assert [c.time_ms for c in costs.values()] == [1.0, 2.0, 3.0]
    with pytest.raises(ProfileNotFoundError, match=r"fingerprint fp-c.*memplan profile"):
        load_costs("fp-c")


def test_load_costs_filters_by_device_key_or_type_and_says_what_exists(store, make_run):
    cpu = make_run("fp-a", device="cpu", minutes=30)
    gpu = make_run("fp-a", device="cuda-h100", minutes=0, scale=0.01)
    write_run(cpu)
    write_run(gpu)
    assert load_costs("fp-a").run_id == cpu[0]["run_id"]
    assert load_costs("fp-a", "cuda-h100").run_id == gpu[0]["run_id"]
    assert load_costs("fp-a", "cuda:0").run_id == gpu[0]["run_id"]
    with pytest.raises(ProfileNotFoundError) as info:
        load_costs("fp-a", "cuda-a100")
    text = str(info.value)
    assert "'cuda-a100'" in text and "cpu (mlp, complete, 1 run(s))" in text and "cuda-h100" in text


def test_implementation_variants(store, make_run):
    rows = make_run("fp-a", impls=("default", "winograd"))
    write_run(rows)
    costs = load_costs("fp-a")
    assert len(costs) == 3 and set(costs.variants[1]) == {"default", "winograd"}
    assert costs[1].time_ms == 2.0 and costs.variants[1]["winograd"].time_ms == 2.5
    write_run(make_run("fp-b", impls=("winograd",), minutes=5))
    with pytest.raises(ProfileNotFoundError, match="fp-b.*incomplete"):
        load_costs("fp-b")


@pytest.mark.parametrize("edit, message", [
    (lambda rows: [{k: v for k, v in r.items() if k != "time_ms"} for r in rows], "time_ms"),
    (lambda rows: rows[:1] + [dict(rows[1], run_id="other")], "exactly one run_id"),
    (lambda rows: rows + rows[:1], r"more than one row for some \(node_id, impl\)"),
    (lambda rows: [dict(r, node_id=r["node_id"] + 1) for r in rows], r"node_id must lie in \[0, graph_nodes=3\)"),
    (lambda rows: [dict(r, run_id="../escape") for r in rows], "may only hold letters"),
    (lambda rows: [], "at least one row"),
    (lambda rows: [dict(r, time_msec=1.0) for r in rows], r"columns \['time_msec'\]"),
    (lambda rows: [dict(r, time_ms="fast") for r in rows], "do not match profile schema"),
])
def test_write_run_rejects_malformed_rows(store, make_run, edit, message):
    with pytest.raises(ValueError, match=message):
        write_run(edit(make_run("fp-a")))
    assert not store.exists() or run_files() == []


def test_write_run_refuses_to_overwrite_a_run(store, make_run):
    rows = make_run("fp-a")
    write_run(rows)
    with pytest.raises(FileExistsError, match=rows[0]["run_id"]):
        write_run(rows)


def test_connection_reads_the_store_but_writes_nothing(store, make_run, tmp_path):
    write_run(make_run("fp-a"))
    con = connect()
    for sql in (f"COPY profiles TO '{tmp_path / 'out.csv'}'", "SELECT * FROM read_csv('/etc/hostname')",
                "SET enable_external_access = true"):
        with pytest.raises(duckdb.Error):
            con.execute(sql)
    assert not (tmp_path / "out.csv").exists()
    assert con.execute("SELECT count(*) FROM latest_costs").fetchall() == [(3,)]


def test_empty_store_has_typed_views_and_a_helpful_error(store):
    con = connect()
    assert con.execute("SELECT count(*) FROM profiles").fetchall() == [(0,)]
    described = {r[0]: r[1] for r in con.execute("DESCRIBE profiles").fetchall()}
    assert described["time_ms"] == "DOUBLE" and described["targets"] == "VARCHAR[]"
    assert con.execute("SELECT count(*) FROM latest_costs").fetchall() == [(0,)]
    with pytest.raises(ProfileNotFoundError, match=str(store)):
        load_costs("fp-a")


def test_store_root_argument_beats_environment(store, tmp_path):
    assert store_root() == store
    assert store_root(tmp_path / "x") == tmp_path / "x"


def test_warning_free_store_emits_no_warning(store, make_run):
    write_run(make_run("fp-a"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert len(load_costs("fp-a")) == 3


def _bad_files(store, make_run):
    """A store with one good run (fp-a) and one file of each bad kind; returns (good rows, bad file paths)."""
    rows = make_run("fp-a")
    good = write_run(rows)
    folder = good.parent
    typed = pq.read_table(write_run(make_run("fp-b"), store.parent / "elsewhere"))
    wrong_type = folder / "run-wrong-type.parquet"                    # a run file whose node_id is text
    pq.write_table(typed.set_column(typed.schema.get_field_index("node_id"), "node_id",
                                    pa.array([str(v) for v in typed.column("node_id").to_pylist()])), wrong_type)
    copy = folder / "run-copy.parquet"                                # the good run under a second name
    shutil.copyfile(good, copy)
    foreign = folder / "foreign.parquet"
    pq.write_table(pa.table({"node_id": ["x"], "time_ms": ["fast"]}), foreign)
    truncated = folder / "run-truncated.parquet"
    truncated.write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    return rows, [wrong_type, copy, foreign, truncated]


def test_one_bad_file_of_each_kind_never_hides_the_good_rows(store, make_run):
    rows, bad = _bad_files(store, make_run)
    with pytest.warns(ProfileStoreWarning) as caught:
        con = connect()
        assert con.execute("SELECT count(*), count(DISTINCT run_id) FROM profiles").fetchall() == [(3, 1)]
        assert con.execute("SELECT node_id FROM latest_costs ORDER BY node_id").fetchall() == [(0,), (1,), (2,)]
        costs = load_costs("fp-a")
    assert costs.run_id == rows[0]["run_id"] and len(costs) == 3
    messages = " ".join(str(w.message) for w in caught)
    for path in bad:
        assert str(path) in messages, path
    assert "column node_id holds string" in messages and f"repeats profiling run {rows[0]['run_id']}" in messages


def test_every_command_reads_past_bad_store_and_index_files(store, make_run, tmp_path):
    from typer.testing import CliRunner

    from memplan.flows.cli import app

    _bad_files(store, make_run)
    plans = tmp_path / "plans"
    (plans / "index").mkdir(parents=True)
    pq.write_table(pa.table({"plan_id": [1], "alias": [2.5]}), plans / "index" / "mistyped.parquet")
    pq.write_table(pa.table({"something": ["else"]}), plans / "index" / "foreign.parquet")
    runner = CliRunner()
    for args in (["profiles", "list", "--store", str(store)],
                 ["query", "--store", str(store), "--plans", str(plans), "--format", "csv",
                  "SELECT (SELECT count(*) FROM profiles) AS rows, (SELECT count(*) FROM plans) AS plans"],
                 ["plans", "list", "--dir", str(plans)]):
        result = runner.invoke(app, args)
        assert result.exit_code == 0, (args, result.output)
        assert "Traceback" not in result.output and "skipping" in result.output.lower(), args
    query = runner.invoke(app, ["query", "--store", str(store), "--plans", str(plans), "--format", "csv",
                                "SELECT (SELECT count(*) FROM profiles) AS rows, (SELECT count(*) FROM plans) AS plans"])
    assert "rows,plans\n3,0\n" in query.stdout
