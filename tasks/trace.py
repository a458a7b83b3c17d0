"""Trace stage: capture a model's training step as an operator graph and keep it as JSON.

A graph is stored under the content hash of everything that determines it (`trace_key`): the model
entry (source, kwargs, loss, inputs), the batch size, the device type, the torch version and the source
of `runtime/`. The same key always names the same file, so a trace is made once per key.
"""

from __future__ import annotations

import functools
import hashlib
import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Mapping

from runtime.graph import OpGraph
from tasks.config import ModelConfig


@dataclass(frozen=True)
class Traced:
    """A stored operator graph and the numbers a report needs about it."""

    key: str
    path: str
    fingerprint: str
    model: str
    batch_size: int
    nodes: int
    values: int
    constant_bytes: int

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Traced:
        return cls(**data)


@functools.lru_cache(maxsize=None)
def source_hash(*paths: str) -> str:
    """SHA-256 over the Python sources under `paths` (files or folders of this repository): a cache key
    part that changes when the code producing a result changes."""
    digest = hashlib.sha256()
    root = Path(__file__).resolve().parents[1]
    for name in paths:
        base = root / name
        for path in [base] if base.is_file() else sorted(base.rglob("*.py")):
            digest.update(str(path.relative_to(root)).encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()


def trace_key(spec: ModelConfig, batch_size: int, device: str) -> str:
    """Content hash naming the graph of `spec` at `batch_size` on `device`'s type."""
    import torch

    parts = {
        "model": spec.content_hash(batch_size),
        "device_type": device.split(":")[0],
        "torch": torch.__version__,
        "runtime": source_hash("runtime"),
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()


def graph_path(cache_dir: str | Path, spec: ModelConfig, batch_size: int, key: str) -> Path:
    """Where the graph with trace key `key` lives: `<cache_dir>/graphs/<model>-b<batch>-<key16>.json`."""
    return Path(cache_dir) / "graphs" / f"{spec.name}-b{batch_size}-{key[:16]}.json"


def capture_model(spec: ModelConfig, batch_size: int, device: str, seed: int) -> OpGraph:
    """Capture `spec`'s training step on `device` (the graph carries its FX program, for profiling)."""
    import runtime
    from tasks.models import build_batch, build_loss, build_model

    model = build_model(spec, seed).to(device)
    graph = runtime.capture(model, build_loss(spec), build_batch(spec, batch_size, seed, device))
    graph.meta.update(model=spec.name, batch_size=batch_size, device=device)
    return graph


def trace(spec: ModelConfig, batch_size: int, device: str, seed: int, cache_dir: str | Path) -> tuple[Traced, OpGraph]:
    """Capture the graph and write it to its content-addressed file; returns the record and the
    captured graph (with its FX program)."""
    key = trace_key(spec, batch_size, device)
    path = graph_path(cache_dir, spec, batch_size, key)
    graph = capture_model(spec, batch_size, device, seed)
    graph.save(path)
    return describe(graph, key, path, spec.name, batch_size), graph


def describe(graph: OpGraph, key: str, path: str | Path, model: str, batch_size: int) -> Traced:
    """The `Traced` record of a graph stored at `path`."""
    return Traced(
        key=key,
        path=str(path),
        fingerprint=graph.fingerprint,
        model=model,
        batch_size=batch_size,
        nodes=len(graph.nodes),
        values=len(graph.values),
        constant_bytes=graph.constant_bytes,
    )
