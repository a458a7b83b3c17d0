"""Profile an operator graph: time and memory of every node on one device, written to the profile store.

Every node runs alone (`runtime.node_function`) on its real inputs: graph inputs are random tensors of
the graph's shapes and dtypes, every other input is the value its producer computed in this run, so
integer tensors (pooling indices, labels) are valid; on a GPU, the values kept between nodes are bounded by
its free memory, and a value dropped beyond the bound is read as a stand-in of its layout
(tasks/profile/values.py). The graph is run `rounds` times in node order; in
each round every node gets `warmup` untimed calls and `repeats` timed calls (CUDA events on GPU,
`time.perf_counter` on CPU); time_ms is the median of all timed calls, with their minimum and
interquartile range. In the first round one more call runs under `runtime.measure.meter.PeakMeter(allocator=True)`:
    output_bytes    = bytes the call left allocated (its outputs),
    workspace_bytes = max(0, peak bytes during the call - output_bytes)
(inputs exist before the call, so the meter never counts them). The meter reads the allocator (CUDA's
caching allocator, the CPU allocator through torch.profiler), so scratch a kernel allocates for itself
counts as workspace: on CPU, oneDNN's copy of a depthwise convolution's input, for one. Columns:
docs/profile-schema.md.

Every implementation variant the graph offers (`runtime.variants.offered`) is measured the same way, right after
its node's default (`runtime.variant_function`), into a row with `impl` = the variant's name. It reads the
default's graph values and the variant values (e.g. masks) that earlier variants made in the same round.
Its outputs are compared bit for bit with the default's on those inputs (column `exact`: the variant is
exact on this device); a variant that fails on a node is recorded as unavailable there (column
`unavailable`) and the run goes on.
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
import warnings
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np
import torch

from memplan.runtime.variants.offered import DEFAULT
from memplan.tasks.profile.values import LiveValues
from memplan.tasks.store.profiles import new_run_id, write_run
from memplan.tasks.store.schema import SCHEMA_VERSION

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
    value_bytes: int | None = None  # graph values kept between nodes (tasks.profile.values; None: `value_bound`)

    def __post_init__(self) -> None:
        if self.threads is not None and self.threads < 1:
            raise ValueError(f"Profile setting threads must be >= 1 or None, got {self.threads}.")
        if self.value_bytes is not None and self.value_bytes < 0:
            raise ValueError(f"Profile setting value_bytes must be >= 0 or None, got {self.value_bytes}.")
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


def _reads(graph, specs: list) -> dict[int, list[int]]:
    """Value id -> ids of the nodes reading it in node order, in their default implementations or a variant in
    `specs`."""
    reads: dict[int, list[int]] = {}
    for node in graph.nodes:
        for v in {*node.inputs, *(v for spec in specs[node.id] for v in spec.inputs)}:
            reads.setdefault(v, []).append(node.id)
    return reads


def value_bound(graph, device: torch.device, settings: ProfileSettings) -> int | None:
    """The bytes of graph values a round keeps between nodes: `settings.value_bytes`; unset, on a GPU the free
    memory less 1.25x the largest inputs and outputs of a node (that node runs beside the kept values), and no
    bound on a CPU."""
    if settings.value_bytes is not None or device.type != "cuda":
        return settings.value_bytes
    largest = max(sum(graph.values[v].bytes for v in {*node.inputs, *node.outputs}) for node in graph.nodes)
    return max(0, torch.cuda.mem_get_info(device)[0] - int(1.25 * largest))


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


class VariantUnavailableWarning(UserWarning):
    """An implementation variant could not be built or run on a node: it is profiled as unavailable there."""


@dataclass(frozen=True)
class Implementation:
    """One implementation of a node as a profile runs it: `fn` is its callable, or None when it could not be
    built (`unavailable` says why)."""

    name: str
    inputs: tuple[int, ...]
    outputs: tuple[int, ...]
    overwritten: tuple[int, ...]
    fn: Callable[..., tuple] | None
    unavailable: str | None = None


@dataclass
class Measurements:
    """What the rounds measured, by (node id, implementation): timed samples, (output_bytes,
    workspace_bytes) of the metered call, whether a variant's outputs matched the default's bit for bit in
    every round, and why a variant is unavailable on a node."""

    times: dict[tuple[int, str], list[float]] = field(default_factory=dict)
    memory: dict[tuple[int, str], tuple[int, int]] = field(default_factory=dict)
    exact: dict[tuple[int, str], bool] = field(default_factory=dict)
    unavailable: dict[tuple[int, str], str] = field(default_factory=dict)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors hold the same shape, dtype and element bits (NaN payloads and signed zeros
    included; strides aside)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    return torch.equal(a.detach().contiguous().reshape(-1).view(torch.uint8),
                       b.detach().contiguous().reshape(-1).view(torch.uint8))


def _variant(graph, spec, variant_function: VariantFunction) -> Implementation:
    """Variant `spec` as a profile runs it; a variant whose code cannot be built for the node is unavailable."""
    try:
        fn, why = variant_function(graph, spec.node, spec.name), None
    except Exception as exc:                     # the rule's code refuses this node (VariantError) or breaks
        fn, why = None, f"building it raised {type(exc).__name__}: {exc}"
    return Implementation(spec.name, spec.inputs, spec.outputs, tuple(i for _, i in spec.overwrites), fn, why)


def measure_graph(graph, device: str | torch.device = "cpu", settings: ProfileSettings = ProfileSettings(), *,
                  model: str | None = None, node_function: NodeFunction | None = None,
                  variant_function: VariantFunction | None = None, progress: bool = True) -> list[dict[str, Any]]:
    """Measure every node of `graph` on `device`, in its default implementation and in every variant the
    graph offers (`runtime.variants.offered`: one row per node and `impl`); return the rows of one run (not yet
    written).

    A variant is also run against the default on the same inputs: its row's `exact` says whether the outputs
    the node's readers take matched the default's bit for bit in every round. A variant that cannot be built
    or raises on a node (or reads a variant value no variant computed) is dropped there with a
    `VariantUnavailableWarning`: its row carries the reason in `unavailable` and no costs, and the run goes
    on. The default implementation failing stops the run.

    `node_function(graph, node_id)` gives the callable of a node, `variant_function(graph, node_id, impl)`
    that of a variant; they default to `runtime.node_function` / `runtime.variant_function`, which need a
    graph made by `runtime.capture` on the same device; given a `node_function` and no `variant_function`
    (a graph built by hand), only the default implementations are measured. `model` names the model in the
    store (default: the graph's `meta["model"]`).
    """
    from memplan.runtime.variants.offered import GraphVariants, graph_variants

    defaults_only = node_function is not None and variant_function is None
    if node_function is None:
        from memplan.runtime import node_function
    if variant_function is None:
        from memplan.runtime import variant_function
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    model = model or graph.meta.get("model")
    if not model:
        raise ValueError("Name the model being profiled (model=...): the graph's meta has no 'model'.")
    variants = GraphVariants(len(graph.values), (), {}) if defaults_only else graph_variants(graph)
    specs = [list(variants.specs.get(node.id, {}).values()) for node in graph.nodes]
    functions = [[Implementation(DEFAULT, tuple(node.inputs), tuple(node.outputs), (),
                                 node_function(graph, node.id))] +
                 [_variant(graph, s, variant_function) for s in specs[node.id]]
                 for node in graph.nodes]
    measured = Measurements()
    with torch.no_grad(), _threads(settings.threads), _progress(progress) as bar:
        run = _run_columns(graph, device, settings, model)
        task = bar.add_task(f"profiling {model} on {run['device']}", total=settings.rounds * len(graph.nodes))
        reads, bound = _reads(graph, specs), value_bound(graph, device, settings)
        for round_ in range(settings.rounds):
            _run_round(graph, functions, reads, bound, device, settings, measured, round_ == 0,
                       lambda: bar.advance(task))
        run.update(_policy_columns(graph, device, settings, [impls[0].fn for impls in functions]))
    created = datetime.now(timezone.utc)
    rows = []
    for node in graph.nodes:
        for impl in functions[node.id]:
            key = node.id, impl.name
            row = {**run, "created_at": created, "node_id": node.id, "node_name": node.name,
                   "op": node.targets[0] if node.targets else None, "targets": list(node.targets),
                   "phase": node.phase, "impl": impl.name,
                   "input_bytes": sum(variants.value(graph, v).bytes for v in set(impl.inputs))}
            if key in measured.unavailable:
                rows.append({**row, "time_ms": 0.0, "output_bytes": 0, "workspace_bytes": 0,
                             "unavailable": measured.unavailable[key]})
                continue
            samples = measured.times[key]
            output, workspace = measured.memory[key]
            q25, q75 = np.percentile(samples, [25, 75])
            rows.append({**row, "time_ms": statistics.median(samples), "time_ms_min": min(samples),
                         "time_ms_iqr": float(q75 - q25), "output_bytes": output, "workspace_bytes": workspace,
                         "exact": measured.exact.get(key)})
    return rows


def _run_round(graph, functions: list[list[Implementation]], reads: dict[int, list[int]], bound: int | None,
               device: torch.device, settings: ProfileSettings, measured: Measurements, meter: bool,
               advance: Callable) -> None:
    """One pass over the graph in node order: time every available implementation of every node, append its
    samples to `measured.times`, and when `meter` set `measured.memory` from one metered call; compare each
    variant's outputs with the default's (`measured.exact`). The default's outputs feed the later nodes, a
    variant's variant values (e.g. a mask) the later variants; a value is dropped after its last reader
    (`reads`), or earlier beyond `bound` bytes, to be read as a stand-in (tasks.profile.values). An in-place
    variant runs on a copy of the inputs it overwrites, made before its calls (so its output allocates nothing
    and the inputs stay intact for the other variants). A variant that fails is marked unavailable (`_drop`)."""
    from memplan.runtime.measure.meter import PeakMeter

    compared = {v for implementations in functions if len(implementations) > 1 for impl in implementations
                for v in impl.inputs}                   # a variant's outputs are compared with its default's
    droppable = {v.id for v in graph.values if v.producer is not None} - compared
    live = LiveValues(graph_inputs(graph, device, settings.seed), reads, bound, droppable, settings.seed)
    for node, implementations in zip(graph.nodes, functions):
        for impl in implementations:
            key = node.id, impl.name
            if key in measured.unavailable:
                continue
            missing = [v for v in impl.inputs if v not in live]
            if impl.unavailable is not None or (missing and impl.name != DEFAULT):
                _drop(measured, node, impl.name, impl.unavailable or f"it reads variant value {missing[0]}, which "
                      f"no available variant of its producer computed", device)
                continue
            args = [live[v].clone() if v in impl.overwritten else live[v] for v in impl.inputs]
            where = node.name if impl.name == DEFAULT else f"{node.name}, variant {impl.name}"
            try:
                samples = _time_calls(impl.fn, args, device, settings)
                if meter:
                    with PeakMeter(device, allocator=True) as peak:
                        outputs = impl.fn(*args)
                    memory = (peak.end_bytes, max(0, peak.peak_bytes - peak.end_bytes))
                else:
                    outputs = impl.fn(*args)
            except Exception as exc:
                if impl.name != DEFAULT:
                    _drop(measured, node, impl.name, f"{type(exc).__name__}: {exc}", device)
                    continue
                raise RuntimeError(f"Profiling node {node.id} ({where}, {', '.join(node.targets)}) failed on "
                                   f"{device}: {exc}. The node's own op raised on inputs of the shapes the graph records: "
                                   f"if the graph was captured on another device, profile one captured on this "
                                   f"device; if not, this is a bug in memplan's capture: report it with this "
                                   f"message and the model.") from exc
            if len(outputs) != len(impl.outputs):
                why = f"returned {len(outputs)} tensors but the graph lists {len(impl.outputs)} outputs"
                if impl.name == DEFAULT:
                    raise RuntimeError(f"Node {node.id} ({where}) {why}; the node function does not match the graph.")
                _drop(measured, node, impl.name, f"it {why}", device)
                continue
            measured.times.setdefault(key, []).extend(samples)
            if meter:
                measured.memory[key] = memory
            if impl.name == DEFAULT:
                live.update(zip(impl.outputs, outputs))
            else:
                produced = dict(zip(impl.outputs, outputs))
                same = all(same_bits(produced[v], live[v]) for v in node.outputs if v in produced)
                measured.exact[key] = measured.exact.get(key, True) and same
                live.update((v, t) for v, t in produced.items() if v >= len(graph.values))
            del args, outputs
        for v in {v for impl in implementations for v in (*impl.inputs, *impl.outputs)}:
            if reads.get(v, [-1])[-1] <= node.id:
                live.pop(v)
        live.shrink(node.id)
        advance()


def _drop(measured: Measurements, node, impl: str, reason: str, device: torch.device) -> None:
    """Mark variant `impl` of `node` unavailable for `reason`, with a `VariantUnavailableWarning`."""
    measured.unavailable[node.id, impl] = reason
    warnings.warn(f"Profiling node {node.id} ({node.name}, {', '.join(node.targets)}) as variant {impl!r} failed on "
                  f"{device}: {reason}. The profile records the variant as unavailable on this node, so no plan "
                  f"uses it there; profiling goes on.", VariantUnavailableWarning, stacklevel=4)


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


def _policy_columns(graph, device: torch.device, settings: ProfileSettings, defaults: list[Callable]) -> dict:
    """The run columns `policy_forward_ms` / `policy_recompute_ms` (`runtime.policy.dispatch_cost.policy_dispatch_ms`,
    replaying the nodes' `defaults`, the callables just profiled) for a graph the policy form plans on
    (`meta["capture"] == "eager"`, runtime.policy.apply.capture_eager), else nulls."""
    from memplan.runtime.policy.dispatch_cost import policy_dispatch_ms

    measured = None
    if graph.meta.get("capture") == "eager":
        measured = policy_dispatch_ms(graph, device, graph_inputs(graph, device, settings.seed), defaults)
    forward, recompute = measured or (None, None)
    return {"policy_forward_ms": forward, "policy_recompute_ms": recompute}


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
