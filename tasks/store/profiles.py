"""The profile store: hive-partitioned Parquet files under `profiles_db/` (DuckDB views over them:
`tasks.store.query`).

The store is a folder or an object-store URL (`s3://bucket/prefix`), reached through one pyarrow
filesystem (`StoreLocation`). Writers write one Parquet file per profiling run so that readers never see
half a file and any number of processes and hosts can write at once: in a local or mounted folder under a
temporary name that does not end in `.parquet`, renamed into place (`os.replace`); in an object store as
one PUT of the finished file under its final key (an object appears whole or not at all). Nobody opens a
DuckDB database file read-write. Readers (`read_runs`) list the finished files, read them with pyarrow,
skip (with a `ProfileStoreWarning` naming them) files that are truncated, are not memplan profiles or
hold impossible costs, and hand DuckDB the rows as in-memory Arrow tables on a sealed connection
(`tasks.store.query.connect`: no file or network access, locked configuration), so SQL never touches a file or the network.
Layout, columns and views: docs/profile-schema.md.
"""

from __future__ import annotations

import os
import re
import uuid
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from memplan.tasks.store.schema import (
    REQUIRED,
    SCHEMA,
    SCHEMA_KEY,
    SCHEMA_VERSION,
    partition_dir,
    run_filename,
)

ENV_VAR = "MEMPLAN_PROFILES_DB"
DEFAULT_STORE = "profiles_db"   # the store folder when nothing names one, from the current folder
NONNEGATIVE = ("time_ms", "output_bytes", "workspace_bytes")   # the costs planners read: finite, >= 0
_RUN_ID = re.compile(r"[A-Za-z0-9._-]+")


class ProfileStoreWarning(UserWarning):
    """A file in the store was skipped (truncated, foreign or unreadable)."""


class ProfileNotFoundError(LookupError):
    """No complete profiling run exists for the requested graph fingerprint and device."""


def is_url(location: str | os.PathLike) -> bool:
    """Whether a store location is a URL (`s3://bucket/prefix`, `file:///abs/path`) rather than a folder."""
    return "://" in str(location)


def store_root(root: str | os.PathLike | None = None) -> Path | str:
    """The store: `root` if given, else `$MEMPLAN_PROFILES_DB`, else `DEFAULT_STORE` in the current folder
    (`./profiles_db`); a folder as an absolute `Path`, a URL as the string given."""
    chosen = root if root is not None else os.environ.get(ENV_VAR) or DEFAULT_STORE
    return str(chosen) if is_url(chosen) else Path(chosen).expanduser().resolve()


@dataclass(frozen=True)
class StoreLocation:
    """The store as a pyarrow filesystem and a base path in it. Local folders (and `file://` URLs) use
    the local filesystem; any other URL goes to `pyarrow.fs.FileSystem.from_uri` (`s3://bucket/prefix`,
    with the endpoint and credentials from the URL's query, e.g. `?endpoint_override=host:port&scheme=http`,
    or from the usual `AWS_*` environment variables)."""

    root: Path | str      # as store_root gives it, for messages
    fs: object            # pyarrow.fs.FileSystem
    base: str             # the store's folder inside `fs`, without a trailing slash

    @property
    def local(self) -> bool:
        return isinstance(self.root, Path)

    def path(self, *parts: str) -> str:
        return "/".join((self.base, *parts))

    def shown(self, path: str) -> Path | str:
        """`path` as users see it: a local `Path`, or a URL with the store's scheme."""
        if self.local:
            return Path(path)
        scheme = str(self.root).split("://", 1)[0]
        return f"{scheme}://{path}"

    def parquet_files(self) -> list[str]:
        """Every `*.parquet` file under the store (an absent store has none)."""
        from pyarrow import fs as pafs

        try:
            infos = self.fs.get_file_info(pafs.FileSelector(self.base, recursive=True, allow_not_found=True))
        except FileNotFoundError:
            return []
        return sorted(i.path for i in infos if i.type == pafs.FileType.File and i.base_name.endswith(".parquet"))

    def exists(self, path: str) -> bool:
        from pyarrow import fs as pafs

        return self.fs.get_file_info(path).type != pafs.FileType.NotFound

    def put(self, path: str, data: bytes) -> None:
        """Write `data` at `path` so that readers see the whole file or none of it (see the module doc)."""
        if self.local:
            target = Path(path)
            target.parent.mkdir(parents=True, exist_ok=True)
            temp = target.with_name(f".{target.stem}.{os.getpid()}.partial")
            try:
                with open(temp, "wb") as handle:
                    handle.write(data)
                    handle.flush()
                    os.fsync(handle.fileno())
                os.replace(temp, target)
            finally:
                temp.unlink(missing_ok=True)
        else:
            with self.fs.open_output_stream(path) as stream:   # the object exists only once this closes
                stream.write(data)

    def read_table(self, path: str) -> pa.Table:
        """One Parquet file, read as a plain file (no partition columns added from its path)."""
        with self.fs.open_input_file(path) as handle:
            return pq.read_table(handle)


