"""Fixtures of the profile-store tests: a private store folder and a factory of synthetic runs."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

import pytest

from memplan.tasks.store.profiles import ENV_VAR, new_run_id
from memplan.tasks.store.schema import SCHEMA_VERSION

T0 = datetime(2026, 1, 1, tzinfo=timezone.utc)


@pytest.fixture
def store(tmp_path, monkeypatch):
    """An empty store folder, also set as $MEMPLAN_PROFILES_DB so defaults resolve to it (from a working
    folder without a pipeline.toml, whose store the commands would read first)."""
    root = tmp_path / "profiles_db"
    monkeypatch.setenv(ENV_VAR, str(root))
    monkeypatch.chdir(tmp_path)
    return root


@pytest.fixture
def make_run():
    """`make_run(fingerprint, nodes=3, device="cpu", model="mlp", minutes=0, skip=(), impls=("default",))`
    returns the rows of one run; time_ms of node i is `scale * (i + 1)`, workspace i, outputs 4 * (i + 1)."""

    def build(fingerprint, nodes=3, device="cpu", model="mlp", minutes=0, skip=(), impls=("default",),
              scale=1.0, graph_nodes=None):
        run_id = new_run_id()
        return [
            dict(schema_version=SCHEMA_VERSION, run_id=run_id, created_at=T0 + timedelta(minutes=minutes),
                 fingerprint=fingerprint, model=model, graph_nodes=nodes if graph_nodes is None else graph_nodes,
                 device=device, device_type=device.split("-")[0], device_name=device.upper(), host="host-a",
                 node_id=i, node_name=f"n{i}", op="aten.mm.default", targets=["aten.mm.default"],
                 phase="forward", impl=impl, time_ms=scale * (i + 1) + (0.5 if impl != "default" else 0.0),
                 time_ms_min=scale * (i + 1), time_ms_iqr=0.0, input_bytes=8, output_bytes=4 * (i + 1),
                 workspace_bytes=i)
            for i in range(nodes) if i not in skip for impl in impls
        ]

    return build
