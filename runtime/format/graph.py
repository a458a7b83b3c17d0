"""The operator graph (`memplan-graph` JSON, docs/graph-format.md): compute nodes and the values
(storages) they read and allocate. Torch-free, so planners and stores can use it without torch.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

from memplan.runtime.format.jsonio import read_json, sha256_hex, write_json_atomic

FORMAT = "memplan-graph"
VERSION = 1
KINDS = ("input", "param", "buffer", "activation", "gradient", "output")
INPUT_KINDS = ("input", "param", "buffer")
PHASES = ("forward", "loss", "backward")


class GraphFormatError(ValueError):
    """A graph JSON (file or dict) that is malformed, inconsistent or tampered with."""


BACKENDS = {"CPU": "cpu", "CUDA": "cuda"}
"""The dispatch backends a graph records in-place facts for, each with a device of its kind."""


def backend(device: str) -> str:
    """The dispatch key whose kernels run on `device`: a device type ("cpu", "cuda:0") or a profile store
    device key (`cpu`, or a GPU name such as `nvidia-h100-80gb-hbm3`)."""
    return "CPU" if device.split(":")[0] == "cpu" else "CUDA"


@dataclass(frozen=True)
class Value:
    """One storage: graph input (`producer is None`) or allocated by node `producer`."""

    id: int
    bytes: int
    shape: tuple[int, ...]
    dtype: str
    kind: str
    name: str
    producer: int | None

    def to_json(self) -> dict[str, Any]:
        return {"id": self.id, "bytes": self.bytes, "shape": list(self.shape), "dtype": self.dtype,
                "kind": self.kind, "name": self.name, "producer": self.producer}


@dataclass(frozen=True)
class Node:
    """One compute node: its ATen targets (allocating op first), phase, values read and allocated."""

    id: int
    name: str
    targets: tuple[str, ...]
    phase: str
    inputs: tuple[int, ...]
    outputs: tuple[int, ...]

    def to_json(self) -> dict[str, Any]:
        return {"id": self.id, "name": self.name, "targets": list(self.targets), "phase": self.phase,
                "inputs": list(self.inputs), "outputs": list(self.outputs)}


@dataclass(eq=False)
class OpGraph:
    """Operator graph of one training step. `program` holds the captured torch program (FX module and
    its mapping to nodes) for graphs made by `runtime.capture`; it is never serialized, so it is None
    for graphs loaded from JSON."""

    values: list[Value]
    nodes: list[Node]
    outputs: list[int]
    meta: dict[str, Any] = field(default_factory=dict)
    program: Any = None

    def __post_init__(self) -> None:
        self.values = list(self.values)
        self.nodes = list(self.nodes)
        self.outputs = list(self.outputs)
        _check_structure(self)

    @cached_property
    def fingerprint(self) -> str:
        """SHA-256 of the canonical JSON of values and nodes (names left out) and outputs."""
        return sha256_hex({
            "values": [{k: v for k, v in value.to_json().items() if k != "name"} for value in self.values],
            "nodes": [{k: v for k, v in node.to_json().items() if k != "name"} for node in self.nodes],
            "outputs": self.outputs,
        })

    @property
    def input_values(self) -> list[Value]:
        """Graph inputs (batch, parameters, buffers): always resident."""
        return [v for v in self.values if v.producer is None]

    @property
    def constant_bytes(self) -> int:
        """Bytes of the graph inputs, reported apart from the schedule's peak."""
        return sum(v.bytes for v in self.values if v.producer is None)

    def random_nodes(self) -> list[int]:
        """Nodes that may draw random numbers, as recorded at capture (`runtime.tracing.facts`)."""
        return list(self._fact("random_nodes"))

    def recorded_random_nodes(self) -> list[int]:
        """`random_nodes` where the graph records them, else those of its captured program (none for a graph loaded
        from JSON that predates the fact): one answer for a captured graph and the same graph loaded again."""
        if "random_nodes" in self.meta:
            return self.random_nodes()
        return sorted(getattr(self.program, "random_devices", None) or {})

    def in_place_nodes(self, device: str) -> set[int]:
        """Nodes whose default implementation arena mode writes in place on `device`, as recorded at capture."""
        return set(self._fact("in_place")[backend(device)])

    def gradient_updates(self) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
        """Per parameter tensor with gradient outputs, in output order: (its gradient values, its parameter
        values). A tensor the model holds under several names (tied weights, `meta["tied_params"]`) has a value
        and a gradient output per name; the step sums the gradients. From the names recorded at capture
        (`meta["grad_params"]`: the parameter of each gradient output, which follow the loss in `outputs`)."""
        names = self._fact("grad_params")
        canonical = {name: group[0] for group in self._fact("tied_params") for name in group}
        params = {v.name: v.id for v in self.values if v.kind == "param"}
        grads: dict[str, list[int]] = {}
        values: dict[str, list[int]] = {}
        for g, name in zip(self.outputs[1:1 + len(names)], names):
            key = canonical.get(name, name)
            grads.setdefault(key, []).append(g)
            values.setdefault(key, []).append(params[name])
        return [(tuple(grads[k]), tuple(values[k])) for k in grads]

    def _fact(self, key: str) -> Any:
        if key not in self.meta:
            raise GraphFormatError(f"graph {self.fingerprint[:16]} was captured before memplan recorded {key!r} in "
                                   f"its meta; trace it again (`memplan trace`) with this memplan.")
        return self.meta[key]

    def to_json(self) -> dict[str, Any]:
        return {"format": FORMAT, "version": VERSION, "fingerprint": self.fingerprint, "meta": self.meta,
                "values": [v.to_json() for v in self.values], "nodes": [n.to_json() for n in self.nodes],
                "outputs": list(self.outputs)}

    @classmethod
    def from_json(cls, data: Any, source: str = "graph dict") -> "OpGraph":
        """Build a graph from its JSON object; refuses unknown format/version, missing or mistyped keys,
        inconsistent structure and a stored fingerprint that does not match the content."""
        if not isinstance(data, dict):
            raise GraphFormatError(f"{source}: expected a JSON object, got {type(data).__name__}.")
        if data.get("format") != FORMAT or data.get("version") != VERSION:
            raise GraphFormatError(
                f"{source}: format {data.get('format')!r} version {data.get('version')!r} is not "
                f"{FORMAT!r} version {VERSION}; re-capture the graph with this memplan.")
        values = [_value(v, i, source) for i, v in enumerate(_list(data, "values", source))]
        nodes = [_node(n, i, source) for i, n in enumerate(_list(data, "nodes", source))]
        outputs = [_int(o, f"outputs[{i}]", source) for i, o in enumerate(_list(data, "outputs", source))]
        meta = data.get("meta", {})
        if not isinstance(meta, dict):
            raise GraphFormatError(f"{source}: key 'meta' must be an object, got {type(meta).__name__}.")
        try:
            graph = cls(values, nodes, outputs, meta)
        except GraphFormatError as exc:
            raise GraphFormatError(f"{source}: {exc}") from None
        stored = data.get("fingerprint")
        if stored != graph.fingerprint:
            raise GraphFormatError(
                f"{source}: stored fingerprint {stored!r} does not match the content's fingerprint "
                f"{graph.fingerprint!r}; the file was edited or corrupted. Re-capture the graph.")
        return graph

    @classmethod
    def load(cls, path: str | os.PathLike) -> "OpGraph":
        return cls.from_json(read_json(path, "graph", GraphFormatError), source=f"graph file {path}")

    def save(self, path: str | os.PathLike) -> None:
        """Write the graph JSON atomically (temporary name, then rename)."""
        write_json_atomic(path, self.to_json())


