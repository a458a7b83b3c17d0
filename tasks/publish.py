"""Publish validated plans into `plans/`: content-addressed JSON, a readable alias, a Parquet index.

Layout (every write is atomic: temporary dot-name, then `os.replace`):

    plans/<plan_id>.json          the plan; plan_id = SHA-256 of its canonical JSON minus checksum and
                                  provenance.created_at, so re-solving the same plan gives the same id
    plans/<alias>.json            symlink to the newest plan published under that alias
    plans/index/<plan_id>.parquet one index row (INDEX_SCHEMA); DuckDB reads `plans/index/*.parquet`

Publishing the same plan again changes nothing: the plan file, its index row and an alias that already
points at it are left untouched. Publishing is all or nothing: the index row is built before any file is
written, and a failure after that removes what this call wrote.
"""

from __future__ import annotations

import os
import re
import tempfile
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Annotated, Any, get_args, get_type_hints

import pyarrow as pa
import pyarrow.parquet as pq

from memplan.runtime.format.jsonio import READABLE, write_json_atomic
from memplan.runtime.format.plan import Plan, plan_id
from memplan.tasks.config import MemplanError
from memplan.tasks.records import Published, Validated
from memplan.tasks.store.profiles import readable_files, schema_problem

_ALIAS = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
_PLAN_ID = re.compile(r"^[0-9a-f]{64}$")
DEVICE_CLASS_VAR = "MEMPLAN_DEVICE_CLASS"
"""The fleet's device class of the host that validates (set by `memplan deploy` in its deployments' runs)."""


class PublishError(MemplanError):
    """A plan that cannot be published or found in `plans/`."""


class PlansIndexWarning(UserWarning):
    """A file of the plans index was skipped (unreadable or foreign)."""


@dataclass(frozen=True)
class IndexRow:
    """What the index says about one published plan (the measured fields come from its `Validated` record).
    The index's Parquet schema is derived from these fields (`INDEX_SCHEMA`): `X | None` is nullable."""

    plan_id: str
    alias: str
    model: str
    batch_size: Annotated[int, pa.int32()]
    fingerprint: str
    solver: str
    form: str | None
    optimizer_in_step: str | None                     # the optimizer the plan runs inside the step (None: after it)
    budget: str
    budget_bytes: int
    predicted_peak_bytes: int
    predicted_time_ms: float | None
    measured_peak_bytes: int
    measured_step_ms: float
    eager_peak_bytes: int
    eager_step_ms: float
    overhead: float
    max_overhead: float | None                        # a max_overhead plan's limit, and its overhead measured against
    overhead_vs_no_recompute: float | None            # the no-recomputation plan, with its 95% interval (None: not timed)
    overhead_vs_no_recompute_interval: Annotated[list[float] | None, pa.list_(pa.float64())]
    device: str
    device_name: str | None
    device_class: str | None
    created_at: datetime
    published_at: datetime
    path: str


_ARROW = {str: pa.string(), int: pa.int64(), float: pa.float64(), datetime: pa.timestamp("us", tz="UTC")}


def arrow_schema(row: type) -> pa.Schema:
    """The Parquet schema of a row dataclass: each field's type (`_ARROW`, or the Arrow type an
    `Annotated[..., pa.DataType]` names), nullable when it admits None."""
    fields = []
    for name, hint in get_type_hints(row, include_extras=True).items():
        arrow = next((m for m in getattr(hint, "__metadata__", ()) if isinstance(m, pa.DataType)), None)
        hint = hint.__origin__ if arrow is not None else hint          # Annotated[X, arrow] -> X
        args = get_args(hint)
        kinds = [a for a in args if a is not type(None)] if type(None) in args else [hint]
        fields.append(pa.field(name, arrow or _ARROW[kinds[0]], nullable=type(None) in args))
    return pa.schema(fields)


INDEX_SCHEMA = arrow_schema(IndexRow)


