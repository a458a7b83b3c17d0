"""Profile an operator graph: time and memory of every node on one device, written to the profile store.

Every node runs alone (`runtime.node_function`) on its real inputs: graph inputs are random tensors of
the graph's shapes and dtypes, every other input is the value its producer computed in this run, so
integer tensors (pooling indices, labels) are valid. The graph is run `rounds` times in node order; in
each round every node gets `warmup` untimed calls and `repeats` timed calls (CUDA events on GPU,
`time.perf_counter` on CPU); time_ms is the median of all timed calls, with their minimum and
interquartile range. In the first round one more call runs under `runtime.meter.PeakMeter(allocator=True)`:
    output_bytes    = bytes the call left allocated (its outputs),
    workspace_bytes = max(0, peak bytes during the call - output_bytes)
(inputs exist before the call, so the meter never counts them). The meter reads the allocator (CUDA's
caching allocator, the CPU allocator through torch.profiler), so scratch a kernel allocates for itself
counts as workspace: on CPU, oneDNN's copy of a depthwise convolution's input, for one. Columns:
docs/profile-schema.md.

Every implementation variant the graph offers (`runtime.variants`) is measured the same way, right after
its node's default (`runtime.variant_function`), into a row with `impl` = the variant's name. It reads the
default's graph values and the variant values (e.g. masks) that earlier variants made in the same round.
"""

from __future__ import annotations

import json
import math
import os
import platform
import re
import socket
import statistics
import time
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np
import torch

from tasks.store import new_run_id, write_run
from tasks.store_schema import DEFAULT_IMPL, SCHEMA_VERSION

DEVICE_KEY_VAR = "MEMPLAN_DEVICE_KEY"
NodeFunction = Callable[[Any, int], Callable[..., tuple]]
VariantFunction = Callable[[Any, int, str], Callable[..., tuple]]


@dataclass(frozen=True)
class ProfileSettings:
    """How each node is measured."""

    warmup: int = 2     # untimed calls per node and round before timing (lazy init, caches, allocator)
    repeats: int = 5    # timed calls per node and round; time_ms is the median of all rounds' calls
    seed: int = 0       # seed of the random graph inputs
    rounds: int = 3     # passes over the graph: a burst of load on a shared host hits one pass, not all samples
    threads: int | None = None  # torch CPU threads while profiling (None: leave torch's setting)

    def __post_init__(self) -> None:
        if self.threads is not None and self.threads < 1:
            raise ValueError(f"Profile setting threads must be >= 1 or None, got {self.threads}.")
        if self.warmup < 0 or self.repeats < 1 or self.rounds < 1:
            raise ValueError(f"Profile settings need warmup >= 0, repeats >= 1 and rounds >= 1, got "
                             f"warmup={self.warmup}, repeats={self.repeats}, rounds={self.rounds}.")


