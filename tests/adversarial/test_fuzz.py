"""Random bytes, random JSON mutations of a valid plan and random mutations of a valid pipeline.toml:
every failure is memplan's own error type with a message, never another exception."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from memplan import runtime
from memplan.runtime.format.jsonio import sha256_hex
from memplan.runtime.format.plan import Plan, PlanError
from memplan.tasks.config import ConfigError, load_config, parse_config

from .conftest import TINY_PIPELINE

FUZZ = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
PLAN = Plan("f" * 64, [{"compute": 0}, {"compute": 1, "impl": "mask"}, {"free": 2}, {"compute": 1}],
            addresses={(0, 0): 0, (1, 1): 64},
            predicted={"peak_bytes": 196, "time_ms": None},
            provenance={"solver": "checkmate", "budget_bytes": 200}).to_json()
TOML = TINY_PIPELINE.format(store="profiles_db", cache_dir=".cache", plans="plans", factory="torch.nn:Linear")

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(min_value=-2**70, max_value=2**70) | st.floats() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12)


def _paths(data, prefix=()):
    """Every (container, key) path of a JSON document."""
    yield prefix
    if isinstance(data, dict):
        for key, value in data.items():
            yield from _paths(value, prefix + (key,))
    elif isinstance(data, list):
        for i, value in enumerate(data):
            yield from _paths(value, prefix + (i,))


@st.composite
def mutated(draw, document):
    """`document` with one random path replaced, deleted, or given a new key."""
    data = json.loads(json.dumps(document))
    paths = [p for p in _paths(data) if p]
    path = draw(st.sampled_from(paths))
    parent = data
    for key in path[:-1]:
        parent = parent[key]
    action = draw(st.sampled_from(["replace", "delete", "add"]))
    if action == "delete":
        del parent[path[-1]]
    elif action == "add" and isinstance(parent, dict):
        parent[draw(st.text(max_size=8))] = draw(json_values)
    else:
        parent[path[-1]] = draw(json_values)
    return data


def _load_plan(payload: bytes) -> None:
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "plan.json"
        path.write_bytes(payload)
        try:
            runtime.load(path, torch.nn.Linear(2, 2), lambda m, x: m(x).sum())
        except PlanError as exc:
            assert str(exc)


@FUZZ
@given(st.binary(max_size=300))
def test_random_bytes_as_a_plan_file_raise_plan_errors(payload):
    _load_plan(payload)


@FUZZ
@given(mutated(PLAN), st.booleans())
@example(PLAN | {"format": [float("inf")]}, True)                # found by CI: no canonical JSON to checksum
@example(PLAN | {"provenance": {"solver": float("inf")}}, False)  # found by a suite run: past the structure checks
def test_mutated_plans_raise_plan_errors(data, fix_checksum):
    if fix_checksum and isinstance(data, dict):     # a consistent checksum gets past it, to the checks behind
        try:
            data["checksum"] = sha256_hex({k: v for k, v in data.items() if k != "checksum"})
        except ValueError:                          # NaN / infinity: no canonical JSON, so no checksum to fix
            pass
    _load_plan(json.dumps(data, allow_nan=True).encode())


@FUZZ
@given(st.lists(st.tuples(st.integers(0, len(TOML)), st.integers(0, 3), st.binary(max_size=3)), min_size=1, max_size=4))
def test_byte_edits_of_a_pipeline_file_raise_config_errors(edits):
    text = TOML.encode()
    for at, cut, insert in edits:
        text = text[:at] + insert + text[at + cut:]
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "pipeline.toml"
        path.write_bytes(text)
        try:
            load_config(path)
        except ConfigError as exc:
            assert str(exc)


@FUZZ
@given(mutated(parse_config.__globals__["tomllib"].loads(TOML)))
def test_mutated_pipeline_tables_raise_config_errors(data):
    try:
        parse_config(data)
    except ConfigError as exc:
        assert str(exc)