def publish(
    plan: Plan, validation: Validated, plans_dir: str | os.PathLike, *, alias: str, model: str, batch_size: int, budget: str
) -> Published:
    """Write `plan` under its content address, its index row and the alias; idempotent.

    Only a plan whose `validation` passed is published; `model`, `batch_size` and `budget` (the budget
    as declared, e.g. `60pct`) are the index fields that the plan itself does not carry.
    """
    if not validation.passed:
        raise PublishError(validation.explain(alias) + " It was not published.")
    check_alias(alias)
    plans_dir = Path(plans_dir)
    pid = plan_id(plan)
    if pid != validation.plan_id:
        raise PublishError(f"plan {alias} ({pid[:12]}) is not the plan that was validated ({validation.plan_id[:12]}): "
                           f"its file changed after validation. Validate it again; it was not published.")
    target = plans_dir / f"{pid}.json"
    index_file = plans_dir / "index" / f"{pid}.parquet"
    alias_path = plans_dir / f"{alias}.json"
    row = None
    if _index_problem(index_file) is not None:           # missing, or unreadable: (re)write the row
        row = _row_table(_index_row(plan, pid, alias, validation, target.name, model=model, batch_size=batch_size,
                                    budget=budget))       # built before anything is written: all or nothing
    written: list[Path] = []
    try:
        if not target.exists():
            write_json_atomic(target, plan.to_json())
            written.append(target)
        if row is not None:
            _write_row(index_file, row)
            written.append(index_file)
        if not (alias_path.is_symlink() and os.readlink(alias_path) == target.name):
            _symlink_atomic(target.name, alias_path)
            written.append(alias_path)
    except BaseException:
        for path in reversed(written):                  # a failure (disk full, Ctrl-C) leaves no partial plan
            path.unlink(missing_ok=True)
        raise
    return Published(plan_id=pid, path=str(target), alias_path=str(alias_path), changed=bool(written))


def _index_row(
    plan: Plan, pid: str, alias: str, validation: Validated, filename: str, *, model: str, batch_size: int, budget: str
) -> IndexRow:
    provenance, predicted = plan.provenance, plan.predicted
    missing = [k for k in ("solver", "budget_bytes") if provenance.get(k) is None]
    if missing or predicted.get("peak_bytes") is None:
        raise PublishError(
            f"plan {pid[:12]} lacks provenance {missing or ''} / predicted.peak_bytes; only plans made by "
            "`memplan solve` or the pipeline carry them. Re-solve the plan."
        )
    now = datetime.now(timezone.utc)
    created = provenance.get("created_at")
    return IndexRow(
        plan_id=pid,
        alias=alias,
        model=model,
        batch_size=batch_size,
        fingerprint=plan.fingerprint,
        solver=provenance["solver"],
        form=plan.form,
        optimizer_in_step=provenance.get("optimizer_in_step"),
        budget=budget,
        budget_bytes=int(provenance["budget_bytes"]),
        predicted_peak_bytes=int(predicted["peak_bytes"]),
        predicted_time_ms=predicted.get("time_ms"),
        measured_peak_bytes=validation.measured_peak_bytes,
        measured_step_ms=validation.measured_step_ms,
        eager_peak_bytes=validation.eager_peak_bytes,
        eager_step_ms=validation.eager_step_ms,
        overhead=validation.overhead,
        max_overhead=provenance.get("max_overhead"),
        overhead_vs_no_recompute=validation.overhead_vs_no_recompute,
        overhead_vs_no_recompute_interval=validation.overhead_vs_no_recompute_interval,
        device=validation.device,
        device_name=validation.device_name,
        device_class=os.environ.get(DEVICE_CLASS_VAR) or None,
        created_at=datetime.fromisoformat(created) if created else now,
        published_at=now,
        path=filename,
    )


def _row_table(row: IndexRow) -> pa.Table:
    try:
        return pa.Table.from_pylist([asdict(row)], schema=INDEX_SCHEMA)
    except (pa.ArrowException, OverflowError, TypeError) as exc:
        raise PublishError(f"plan {row.plan_id[:12]} ({row.alias}) cannot be indexed: {exc}. Its index fields "
                           f"(budget {row.budget_bytes!r} B, predicted peak {row.predicted_peak_bytes!r} B, ...) must "
                           f"fit the plans index schema (64-bit integers); nothing was published.") from None