def locate(root: str | os.PathLike | None = None) -> StoreLocation:
    """The `StoreLocation` of `root` (resolved like `store_root`)."""
    from pyarrow import fs as pafs

    where = store_root(root)
    if isinstance(where, Path):
        return StoreLocation(where, pafs.LocalFileSystem(), where.as_posix())
    try:
        fs, base = pafs.FileSystem.from_uri(where)
    except (pa.ArrowException, ValueError, OSError) as exc:
        raise ValueError(f"Profile store URL {where!r} cannot be opened: {exc}. Give a folder, or a URL such "
                         f"as s3://bucket/prefix (endpoint in ?endpoint_override=host:port&scheme=http or "
                         f"AWS_ENDPOINT_URL, credentials in AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY).") from None
    if not is_url(where) or where.startswith("file://"):
        return StoreLocation(Path(base), fs, base.rstrip("/"))
    return StoreLocation(where, fs, base.rstrip("/"))


def check_store(root: str | os.PathLike | None = None) -> None:
    """Refuse, in seconds, a store whose bucket cannot be read (`tasks.store.access.check_location`)."""
    from memplan.tasks.store.access import check_location

    check_location(locate(root))


def new_run_id() -> str:
    """A run id that sorts by creation time and is unique across hosts: `<UTC time>-<random hex>`."""
    return f"{datetime.now(timezone.utc):%Y%m%dT%H%M%S%fZ}-{uuid.uuid4().hex[:12]}"


def _single(table: pa.Table, column: str):
    values = table.column(column).unique().to_pylist()
    if len(values) != 1:
        raise ValueError(f"A profile run file holds exactly one {column}, but the rows carry {values!r}: "
                         f"write one file per run (split the rows by {column}).")
    return values[0]


def _as_run_table(rows: pa.Table | list[dict]) -> pa.Table:
    """Cast `rows` to the schema and check that they form one well-formed run."""
    if isinstance(rows, pa.Table):
        rows = rows.to_pylist()
    unknown = sorted({key for row in rows for key in row} - set(SCHEMA.names))
    if unknown:
        raise ValueError(f"Profile rows carry columns {unknown} that schema version {SCHEMA_VERSION} does not "
                         f"define (docs/profile-schema.md); fix the names or add the columns to the schema.")
    try:
        table = pa.Table.from_pylist(rows, schema=SCHEMA)
    except (pa.ArrowInvalid, pa.ArrowTypeError) as exc:
        raise ValueError(f"Profile rows do not match profile schema version {SCHEMA_VERSION} "
                         f"(docs/profile-schema.md): {exc}. Build the rows with tasks.profile.stage or give every "
                         f"column of tasks.store.schema.SCHEMA with its type.") from exc
    if table.num_rows == 0:
        raise ValueError("A profile run needs at least one row; nothing was written.")
    for column in REQUIRED:
        if table.column(column).null_count:
            raise ValueError(f"Profile column {column!r} is missing or null in some rows; every row needs it "
                             f"(docs/profile-schema.md).")
    for column in ("run_id", "fingerprint", "model", "device", "graph_nodes", "schema_version"):
        _single(table, column)
    run_id = _single(table, "run_id")
    if not _RUN_ID.fullmatch(run_id):
        raise ValueError(f"run_id {run_id!r} may only hold letters, digits, '.', '_' and '-' "
                         f"(use tasks.store.profiles.new_run_id()).")
    if _single(table, "schema_version") != SCHEMA_VERSION:
        raise ValueError(f"schema_version must be {SCHEMA_VERSION} for files written by this memplan.")
    ids = table.column("node_id").to_pylist()
    if len(set(zip(ids, table.column("impl").to_pylist()))) != table.num_rows:
        raise ValueError(f"Run {run_id} has more than one row for some (node_id, impl): each node and "
                         f"implementation variant is measured once per run.")
    graph_nodes = _single(table, "graph_nodes")
    if min(ids) < 0 or max(ids) >= graph_nodes:
        raise ValueError(f"Run {run_id}: node_id must lie in [0, graph_nodes={graph_nodes}), got "
                         f"{min(ids)}..{max(ids)}.")
    return table


