"""The profile store's Parquet schema (`memplan-profile`, documented in docs/profile-schema.md).

One Parquet file holds one profiling run: one row per (operator node, implementation variant), with the
run's metadata repeated on every row so that every file describes itself. The version is stored in the
file's key-value metadata; it grows by one whenever a column is added (version 2: `exact`, `unavailable`;
version 3: `policy_forward_ms`, `policy_recompute_ms`).
Readers take every version whose files carry the `REQUIRED` columns and union the rest by name, a column an
older file lacks reading as null.
"""

from __future__ import annotations

from urllib.parse import quote

import pyarrow as pa

SCHEMA_KEY = b"memplan.profile_schema"
SCHEMA_VERSION = 3

_RUN_FIELDS = [
    pa.field("schema_version", pa.int32(), nullable=False),
    pa.field("run_id", pa.string(), nullable=False),
    pa.field("created_at", pa.timestamp("us", tz="UTC"), nullable=False),
    pa.field("fingerprint", pa.string(), nullable=False),
    pa.field("model", pa.string(), nullable=False),
    pa.field("graph_nodes", pa.int32(), nullable=False),
    pa.field("batch_size", pa.int32()),
    pa.field("input_shapes", pa.string()),
    pa.field("device", pa.string(), nullable=False),
    pa.field("device_type", pa.string(), nullable=False),
    pa.field("device_name", pa.string()),
    pa.field("host", pa.string()),
    pa.field("torch_version", pa.string()),
    pa.field("cuda_version", pa.string()),
    pa.field("cudnn_version", pa.string()),
    pa.field("memplan_version", pa.string()),
    pa.field("timer", pa.string()),
    pa.field("warmup", pa.int32()),
    pa.field("repeats", pa.int32()),
    pa.field("rounds", pa.int32()),
    pa.field("threads", pa.int32()),
    pa.field("seed", pa.int64()),
    pa.field("policy_forward_ms", pa.float64()),      # version 3: selective checkpointing's dispatch, per node
    pa.field("policy_recompute_ms", pa.float64()),    # version 3: ... of a region, in its forward / recomputation
]

_ROW_FIELDS = [
    pa.field("node_id", pa.int32(), nullable=False),
    pa.field("node_name", pa.string()),
    pa.field("op", pa.string()),
    pa.field("targets", pa.list_(pa.string())),
    pa.field("phase", pa.string()),
    pa.field("impl", pa.string(), nullable=False),
    pa.field("time_ms", pa.float64(), nullable=False),
    pa.field("time_ms_min", pa.float64()),
    pa.field("time_ms_iqr", pa.float64()),
    pa.field("input_bytes", pa.int64()),
    pa.field("output_bytes", pa.int64(), nullable=False),
    pa.field("workspace_bytes", pa.int64(), nullable=False),
    pa.field("exact", pa.bool_()),           # version 2: variant's outputs equal the default's bit for bit
    pa.field("unavailable", pa.string()),    # version 2: why the variant cannot run on this node (no costs)
]

SCHEMA = pa.schema(_RUN_FIELDS + _ROW_FIELDS, metadata={SCHEMA_KEY: str(SCHEMA_VERSION).encode()})
RUN_COLUMNS = tuple(f.name for f in _RUN_FIELDS)
REQUIRED = tuple(f.name for f in SCHEMA if not f.nullable)


def partition_dir(device: str, model: str) -> str:
    """Relative hive partition folder `device=<d>/model=<m>` (values percent-encoded, as DuckDB reads them)."""
    return f"device={quote(device, safe='')}/model={quote(model, safe='')}"


def run_filename(run_id: str) -> str:
    """File name of one run: only finished files end in `.parquet`, the suffix the readers glob for."""
    return f"run-{run_id}.parquet"