def _write_row(path: Path, table: pa.Table) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.stem}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        pq.write_table(table, tmp)
        os.chmod(tmp, READABLE)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _symlink_atomic(target: str, link: Path) -> None:
    link.parent.mkdir(parents=True, exist_ok=True)
    tmp = link.parent / f".{link.name}.{os.getpid()}.tmp"
    tmp.unlink(missing_ok=True)
    os.symlink(target, tmp)
    try:
        os.replace(tmp, link)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _index_problem(path: Path) -> str | None:
    """Why the index file `path` cannot be read as an index row, or None when it can."""
    try:
        schema = pq.read_schema(path)
    except FileNotFoundError:
        return "missing"
    except (OSError, pa.ArrowException) as exc:
        return f"unreadable or truncated Parquet ({exc})"
    if "plan_id" not in schema.names:
        return "not a memplan plans index row (no plan_id column)"
    why = schema_problem(schema, INDEX_SCHEMA)
    return None if why is None else f"a plans index row whose {why}"


def index_files(plans_dir: str | os.PathLike) -> list[Path]:
    """The readable index files of `plans_dir`; an unreadable one is skipped with a `PlansIndexWarning`
    (publishing its plan again rewrites it)."""
    return readable_files((Path(plans_dir) / "index").glob("*.parquet"), _index_problem, PlansIndexWarning,
                          "plans index file ", "Publishing its plan again rewrites it; or delete the file.")


def read_index(plans_dir: str | os.PathLike, where: str = "", params: list[Any] | None = None) -> list[dict[str, Any]]:
    """Index rows (newest first) via DuckDB; `where` is an optional SQL condition with `?` parameters.
    Unreadable index files are skipped with a warning (`index_files`); a row written before a nullable column
    existed (device_class, form, overhead_vs_no_recompute, ...) reads it as None."""
    import duckdb

    files = [str(p) for p in index_files(plans_dir)]
    if not files:
        return []
    rows = "(SELECT * FROM read_parquet(?, union_by_name = true) UNION ALL BY NAME SELECT * FROM _index_schema)"
    sql = f"SELECT * FROM {rows} {'WHERE ' + where if where else ''} ORDER BY published_at DESC, alias"
    with duckdb.connect() as con:
        con.register("_index_schema", INDEX_SCHEMA.empty_table())        # every column, even if no file has it
        cursor = con.execute(sql, [files, *(params or [])])
        columns = [d[0] for d in cursor.description]
        return [dict(zip(columns, row)) for row in cursor.fetchall()]


def check_alias(alias: str) -> None:
    """Refuse an alias that is not a plain file name inside the plans folder."""
    if not _ALIAS.match(alias) or len(alias) > 200:
        raise PublishError(f"alias {alias[:80]!r} must be letters, digits, '-', '_' or '.', at most 200 of them "
                           f"(it is a file name inside the plans folder, not a path).")


def resolve(plans_dir: str | os.PathLike, name: str) -> Path:
    """The plan file for a plan id, an id prefix (at least 8 hex digits) or an alias."""
    plans_dir = Path(plans_dir)
    if not _ALIAS.match(name):
        raise PublishError(f"{name!r} is not a plan id or alias: those are names inside the plans folder "
                           f"{plans_dir} (letters, digits, '-', '_', '.'), not paths; see `memplan plans list`.")
    candidates = [plans_dir / f"{name}.json"]
    if re.fullmatch(r"[0-9a-f]{8,64}", name):
        candidates += sorted(p for p in plans_dir.glob(f"{name}*.json") if _PLAN_ID.match(p.stem))
    found = [p for p in candidates if p.exists()]
    if len({p.resolve() for p in found}) > 1:
        raise PublishError(f"plan {name!r} is ambiguous in {plans_dir}: {', '.join(p.name for p in found)}; give more digits.")
    if not found:
        raise PublishError(f"no plan {name!r} in {plans_dir}: give a plan id, an id prefix or an alias (see `memplan plans list`).")
    return found[0]