@dataclass(frozen=True)
class ProfileRun:
    """A profiling run written to the store."""

    run_id: str
    path: Path
    rows: int
    fingerprint: str
    device: str


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def device_info(device: torch.device) -> dict[str, Any]:
    """Run columns describing the device: `device` is the store's key (`cpu`, or the GPU name as a slug,
    e.g. `nvidia-h100-80gb-hbm3`; a host sets its own with $MEMPLAN_DEVICE_KEY, e.g. a fleet class whose
    GPU name does not tell it apart), `device_type` is torch's (`cpu`, `cuda`)."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        key = _slug(name)
    elif device.type == "cpu":
        name, key = _cpu_name(), "cpu"
    else:
        raise ValueError(f"Profiling supports cpu and cuda devices, not {device}.")
    key = _slug(os.environ.get(DEVICE_KEY_VAR, "")) or key
    cudnn = torch.backends.cudnn.version() if device.type == "cuda" else None
    return {"device": key, "device_type": device.type, "device_name": name, "host": socket.gethostname(),
            "torch_version": torch.__version__, "cuda_version": torch.version.cuda if device.type == "cuda" else None,
            "cudnn_version": None if cudnn is None else str(cudnn)}


def graph_inputs(graph, device: torch.device, seed: int) -> dict[int, torch.Tensor]:
    """Random tensors for the graph inputs, by value id: floating batch inputs ~ N(0, 1); parameters
    ~ N(0, 1/fan_in) with fan_in the product of all but the first dimension (keeps activations O(1)
    through deep stacks); floating buffers 1 (e.g. BatchNorm running variance); integer tensors 0
    (a valid class label or token id for every graph); booleans True."""
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for value in graph.input_values:
        dtype = getattr(torch, value.dtype, None)
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"Value {value.id} ({value.name}) has dtype {value.dtype!r}, which is not a torch "
                             f"dtype name; re-capture the graph.")
        shape = tuple(value.shape)
        if dtype == torch.bool:
            t = torch.ones(shape, dtype=dtype)
        elif not (dtype.is_floating_point or dtype.is_complex):
            t = torch.zeros(shape, dtype=dtype)
        elif value.kind == "buffer":
            t = torch.ones(shape, dtype=dtype)
        else:
            t = torch.randn(shape, generator=generator, dtype=dtype)
            if value.kind == "param":
                t /= math.sqrt(math.prod(shape[1:]) or 1)
        tensors[value.id] = t.to(device)
    return tensors


def _time_calls(fn: Callable, args: list, device: torch.device, settings: ProfileSettings) -> list[float]:
    """Milliseconds of `settings.repeats` calls of `fn(*args)` after `settings.warmup` untimed ones."""
    for _ in range(settings.warmup):
        fn(*args)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                  for _ in range(settings.repeats)]
        for start, end in events:
            start.record()
            fn(*args)
            end.record()
        torch.cuda.synchronize(device)
        return [start.elapsed_time(end) for start, end in events]
    times = []
    for _ in range(settings.repeats):
        start = time.perf_counter()
        fn(*args)
        times.append((time.perf_counter() - start) * 1e3)
    return times


def _last_reads(graph, specs: list) -> dict[int, int]:
    """Value id -> id of the last node reading it, in its default implementation or a variant in `specs`."""
    last = {}
    for node in graph.nodes:
        for v in node.inputs:
            last[v] = node.id
        for spec in specs[node.id]:
            for v in spec.inputs:
                last[v] = node.id
    return last


@contextmanager
def _threads(count: int | None) -> Iterator[None]:
    """Run the block with `count` torch CPU threads (unchanged when None), restoring the setting after."""
    before = torch.get_num_threads()
    if count is not None:
        torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _progress(enabled: bool):
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                    TimeRemainingColumn(), disable=not enabled)


def measure_graph(graph, device: str | torch.device = "cpu", settings: ProfileSettings = ProfileSettings(), *,
                  model: str | None = None, node_function: NodeFunction | None = None,
                  variant_function: VariantFunction | None = None, progress: bool = True) -> list[dict[str, Any]]:
    """Measure every node of `graph` on `device`, in its default implementation and in every variant the
    graph offers (`runtime.variants`: one row per node and `impl`); return the rows of one run (not yet
    written).

    `node_function(graph, node_id)` gives the callable of a node, `variant_function(graph, node_id, impl)`
    that of a variant; they default to `runtime.node_function` / `runtime.variant_function`, which need a
    graph made by `runtime.capture` on the same device; given a `node_function` and no `variant_function`
    (a graph built by hand), only the default implementations are measured. `model` names the model in the
    store (default: the graph's `meta["model"]`).
    """
    from runtime.variants import GraphVariants, graph_variants

    defaults_only = node_function is not None and variant_function is None
    if node_function is None:
        from runtime import node_function
    if variant_function is None:
        from runtime import variant_function
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    model = model or graph.meta.get("model")
    if not model:
        raise ValueError("Name the model being profiled (model=...): the graph's meta has no 'model'.")
    variants = GraphVariants(len(graph.values), (), {}) if defaults_only else graph_variants(graph)
    specs = [list(variants.specs.get(node.id, {}).values()) for node in graph.nodes]
    functions = [[(DEFAULT_IMPL, node.inputs, node.outputs, (), node_function(graph, node.id))] +
                 [(s.name, s.inputs, s.outputs, tuple(i for _, i in s.overwrites),
                   variant_function(graph, node.id, s.name)) for s in specs[node.id]]
                 for node in graph.nodes]
    times: dict[tuple[int, str], list[float]] = {}
    memory: dict[tuple[int, str], tuple[int, int]] = {}
    with torch.no_grad(), _threads(settings.threads), _progress(progress) as bar:
        run = _run_columns(graph, device, settings, model)
        task = bar.add_task(f"profiling {model} on {run['device']}", total=settings.rounds * len(graph.nodes))
        for round_ in range(settings.rounds):
            _run_round(graph, functions, _last_reads(graph, specs), device, settings, times,
                       memory if round_ == 0 else None, lambda: bar.advance(task))
    created = datetime.now(timezone.utc)
    rows = []
    for node in graph.nodes:
        for impl, inputs, _, _, _ in functions[node.id]:
            samples = times[node.id, impl]
            output, workspace = memory[node.id, impl]
            q25, q75 = np.percentile(samples, [25, 75])
            rows.append({
                **run, "created_at": created, "node_id": node.id, "node_name": node.name,
                "op": node.targets[0] if node.targets else None, "targets": list(node.targets), "phase": node.phase,
                "impl": impl, "time_ms": statistics.median(samples), "time_ms_min": min(samples),
                "time_ms_iqr": float(q75 - q25),
                "input_bytes": sum(variants.value(graph, v).bytes for v in set(inputs)),
                "output_bytes": output, "workspace_bytes": workspace,
            })
    return rows


def _run_round(graph, functions: list, last: dict[int, int], device: torch.device, settings: ProfileSettings,
               times: dict, memory: dict | None, advance: Callable) -> None:
    """One pass over the graph in node order: time every implementation of every node, append its samples
    to `times[node, impl]`, and when `memory` is given set its (output_bytes, workspace_bytes) from one
    metered call. The default's outputs feed the later nodes, a variant's variant values (e.g. a mask) the
    later variants; a value is dropped after its last reader (`last`). An in-place variant runs on a copy of
    the inputs it overwrites, made before its calls (so its output allocates nothing and the inputs stay
    intact for the other variants)."""
    from runtime.meter import PeakMeter

    live = graph_inputs(graph, device, settings.seed)
    for node, implementations in zip(graph.nodes, functions):
        for impl, inputs, outputs_ids, overwritten, fn in implementations:
            args = [live[v].clone() if v in overwritten else live[v] for v in inputs]
            where = node.name if impl == DEFAULT_IMPL else f"{node.name}, variant {impl}"
            try:
                times.setdefault((node.id, impl), []).extend(_time_calls(fn, args, device, settings))
                if memory is None:
                    outputs = fn(*args)
                else:
                    with PeakMeter(device, allocator=True) as meter:
                        outputs = fn(*args)
                    memory[node.id, impl] = (meter.end_bytes, max(0, meter.peak_bytes - meter.end_bytes))
            except Exception as exc:
                raise RuntimeError(f"Profiling node {node.id} ({where}, {', '.join(node.targets)}) failed on "
                                   f"{device}: {exc}. Profile a graph captured on the same device.") from exc
            if len(outputs) != len(outputs_ids):
                raise RuntimeError(f"Node {node.id} ({where}) returned {len(outputs)} tensors but the graph "
                                   f"lists {len(outputs_ids)} outputs; the node function does not match the graph.")
            fresh = zip(outputs_ids, outputs) if impl == DEFAULT_IMPL else \
                ((v, t) for v, t in zip(outputs_ids, outputs) if v >= len(graph.values))
            live.update(fresh)
            del args, outputs
        for v in {v for _, inputs, outputs_ids, _, _ in implementations for v in (*inputs, *outputs_ids)}:
            if last.get(v, -1) <= node.id:
                live.pop(v, None)
        advance()


def _run_columns(graph, device: torch.device, settings: ProfileSettings, model: str) -> dict[str, Any]:
    batch = [v for v in graph.values if v.kind == "input"]
    try:
        version = metadata.version("memplan")
    except metadata.PackageNotFoundError:
        version = None
    return {
        "schema_version": SCHEMA_VERSION, "run_id": new_run_id(), "fingerprint": graph.fingerprint,
        "model": model, "graph_nodes": len(graph.nodes),
        "batch_size": batch[0].shape[0] if batch and batch[0].shape else None,
        "input_shapes": json.dumps([{"shape": list(v.shape), "dtype": v.dtype} for v in batch]),
        **device_info(device), "memplan_version": version,
        "timer": "cuda_events" if device.type == "cuda" else "perf_counter",
        "warmup": settings.warmup, "repeats": settings.repeats, "rounds": settings.rounds,
        "threads": torch.get_num_threads(),
        "seed": settings.seed,
    }


def profile_graph(graph, device: str | torch.device = "cpu", settings: ProfileSettings = ProfileSettings(), *,
                  model: str | None = None, root: str | Path | None = None,
                  node_function: NodeFunction | None = None, variant_function: VariantFunction | None = None,
                  progress: bool = True) -> ProfileRun:
    """Measure every node of `graph` on `device`, and its variants (see `measure_graph`), and write the run
    to the store."""
    rows = measure_graph(graph, device, settings, model=model, node_function=node_function,
                         variant_function=variant_function, progress=progress)
    path = write_run(rows, root)
    return ProfileRun(rows[0]["run_id"], path, len(rows), graph.fingerprint, rows[0]["device"])