def write_run(rows: pa.Table | list[dict], root: str | os.PathLike | None = None) -> Path | str:
    """Write one run atomically to `<root>/device=<d>/model=<m>/run-<id>.parquet`; return its path (a URL
    for an object store).

    The file is built in memory and stored with `StoreLocation.put`: in a folder it is written and fsynced
    under `.run-<id>.<pid>.partial` (outside the `*.parquet` glob) and renamed into place; in an object
    store it is one PUT under the final key. Concurrent readers and writers never see partial files.
    """
    table = _as_run_table(rows)
    run_id = _single(table, "run_id")
    where = locate(root)
    final = where.path(partition_dir(_single(table, "device"), _single(table, "model")), run_filename(run_id))
    if where.exists(final):
        raise FileExistsError(f"Profile run {run_id} already exists at {where.shown(final)}; run ids are "
                              f"unique per run.")
    buffer = pa.BufferOutputStream()
    pq.write_table(table, buffer, compression="zstd")
    where.put(final, buffer.getvalue().to_pybytes())
    return where.shown(final)


def _widens(found: pa.DataType, expected: pa.DataType) -> bool:
    """Whether values of type `found` read as `expected` without loss (all-null, or a narrower number)."""
    if pa.types.is_null(found):
        return True
    numbers = ((pa.types.is_integer, "bit_width"), (pa.types.is_floating, "bit_width"))
    return any(kind(found) and kind(expected) and getattr(found, width) <= getattr(expected, width)
               and pa.types.is_signed_integer(found) == pa.types.is_signed_integer(expected)
               for kind, width in numbers)


def schema_problem(schema: pa.Schema, expected: pa.Schema) -> str | None:
    """Why a Parquet file of `schema` cannot be read as rows of `expected` (a required column missing, or a
    column whose type is neither the expected one nor one that widens to it), or None when it can."""
    missing = [f.name for f in expected if not f.nullable and f.name not in schema.names]
    if missing:
        return f"required columns {missing} are missing"
    for field in schema:
        if field.name in expected.names:
            want = expected.field(field.name).type
            if field.type != want and not _widens(field.type, want):
                return f"column {field.name} holds {field.type}, where {want} is expected"
    return None


def conformed(table: pa.Table, expected: pa.Schema) -> pa.Table:
    """`table` (checked by `schema_problem`) with its known columns cast to the `expected` types."""
    fields = [expected.field(f.name) if f.name in expected.names else f for f in table.schema]
    return table.cast(pa.schema(fields, metadata=table.schema.metadata))


def _problem(schema: pa.Schema, profile: bool = True, expected: pa.Schema | None = None) -> str | None:
    """Why a file with `schema` is not a memplan profile (when `profile`) or does not conform to
    `expected`, or None when it is one."""
    if not profile:
        return None if expected is None else schema_problem(schema, expected)
    metadata = schema.metadata or {}
    if SCHEMA_KEY not in metadata:
        return f"not a memplan profile (no {SCHEMA_KEY.decode()} key in its metadata)"
    why = schema_problem(schema, SCHEMA)
    return None if why is None else f"memplan profile whose {why}"