def _list(data: dict, key: str, source: str) -> list:
    if not isinstance(data.get(key), list):
        raise GraphFormatError(f"{source}: key {key!r} must be a JSON list, got {data.get(key)!r:.80}.")
    return data[key]


def _int(x: Any, where: str, source: str) -> int:
    if isinstance(x, bool) or not isinstance(x, int):
        raise GraphFormatError(f"{source}: {where} must be an integer, got {x!r:.80}.")
    return x


def _optional_int(x: Any, where: str, source: str) -> int | None:
    """`_int`, or None for a JSON null."""
    return None if x is None else _int(x, where, source)


def _field(d: Any, key: str, where: str, source: str) -> Any:
    if not isinstance(d, dict) or key not in d:
        raise GraphFormatError(f"{source}: {where} lacks key {key!r}.")
    return d[key]


def _value(d: Any, i: int, source: str) -> Value:
    where = f"values[{i}]"
    shape = _field(d, "shape", where, source)
    if not isinstance(shape, list):
        raise GraphFormatError(f"{source}: {where}.shape must be a list of integers, got {shape!r:.80}.")
    for key in ("dtype", "kind", "name"):
        if not isinstance(_field(d, key, where, source), str):
            raise GraphFormatError(f"{source}: {where}.{key} must be a string.")
    return Value(
        id=_int(_field(d, "id", where, source), f"{where}.id", source),
        bytes=_int(_field(d, "bytes", where, source), f"{where}.bytes", source),
        shape=tuple(_int(s, f"{where}.shape", source) for s in shape),
        dtype=d["dtype"], kind=d["kind"], name=d["name"],
        producer=_optional_int(_field(d, "producer", where, source), f"{where}.producer", source),
    )


