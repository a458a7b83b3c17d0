"""The compiled form's records, torch-free: a joint graph as the planner reads it, and a decision on it."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from functools import cached_property

from memplan.runtime.format.forms import COMPILED as FORM  # noqa: F401  (the compiled form's name)


@dataclass(frozen=True)
class JointNode:
    """One allocating op of a joint graph: its FX name and target, phase ("forward" / "backward"), the values it
    reads and allocates (ids into `JointGraph.value_bytes`) and its floating-point operations where it is a matmul,
    an attention or a convolution (else 0: runtime/compiled/joint.py)."""

    name: str
    target: str
    phase: str
    inputs: tuple[int, ...]
    outputs: tuple[int, ...]
    flops: int


@dataclass(frozen=True)
class JointGraph:
    """The allocating ops of a joint graph in graph order. Values `0..len(inputs)-1` are the graph's inputs
    (parameters, batch, tangents); `value_bytes[v]` is a value's storage bytes; `outputs` the values the graph
    returns (forward outputs, then gradients)."""

    nodes: tuple[JointNode, ...]
    value_bytes: tuple[int, ...]
    inputs: tuple[str, ...]
    outputs: tuple[int, ...]

    @cached_property
    def fingerprint(self) -> str:
        """SHA-256 of the graph's structure and sizes: a plan's decisions apply to this graph only."""
        data = [[n.name, n.target, n.phase, n.inputs, n.outputs] for n in self.nodes]
        return hashlib.sha256(json.dumps([data, self.value_bytes, self.inputs, self.outputs]).encode()).hexdigest()


@dataclass(frozen=True)
class Decision:
    """Forward nodes of one joint graph, by name: those the backward recomputes and those the forward saves for it
    (`MUST_SAVE`: never recomputed); the partitioner's min-cut places every other."""

    recompute: frozenset[str] = frozenset()
    save: frozenset[str] = frozenset()


@dataclass(frozen=True)
class RegionDecision:
    """A decision for the joint graph with `fingerprint` (`JointGraph.fingerprint`): one compiled region of a
    compiled-form plan (docs/plan-format.md, key `compiled`)."""

    fingerprint: str
    decision: Decision

    def to_json(self) -> dict[str, object]:
        return {"fingerprint": self.fingerprint, "recompute": sorted(self.decision.recompute),
                "save": sorted(self.decision.save)}