def _bad_rows(table: pa.Table) -> str | None:
    """Why the rows of a profile file cannot be costs (nulls in required columns, negative or non-finite
    measurements), or None when they can."""
    import pyarrow.compute as pc

    for column in REQUIRED:
        if table.column(column).null_count:
            return f"null {column} in some rows"
    for column in NONNEGATIVE:
        if column in table.column_names and table.num_rows:
            values = table.column(column)
            if pa.types.is_floating(values.type) and not pc.all(pc.is_finite(values)).as_py():
                return f"{column} holds NaN or infinite values"
            if pc.min(values).as_py() < 0:
                return f"{column} holds negative values (min {pc.min(values).as_py()})"
    return None


def readable_files(paths, problem: Callable[[Path], str | None], warning: type[Warning], what: str,
                   fix: str) -> list[Path]:
    """The `paths` (sorted) that `problem` finds nothing wrong with; each other one is skipped with a
    `warning` naming it (`what` it is), the problem and the `fix`."""
    good = []
    for path in sorted(paths):
        why = problem(path)
        if why is None:
            good.append(path)
        else:
            warnings.warn(f"Skipping {what}{path}: {why}. {fix}", warning, stacklevel=3)
    return good


def read_tables(where: StoreLocation, paths: list[str], profile: bool = True,
                 expected: pa.Schema | None = None) -> list[tuple[str, pa.Table]]:
    """(path, table) of each readable Parquet file among `paths` (sorted), each read whole and cast to the
    profile schema (or `expected`); every other one is skipped with a `ProfileStoreWarning` naming it: an
    unreadable or truncated file, a foreign schema, a column of the wrong type, bad rows, or a profiling run
    already read from another file (a copy)."""
    tables: dict[str, pa.Table] = {}
    runs: dict[str, str] = {}                       # run id -> the file it was read from

    def problem(path: str) -> str | None:
        try:
            table = where.read_table(path)
        except (OSError, pa.ArrowException) as exc:
            return f"unreadable or truncated Parquet ({exc})"
        why = _problem(table.schema, profile, expected) or (_bad_rows(table) if profile else None)
        if why is not None:
            return why
        table = conformed(table, SCHEMA if profile else expected) if profile or expected is not None else table
        if profile:
            copied = sorted({r for r in table.column("run_id").unique().to_pylist() if r in runs})
            if copied:
                return f"it repeats profiling run {copied[0]} of {where.shown(runs[copied[0]])}"
            runs.update(dict.fromkeys(table.column("run_id").unique().to_pylist(), path))
        tables[path] = table
        return None

    good = readable_files(paths, problem, ProfileStoreWarning, "", f"Delete or move the file out of "
                          f"{where.root} to silence this warning.")
    return [(p, tables[p]) for p in good]


def read_runs(root: str | os.PathLike | None = None) -> tuple[list[Path | str], pa.Table]:
    """The readable profile files of the store (sorted, as `StoreLocation.shown` names them) and all their
    rows as one Arrow table (columns unioned by name; the empty `SCHEMA` table when there are none).
    Other files are skipped with a `ProfileStoreWarning` naming them. This is the store's one reading path:
    `connect` hands its table to DuckDB."""
    from memplan.tasks.store.access import check_location

    where = locate(root)
    check_location(where)                 # a missing bucket is an error, not an empty store
    paths = where.parquet_files()
    read = read_tables(where, paths)
    return [where.shown(p) for p, _ in read], union_tables([t for _, t in read], SCHEMA)


def union_tables(tables: list[pa.Table], schema: pa.Schema) -> pa.Table:
    """The rows of `tables`, columns unioned by name; a column of `schema` that no table has (files of an
    older schema version) is added as nulls."""
    if not tables:
        return schema.empty_table()
    table = pa.concat_tables([t.replace_schema_metadata(None) for t in tables], promote_options="permissive")
    for f in schema:
        if f.name not in table.column_names:
            table = table.append_column(f.name, pa.nulls(table.num_rows, f.type))
    return table


def run_files(root: str | os.PathLike | None = None) -> list[Path | str]:
    """The readable profile files in the store (absolute, sorted); others are skipped with a warning."""
    return read_runs(root)[0]
