"""The profile store's query side: DuckDB views over the readable runs (`VIEWS`), on a sealed in-memory
connection (`SEALED`, `connect`), the cost tables planners read (`load_costs`) and read-only SQL (`query`).
Files are read by `tasks.store.profiles` (`read_runs`); SQL never touches a file or the network. Views:
docs/profile-schema.md.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import NamedTuple

import pyarrow as pa

from memplan.runtime.variants.offered import DEFAULT
from memplan.tasks.store.profiles import ENV_VAR, ProfileNotFoundError, locate, read_runs, read_tables, store_root, union_tables
from memplan.tasks.store.schema import RUN_COLUMNS


_GROUP = ("run_id", "fingerprint", "device")
_RUN_VALUES = ", ".join(c if c in _GROUP else f"any_value({c}) AS {c}" for c in RUN_COLUMNS)
VIEWS = {
    "runs": f"""
        SELECT {_RUN_VALUES},
               count(*) AS rows,
               count(DISTINCT node_id) FILTER (WHERE impl = '{DEFAULT}') AS nodes,
               count(DISTINCT node_id) FILTER (WHERE impl = '{DEFAULT}') = any_value(graph_nodes) AS complete
        FROM profiles GROUP BY {', '.join(_GROUP)}""",
    "latest_runs": """
        SELECT * FROM runs WHERE complete
        QUALIFY row_number() OVER (PARTITION BY fingerprint, device ORDER BY created_at DESC, run_id DESC) = 1""",
    "latest_costs": """
        SELECT p.* FROM profiles p SEMI JOIN latest_runs r
        ON p.run_id = r.run_id AND p.fingerprint = r.fingerprint AND p.device = r.device""",
}


SEALED = {
    "enable_external_access": False,       # no file, URL or extension is read or written by SQL
    "autoinstall_known_extensions": False,
    "autoload_known_extensions": False,
    "allow_community_extensions": False,
    "allow_persistent_secrets": False,
    "temp_directory": "",                  # never spill to ./.tmp
    "python_enable_replacements": False,   # no Python variable is visible as a table
    "lock_configuration": True,            # and none of the above can be SET back
}
"""DuckDB settings of the store's connection: SQL over it can read the in-memory tables and nothing else."""


def _arrow_view(con, name: str, table: pa.Table) -> None:
    con.register(f"_arrow_{name}", table)
    con.execute(f"CREATE VIEW {name} AS SELECT * FROM _arrow_{name}")


def connect(root: str | os.PathLike | None = None,
            extra_views: Mapping[str, tuple[list[Path], pa.Schema]] | None = None):
    """An in-memory DuckDB connection with the store's views that cannot touch any file.

    The readable files are read here with pyarrow and handed to DuckDB as in-memory Arrow tables; the
    connection is opened with external access disabled (no file, URL, extension, temp-directory spill or
    persistent secret) and its configuration locked (`SEALED`), so SQL over it reads the tables and no
    statement (COPY, EXPORT, ATTACH, INSTALL, SET, ...) can write anywhere.

    Views: `profiles` (every row of every readable run), `runs` (one row per run with `rows`, `nodes`
    and `complete`), `latest_runs` (newest complete run per fingerprint and device) and `latest_costs`
    (the rows of those runs); `extra_views` maps more view names to (local Parquet files, schema when
    empty), e.g. the plans index. Every file is read with pyarrow (`read_runs`) and handed to DuckDB as an
    in-memory Arrow table on a connection opened with `SEALED` settings (external access off, configuration
    locked), so queries read the store (local or remote) but can open, write or fetch nothing.
    """
    import duckdb

    con = duckdb.connect(":memory:", config=SEALED)
    _arrow_view(con, "profiles", read_runs(root)[1])
    for name, sql in VIEWS.items():
        con.execute(f"CREATE VIEW {name} AS {sql}")
    for name, (paths, schema) in (extra_views or {}).items():
        paths = [Path(p).resolve().as_posix() for p in paths]
        folder = locate(Path(paths[0]).parent if paths else Path.cwd())
        _arrow_view(con, name, union_tables([t for _, t in read_tables(folder, paths, profile=False, expected=schema)],
                                      schema))
    return con


class NodeCost(NamedTuple):
    """What planners read for one node (`Problem.from_graph` takes exactly this pair)."""

    time_ms: float
    workspace_bytes: int


class VariantCost(NamedTuple):
    """Measured cost of one operator node in one implementation variant; `exact`: whether the profile found
    its outputs equal to the default's bit for bit on the profiled device (None: not compared, as for the
    default itself and in profiles of schema version 1)."""

    time_ms: float
    workspace_bytes: int
    output_bytes: int
    exact: bool | None = None


