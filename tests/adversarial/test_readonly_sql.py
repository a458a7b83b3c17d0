"""`memplan query` cannot write: the store's files reach DuckDB as in-memory Arrow tables on a connection
with external access off and its configuration locked, so no statement form changes any file."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from memplan.flows.cli import app

from .conftest import tree_hashes


def _write_attempts(workdir: Path) -> list[str]:
    run = next((workdir / "profiles_db").rglob("*.parquet"))
    index = next((workdir / "plans" / "index").glob("*.parquet"))
    forged = "(SELECT * REPLACE (0.0 AS time_ms) FROM profiles)"
    copies = [
        f"COPY {forged} TO '{run}' (FORMAT parquet, USE_TMP_FILE false, KV_METADATA {{'memplan.profile_schema': '1'}})",
        f"COPY (SELECT 1 AS x) TO '{index}' (FORMAT parquet)",
        f"COPY (SELECT * FROM read_parquet('{run}')) TO '{run}' (FORMAT parquet)",
        "COPY (SELECT 1 AS x) TO '.tmp/x.csv'",
        f"COPY (SELECT 1 AS x) TO '{workdir}/new.csv'",
        f"COPY profiles TO '{workdir}/all' (FORMAT parquet, PARTITION_BY (device))",
        f"EXPORT DATABASE '{workdir}/export'",
        f"ATTACH '{workdir}/new.duckdb' AS w",
        f"ATTACH '{workdir}/new.duckdb' AS w; CREATE TABLE w.t AS SELECT 1",
        "INSTALL httpfs",
        "LOAD httpfs",
        "SET enable_external_access = true",
        "SET lock_configuration = false",
        f"SET temp_directory = '{workdir}/.tmp'",
        f"SET profiling_output = '{workdir}/profile.json'",
        "PRAGMA enable_profiling = 'json'",
        f"PRAGMA profiling_output = '{workdir}/p.json'",
        f"SET log_query_path = '{workdir}/queries.log'",
        "CALL enable_logging()",
        "CREATE TABLE t AS SELECT 1",
        "CREATE VIEW v AS SELECT 1",
        "CREATE PERSISTENT SECRET s (TYPE http, BEARER_TOKEN 'x')",
        f"CREATE TABLE t AS SELECT * FROM read_csv('{workdir}/plans/{'ab' * 32}.json')",
        "SELECT * FROM range(100000) ORDER BY random() LIMIT 1",  # a sort never spills: no temp directory
        f"SELECT * FROM query('COPY (SELECT 1) TO ''{workdir}/q.csv''')",
        f"SELECT * FROM query_table('{run}')",
        f"SELECT 1; COPY (SELECT 1) TO '{workdir}/multi.csv'",
        f"SELECT * FROM read_parquet('{run}')",
    ]
    explained = [f"EXPLAIN ANALYZE {sql}" for sql in copies if not sql.startswith("SELECT")]
    return copies + explained


def test_no_statement_writes_any_file(workdir):
    from memplan.tasks.store.query import connect

    watched = (workdir, Path.home() / ".duckdb")
    before = tree_hashes(*watched)
    attempts = _write_attempts(workdir)
    assert len(attempts) >= 30
    runner = CliRunner()
    con = connect(workdir / "profiles_db")      # the connection itself, without the CLI's statement filter,
    for sql in attempts:                        # taking the attempts one after the other
        result = runner.invoke(app, ["query", sql, "-f", "csv"])
        assert result.exit_code == 1 or "COPY" not in sql, (sql, result.output)
        try:
            con.execute(sql)
        except Exception:
            pass
    assert tree_hashes(*watched) == before
    costs = runner.invoke(app, ["query", "SELECT sum(time_ms) AS t FROM latest_costs", "-f", "csv"])
    assert costs.stdout == "t\n6.0\n"


def test_documented_views_and_readme_queries_still_answer(workdir):
    runner = CliRunner()
    for view in ("profiles", "runs", "latest_runs", "latest_costs", "plans"):
        result = runner.invoke(app, ["query", f"SELECT count(*) AS n FROM {view}", "-f", "csv"])
        assert result.exit_code == 0 and result.stdout == "n\n" + ("3" if "profiles" in view or "costs" in view
                                                                    else "1") + "\n", (view, result.output)
    joined = runner.invoke(app, ["query", "SELECT p.alias, r.nodes FROM plans p JOIN runs r USING (fingerprint)",
                                 "-f", "csv"])
    assert joined.stdout == "alias,nodes\nmlp-b4-checkmate-60pct,3\n"


def test_a_negative_time_in_a_hand_written_profile_skips_the_file_with_a_warning(workdir):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from memplan.tasks.store.profiles import ProfileStoreWarning
    from memplan.tasks.store.query import connect
    from memplan.tasks.store.schema import SCHEMA

    from .conftest import profile_rows

    forged = workdir / "profiles_db" / "device=cpu" / "model=mlp" / "run-forged.parquet"
    pq.write_table(pa.Table.from_pylist(profile_rows("fp-b", time_ms=-1.0), schema=SCHEMA), forged)
    with pytest.warns(ProfileStoreWarning, match=r"run-forged\.parquet: time_ms holds negative values"):
        fingerprints = connect().execute("SELECT DISTINCT fingerprint FROM profiles").fetchall()
    assert fingerprints == [("fp-a",)]
