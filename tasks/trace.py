"""Trace stage: capture a model's training step as an operator graph and keep it as JSON.

Every run traces again (seconds for the models a pipeline plans; no key computed from the config can
see an edited factory's source or what it imports) and stores the graph under its fingerprint: the
same graph always lands in the same file, and every later stage is keyed on the fingerprint, so a
changed model never meets a stale profile, plan or validation.

A model with plans in the policy form (`PlanConfig.plan_form`) is traced a second time as eager PyTorch runs
its step (`runtime.policy.apply.capture_eager`: none of memplan's rewrites), the graph those plans are made on; its
file is named `...-eager-<fingerprint16>.json` (where no rewrite applies, both graphs have one fingerprint).
"""

from __future__ import annotations

import logging
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator

from memplan.runtime.format.graph import OpGraph
from memplan.tasks.config import MemplanError, ModelConfig, PlanForm
from memplan.tasks.records import Traced

Built = tuple[Any, Callable[..., Any], tuple]
"""A model already built (an `nn.Module` on the device), its loss `loss_fn(model, *batch)` and its batch: what
`memplan.plan` hands the stages in place of a `[[models]]` entry to build them from."""


def graph_path(cache_dir: str | Path, model: str, batch_size: int, fingerprint: str,
               form: PlanForm = "executor") -> Path:
    """Where the graph with `fingerprint` lives: `<cache_dir>/graphs/<model>-b<batch>-<fingerprint16>.json`, or
    for the policy form's graph `<model>-b<batch>-eager-<fingerprint16>.json`."""
    eager = "eager-" if form == "policy" else ""
    return Path(cache_dir) / "graphs" / f"{model}-b{batch_size}-{eager}{fingerprint[:16]}.json"


def capture_model(spec: ModelConfig, batch_size: int, device: str, seed: int, form: PlanForm = "executor",
                  built: Built | None = None) -> OpGraph:
    """Capture `spec`'s training step on `device` (the graph carries its FX program, for profiling). For the
    executor `form`, with only the rewrite instances that are bit-identical on this device, and a large chunked
    head and loss found within the validation tolerance (`runtime.capture(..., verify=True)`): the selection lands in `meta["rewrites"]` and from there in every
    plan made for the graph. For the policy form, as eager PyTorch runs it (`runtime.policy.apply.capture_eager`);
    a step that records no repeated module, which the policy form checkpoints, is refused. `built`: the model
    (on `device`), loss and batch to capture instead of building them from `spec` (`memplan.plan`'s; `spec` then
    only names them)."""
    from memplan import runtime
    from memplan.runtime.tracing.capture import CaptureError
    from memplan.runtime.policy.apply import capture_eager
    from memplan.tasks.models import ModelError, build_batch, build_loss, build_model, check_batch_fits

    if built is None:
        check_batch_fits(spec, batch_size, device)
        model, loss_fn = build_model(spec, seed).to(device), build_loss(spec)
        batch = build_batch(spec, batch_size, seed, device)
    else:
        model, loss_fn, batch = built
    try:
        with _quiet_fake_tensors():
            graph = capture_eager(model, loss_fn, batch) if form == "policy" else \
                runtime.capture(model, loss_fn, batch, verify=True)
    except (CaptureError, MemplanError):
        raise
    except Exception as exc:
        shapes = ", ".join(f"{[batch_size, *i.shape]} {i.dtype}" for i in spec.inputs)
        first = (str(exc).strip().splitlines() or [""])[0][:300]
        if built is not None:                        # memplan.plan's model: no pipeline.toml entry to check
            raise ModelError(f"model {spec.name!r}: loss_fn(model, *batch) fails as memplan captures it, with "
                             f"{type(exc).__name__}: {first} (the traceback is this error's cause).") from exc
        raise ModelError(
            f"model {spec.name!r} at batch {batch_size}: its training step fails on the batch pipeline.toml declares "
            f"({shapes}) with {type(exc).__name__}: {first} Check the model's `inputs` (shapes, dtypes, and `high` "
            f"for class labels, which must be below the number of classes) and `loss`; `memplan run --debug` shows "
            f"the traceback.") from exc
    graph.meta.update(model=spec.name, batch_size=batch_size, device=device)
    if form == "policy":
        _check_regions(graph, spec, batch_size)
    return graph


def _check_regions(graph: OpGraph, spec: ModelConfig, batch_size: int) -> None:
    """Refuse, before profiling, a policy-form graph without the repeated modules its plans checkpoint."""
    from memplan.runtime.policy.form import Regions
    from memplan.tasks.models import ModelError

    if not Regions.of_graph(graph).members:
        raise ModelError(
            f"model {spec.name!r} at batch {batch_size} has plans in the policy form ([[plans]] form = \"policy\", "
            f"the default of solver selective-policy), which checkpoint its repeated modules, but its step records "
            f"none (capture records the children of an nn.ModuleList or nn.Sequential: runtime/tracing/modules.py). Build "
            f"the model's layers as such a list, or give those plans form = \"executor\" (or another solver), or "
            f"leave this model out of them with `models = [...]`.")


@contextmanager
def _quiet_fake_tensors() -> Iterator[None]:
    """torch logs every op that fails on fake tensors with its own traceback; the error that follows says it."""
    logger = logging.getLogger("torch._subclasses.fake_tensor")
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        logger.setLevel(level)


def trace(spec: ModelConfig, batch_size: int, device: str, seed: int, cache_dir: str | Path,
          form: PlanForm = "executor", built: Built | None = None) -> tuple[Traced, OpGraph]:
    """Capture the graph of plans in `form` and write it to its fingerprint's file unless that file already
    holds the same rewrite record (`meta["rewrites"]`: which instances apply and where they were verified) and
    op facts; returns the record and the captured graph (with its FX program). `built`: as `capture_model`'s."""
    graph = capture_model(spec, batch_size, device, seed, form, built)
    path = graph_path(cache_dir, spec.name, batch_size, graph.fingerprint, form)
    if not path.exists() or _record(OpGraph.load(path)) != _record(graph):
        graph.save(path)
    return describe(graph, path, spec.name, batch_size, form), graph


def _record(graph: OpGraph) -> tuple:
    """What a rewrite of the graph file would change: the rewrite record, the op facts (`runtime.tracing.facts`) and
    the capture (eager for the policy form)."""
    return tuple(graph.meta.get(key) for key in ("rewrites", "random_nodes", "in_place", "capture"))


def describe(graph: OpGraph, path: str | Path, model: str, batch_size: int, form: PlanForm = "executor") -> Traced:
    """The `Traced` record of a graph stored at `path`, captured for plans in `form`."""
    return Traced(
        path=str(path),
        fingerprint=graph.fingerprint,
        model=model,
        batch_size=batch_size,
        nodes=len(graph.nodes),
        values=len(graph.values),
        constant_bytes=graph.constant_bytes,
        form=form,
    )