def _node(d: Any, i: int, source: str) -> Node:
    where = f"nodes[{i}]"
    lists = {}
    for key in ("targets", "inputs", "outputs"):
        lists[key] = _field(d, key, where, source)
        if not isinstance(lists[key], list):
            raise GraphFormatError(f"{source}: {where}.{key} must be a list.")
    for key in ("name", "phase"):
        if not isinstance(_field(d, key, where, source), str):
            raise GraphFormatError(f"{source}: {where}.{key} must be a string.")
    if not all(isinstance(t, str) for t in lists["targets"]):
        raise GraphFormatError(f"{source}: {where}.targets must be a list of strings.")
    return Node(
        id=_int(_field(d, "id", where, source), f"{where}.id", source),
        name=d["name"], targets=tuple(lists["targets"]), phase=d["phase"],
        inputs=tuple(_int(v, f"{where}.inputs", source) for v in lists["inputs"]),
        outputs=tuple(_int(v, f"{where}.outputs", source) for v in lists["outputs"]),
    )


def _check_structure(graph: OpGraph) -> None:
    """Dense ids; kinds and phases known; every value produced by exactly the node that lists it;
    graph inputs have no producer; nodes in a topological order; graph outputs exist."""
    n_values = len(graph.values)
    for i, value in enumerate(graph.values):
        if value.id != i:
            raise GraphFormatError(f"values[{i}] has id {value.id}; value ids must be 0..{n_values - 1} in order.")
        if value.kind not in KINDS:
            raise GraphFormatError(f"value {i} has kind {value.kind!r}; expected one of {', '.join(KINDS)}.")
        if value.bytes < 0:
            raise GraphFormatError(f"value {i} has negative bytes {value.bytes}.")
        if (value.producer is None) != (value.kind in INPUT_KINDS):
            raise GraphFormatError(
                f"value {i} of kind {value.kind!r} has producer {value.producer!r}; graph inputs (input, param, "
                f"buffer) have producer null, every other value names the node allocating it.")
    produced_by: dict[int, int] = {}
    for j, node in enumerate(graph.nodes):
        if node.id != j:
            raise GraphFormatError(f"nodes[{j}] has id {node.id}; node ids must be 0..{len(graph.nodes) - 1} in order.")
        if node.phase not in PHASES:
            raise GraphFormatError(f"node {j} has phase {node.phase!r}; expected one of {', '.join(PHASES)}.")
        for v in node.inputs + node.outputs:
            if not 0 <= v < n_values:
                raise GraphFormatError(f"node {j} names value {v}, which does not exist (0..{n_values - 1}).")
        for v in node.inputs:
            if graph.values[v].producer is not None and produced_by.get(v) is None:
                raise GraphFormatError(
                    f"node {j} reads value {v} before its producer node {graph.values[v].producer}; "
                    f"nodes must be listed in a topological order.")
        for v in node.outputs:
            if graph.values[v].producer != j or v in produced_by:
                raise GraphFormatError(
                    f"node {j} lists output value {v}, whose producer is {graph.values[v].producer!r}; "
                    f"each value must be the output of exactly its producer node.")
            produced_by[v] = j
    for value in graph.values:
        if value.producer is not None and value.id not in produced_by:
            raise GraphFormatError(f"value {value.id} names producer {value.producer} but that node does not list it.")
    for v in graph.outputs:
        if not 0 <= v < n_values:
            raise GraphFormatError(f"graph output {v} is not a value id (0..{n_values - 1}).")