@dataclass(frozen=True, eq=False)
class CostTable(Mapping):
    """Costs of one profiling run: `table[node_id]` is the default implementation's
    `NodeCost(time_ms, workspace_bytes)`; `variants[node_id][impl]` is the `VariantCost` (with
    `output_bytes` and `exact`) of every measured implementation variant; a variant the profile found
    unavailable on a node is not listed there. `policy_ms`: (forward, recomputation) milliseconds selective
    checkpointing's dispatch adds per forward node of a region (runtime/policy/dispatch_cost.py), None when the run
    did not measure it (a graph not captured for the policy form, a profile before schema version 3).
    """

    fingerprint: str
    device: str
    model: str
    run_id: str
    created_at: datetime
    variants: Mapping[int, Mapping[str, VariantCost]]
    policy_ms: tuple[float, float] | None = None

    def __getitem__(self, node_id: int) -> NodeCost:
        cost = self.variants[node_id][DEFAULT]
        return NodeCost(cost.time_ms, cost.workspace_bytes)

    def __iter__(self) -> Iterator[int]:
        return iter(sorted(self.variants))

    def __len__(self) -> int:
        return len(self.variants)


def _device_filter(device: str | None) -> tuple[str, list]:
    """SQL predicate for a device key (`nvidia-h100-80gb-hbm3`) or a device type (`cuda`, `cuda:1`, `cpu`)."""
    if device is None:
        return "TRUE", []
    return "(device = ? OR device_type = ?)", [device, device.split(":")[0]]


def load_costs(fingerprint: str, device: str | None = None, root: str | os.PathLike | None = None) -> CostTable:
    """The cost table of the newest complete profiling run of graph `fingerprint` (on `device` if given).

    A run is complete when it has a default-implementation row for every node of the graph. Only rows
    whose `fingerprint` equals the one asked for are ever read. Raises `ProfileNotFoundError` saying
    which profile to run when there is none.
    """
    con = connect(root)
    where, params = _device_filter(device)
    found = con.execute(
        f"SELECT run_id, device, model, created_at, policy_forward_ms, policy_recompute_ms FROM runs "
        f"WHERE complete AND fingerprint = ? AND {where} "
        "ORDER BY created_at DESC, run_id DESC LIMIT 1", [fingerprint, *params]).fetchall()
    if not found:
        others = con.execute(
            "SELECT device, model, bool_or(complete), count(*) FROM runs WHERE fingerprint = ? "
            "GROUP BY device, model ORDER BY device", [fingerprint]).fetchall()
        raise ProfileNotFoundError(_missing_message(fingerprint, device, store_root(root), others))
    run_id, run_device, model, created_at, policy_forward, policy_recompute = found[0]
    rows = con.execute(
        "SELECT node_id, impl, time_ms, workspace_bytes, output_bytes, exact FROM profiles "
        "WHERE run_id = ? AND fingerprint = ? AND device = ? AND unavailable IS NULL",
        [run_id, fingerprint, run_device]).fetchall()
    variants: dict[int, dict[str, VariantCost]] = {}
    for node_id, impl, time_ms, workspace, output, exact in rows:
        if impl in variants.setdefault(node_id, {}):
            raise ValueError(f"Profile run {run_id} holds node {node_id} ({impl}) twice: its file is in "
                             f"{store_root(root)} more than once. Delete the copy.")
        variants[node_id][impl] = VariantCost(float(time_ms), int(workspace), int(output), exact)
    policy = None if policy_forward is None or policy_recompute is None else (policy_forward, policy_recompute)
    return CostTable(fingerprint, run_device, model, run_id, created_at, variants, policy)


def _missing_message(fingerprint: str, device: str | None, root: Path, others: list[tuple]) -> str:
    where = f" on device {device!r}" if device else ""
    text = f"No complete profile of graph fingerprint {fingerprint[:16]}...{where} in the profile store {root}."
    if others:
        seen = ", ".join(f"{d} ({m}, {'complete' if c else 'incomplete'}, {n} run(s))" for d, m, c, n in others)
        text += f" Profiles of this graph exist for: {seen}."
    target = device or "the device you plan for"
    return text + (f" Profile this graph on {target} first: `memplan profile` with the pipeline.toml that "
                   f"declares its model, or tasks.profile.stage.profile_graph(graph, model=..., device=...) "
                   f"(set {ENV_VAR} or pass root= if the store lives elsewhere).")


READ_ONLY_STATEMENTS = ("SELECT", "EXPLAIN")


def query(sql: str, root: str | os.PathLike | None = None,
          extra_views: Mapping[str, tuple[list[Path], pa.Schema]] | None = None) -> pa.Table:
    """Run one read-only SQL statement (SELECT, SHOW, DESCRIBE, SUMMARIZE, EXPLAIN) over the store's views.

    Raises `PermissionError` for any other statement and `duckdb.Error` with DuckDB's message for bad SQL.
    """
    import duckdb

    statements = duckdb.extract_statements(sql)
    if len(statements) != 1:
        raise ValueError(f"Give exactly one SQL statement, got {len(statements)}: {sql!r:.200}")
    kind = statements[0].type.name
    if kind not in READ_ONLY_STATEMENTS:
        raise PermissionError(f"The profile store is queried read-only: a {kind} statement is not allowed, "
                              f"only {' / '.join(READ_ONLY_STATEMENTS)} (SHOW, DESCRIBE and SUMMARIZE count "
                              f"as SELECT). Write results elsewhere with --format csv|json|parquet.")
    return connect(root, extra_views).sql(sql).to_arrow_table()
