"""Trace stage: capture a model's training step as an operator graph and keep it as JSON.

Every run traces again (seconds for the models a pipeline plans; no key computed from the config can
see an edited factory's source or what it imports) and stores the graph under its fingerprint: the
same graph always lands in the same file, and every later stage is keyed on the fingerprint, so a
changed model never meets a stale profile, plan or validation.
"""

from __future__ import annotations

from pathlib import Path

from runtime.graph import OpGraph
from tasks.config import ModelConfig
from tasks.records import Traced


def graph_path(cache_dir: str | Path, model: str, batch_size: int, fingerprint: str) -> Path:
    """Where the graph with `fingerprint` lives: `<cache_dir>/graphs/<model>-b<batch>-<fingerprint16>.json`."""
    return Path(cache_dir) / "graphs" / f"{model}-b{batch_size}-{fingerprint[:16]}.json"


def capture_model(spec: ModelConfig, batch_size: int, device: str, seed: int) -> OpGraph:
    """Capture `spec`'s training step on `device` (the graph carries its FX program, for profiling), applying
    only the rewrite instances that are bit-identical on this device (`runtime.capture(..., verify=True)`):
    the selection lands in `meta["rewrites"]` and from there in every plan made for the graph."""
    import runtime
    from tasks.models import build_batch, build_loss, build_model

    model = build_model(spec, seed).to(device)
    graph = runtime.capture(model, build_loss(spec), build_batch(spec, batch_size, seed, device), verify=True)
    graph.meta.update(model=spec.name, batch_size=batch_size, device=device)
    return graph


def trace(spec: ModelConfig, batch_size: int, device: str, seed: int, cache_dir: str | Path) -> tuple[Traced, OpGraph]:
    """Capture the graph and write it to its fingerprint's file unless that file already holds the same rewrite
    record (`meta["rewrites"]`: which instances apply and where they were verified) and op facts; returns the record and
    the captured graph (with its FX program)."""
    graph = capture_model(spec, batch_size, device, seed)
    path = graph_path(cache_dir, spec.name, batch_size, graph.fingerprint)
    if not path.exists() or _record(OpGraph.load(path)) != _record(graph):
        graph.save(path)
    return describe(graph, path, spec.name, batch_size), graph


def _record(graph: OpGraph) -> tuple:
    """What a rewrite of the graph file would change: the rewrite record and the op facts (`runtime.facts`)."""
    return tuple(graph.meta.get(key) for key in ("rewrites", "random_nodes", "in_place"))


def describe(graph: OpGraph, path: str | Path, model: str, batch_size: int) -> Traced:
    """The `Traced` record of a graph stored at `path`."""
    return Traced(
        path=str(path),
        fingerprint=graph.fingerprint,
        model=model,
        batch_size=batch_size,
        nodes=len(graph.nodes),
        values=len(graph.values),
        constant_bytes=graph.constant_bytes,
    )
