"""Helpers of the adversarial tests: a working folder holding a small store, a plans index and a
`.tmp/` folder (DuckDB's default temp directory), and a hash of every file under a folder."""

from __future__ import annotations

import hashlib
from datetime import datetime, timezone
from pathlib import Path

import pytest

T0 = datetime(2026, 1, 1, tzinfo=timezone.utc)
TINY_PIPELINE = """
device = "cpu"
store = "{store}"
cache_dir = "{cache_dir}"
[publish]
dir = "{plans}"
[[models]]
name = "mlp"
factory = "{factory}"
kwargs = {{ in_features = 4, out_features = 3 }}
loss = "mse"
batch_sizes = [2]
inputs = [{{ shape = [4] }}, {{ shape = [3] }}]
[[plans]]
solver = "checkpoint-all"
budgets = [1.0]
"""


def tiny_pipeline(folder: Path, store: str = "profiles_db", cache_dir: str = ".cache/memplan", plans: str = "plans",
                  factory: str = "torch.nn:Linear") -> Path:
    """Write the smallest pipeline (one linear layer, checkpoint-all) as `folder/pipeline.toml`."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "pipeline.toml"
    path.write_text(TINY_PIPELINE.format(store=store, cache_dir=cache_dir, plans=plans, factory=factory))
    return path


def profile_rows(fingerprint: str = "fp-a", nodes: int = 3, time_ms: float = 1.0, model: str = "mlp") -> list[dict]:
    """The rows of one synthetic profiling run on cpu: node i takes `time_ms * (i + 1)` ms."""
    from memplan.tasks.store.profiles import new_run_id
    from memplan.tasks.store.schema import SCHEMA_VERSION

    run_id = new_run_id()
    return [dict(schema_version=SCHEMA_VERSION, run_id=run_id, created_at=T0, fingerprint=fingerprint, model=model,
                 graph_nodes=nodes, device="cpu", device_type="cpu", node_id=i, op="aten.mm.default", impl="default",
                 time_ms=time_ms * (i + 1), output_bytes=4 * (i + 1), workspace_bytes=i) for i in range(nodes)]


def index_row(plan_id: str = "ab" * 32) -> dict:
    from memplan.tasks.publish import INDEX_SCHEMA

    row = {f.name: None for f in INDEX_SCHEMA}
    row.update(plan_id=plan_id, alias="mlp-b4-checkmate-60pct", model="mlp", batch_size=4, fingerprint="fp-a",
               solver="checkmate", budget="60pct", budget_bytes=1000, predicted_peak_bytes=900,
               measured_peak_bytes=910, measured_step_ms=5.0, eager_peak_bytes=1500, eager_step_ms=4.0,
               overhead=0.25, device="cpu", created_at=T0, published_at=T0, path=f"{plan_id}.json")
    return row


@pytest.fixture
def workdir(tmp_path, monkeypatch) -> Path:
    """`tmp_path` as the working folder: `profiles_db/` with one run, `plans/index/` with one row, `.tmp/`."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from memplan.tasks.publish import INDEX_SCHEMA
    from memplan.tasks.store.profiles import ENV_VAR, write_run

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv(ENV_VAR, str(tmp_path / "profiles_db"))
    write_run(profile_rows(), tmp_path / "profiles_db")
    (tmp_path / "plans" / "index").mkdir(parents=True)
    pq.write_table(pa.Table.from_pylist([index_row()], schema=INDEX_SCHEMA),
                   tmp_path / "plans" / "index" / f"{'ab' * 32}.parquet")
    (tmp_path / "plans" / f"{'ab' * 32}.json").write_text("{}")
    (tmp_path / ".tmp").mkdir()
    return tmp_path


def tree_hashes(*roots: Path) -> dict[str, str]:
    """SHA-256 of every file (and the name of every folder) under `roots`."""
    found = {}
    for root in roots:
        if not root.exists():
            continue
        for path in sorted(root.rglob("*")):
            found[str(path)] = hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else "dir"
    return found
