"""The plan (`memplan-plan` JSON, docs/plan-format.md): a schedule of compute/free steps over an operator
graph, optional memory offsets, predictions and provenance. Torch-free.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from datetime import datetime, timezone
from importlib import metadata
from typing import Any, Iterable, Mapping

from runtime.graph import OpGraph
from runtime.jsonio import read_json, sha256_hex, write_json_atomic

FORMAT = "memplan-plan"
VERSION = 1
PREDICTED_KEYS = ("peak_bytes", "constant_bytes", "compute_cost", "time_ms")


class PlanError(ValueError):
    """A plan that is malformed, tampered with, of an unknown version, or invalid for a graph."""


def memplan_version() -> str:
    try:
        return metadata.version("memplan")
    except metadata.PackageNotFoundError:
        return "unknown"


def normalize_step(step: Any, where: str = "step") -> dict[str, Any]:
    """One schedule step as its JSON dict: `{"compute": N}`, `{"compute": N, "impl": name}` or
    `{"free": X}`. Accepts those dicts or the tuples `("compute", N[, impl])` / `("free", X)`."""
    if isinstance(step, (tuple, list)) and step and step[0] in ("compute", "free"):
        if step[0] == "compute" and len(step) in (2, 3):
            step = {"compute": step[1]} if len(step) == 2 or step[2] is None else {"compute": step[1], "impl": step[2]}
        elif step[0] == "free" and len(step) == 2:
            step = {"free": step[1]}
    if isinstance(step, Mapping):
        keys = set(step)
        if keys in ({"compute"}, {"compute", "impl"}, {"free"}):
            ref = step.get("compute", step.get("free"))
            impl = step.get("impl")
            if isinstance(ref, int) and not isinstance(ref, bool) and ref >= 0 and (impl is None or isinstance(impl, str)):
                if "free" in step:
                    return {"free": ref}
                return {"compute": ref} if impl is None else {"compute": ref, "impl": impl}
    raise PlanError(
        f"{where} is {step!r:.120}; a step is {{\"compute\": node_id}} (optionally with \"impl\": name) or "
        f"{{\"free\": value_id}} with a non-negative integer id.")


@dataclass
class Plan:
    """A schedule for the operator graph with fingerprint `fingerprint`.

    `schedule` holds normalized step dicts; `offsets` maps value id to a byte offset (OLLA address
    assignment; carried for allocators, not used by the executor); `predicted` holds the simulator's
    numbers; `provenance` says who made the plan and how.
    """

    fingerprint: str
    schedule: list[dict[str, Any]]
    offsets: dict[int, int] | None = None
    predicted: dict[str, Any] = field(default_factory=dict)
    provenance: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.fingerprint, str) or not self.fingerprint:
            raise PlanError(f"plan key 'fingerprint' must be a non-empty string, got {self.fingerprint!r:.80}.")
        if not isinstance(self.schedule, Iterable) or isinstance(self.schedule, (str, bytes, Mapping)):
            raise PlanError("plan key 'schedule' must be a list of steps.")
        self.schedule = [normalize_step(s, f"schedule[{i}]") for i, s in enumerate(self.schedule)]
        if self.offsets is not None:
            if not isinstance(self.offsets, Mapping):
                raise PlanError("plan key 'offsets' must be an object mapping value ids to byte offsets.")
            self.offsets = {_id_key(k): _offset(k, v) for k, v in self.offsets.items()}
        if not isinstance(self.predicted, Mapping):
            raise PlanError("plan key 'predicted' must be an object.")
        for key, val in self.predicted.items():
            if key not in PREDICTED_KEYS or not (val is None or _is_number(val)):
                raise PlanError(
                    f"plan predicted[{key!r}] = {val!r:.80}: allowed keys are {', '.join(PREDICTED_KEYS)}, "
                    f"each a number or null.")
        self.predicted = dict(self.predicted)
        if not isinstance(self.provenance, Mapping) or not all(isinstance(k, str) for k in self.provenance):
            raise PlanError("plan key 'provenance' must be an object with string keys.")
        self.provenance = dict(self.provenance)

    # -- serialization ---------------------------------------------------------------------------

    def _body(self) -> dict[str, Any]:
        body: dict[str, Any] = {"format": FORMAT, "version": VERSION, "fingerprint": self.fingerprint,
                                "schedule": self.schedule}
        if self.offsets is not None:
            body["offsets"] = {str(k): v for k, v in sorted(self.offsets.items())}
        body["predicted"] = self.predicted
        body["provenance"] = self.provenance
        return body

    def to_json(self) -> dict[str, Any]:
        """The plan JSON, with `checksum` = SHA-256 of the canonical JSON of every other key."""
        body = self._body()
        return {**body, "checksum": sha256_hex(body)}

    def save(self, path: str | os.PathLike) -> None:
        """Write the plan JSON atomically (temporary name, then rename)."""
        write_json_atomic(path, self.to_json())

    @classmethod
    def load(cls, path_or_dict: str | os.PathLike | Mapping[str, Any]) -> "Plan":
        """Read a plan from a file (which must carry its `checksum`) or from a dict (checksum checked
        when present). Refuses malformed or truncated JSON, unknown format/version, bad keys and
        content that does not match its checksum."""
        if isinstance(path_or_dict, Mapping):
            data, source, need_checksum = dict(path_or_dict), "plan dict", False
        else:
            data = read_json(path_or_dict, "plan", PlanError)
            source, need_checksum = f"plan file {path_or_dict}", True
        if not isinstance(data, dict):
            raise PlanError(f"{source}: expected a JSON object, got {type(data).__name__}.")
        if data.get("format") != FORMAT:
            raise PlanError(f"{source}: key 'format' is {data.get('format')!r}, expected {FORMAT!r}.")
        if data.get("version") != VERSION:
            raise PlanError(
                f"{source}: plan format version {data.get('version')!r} is not supported (this memplan "
                f"reads version {VERSION}); regenerate the plan with this memplan version.")
        unknown = set(data) - {"format", "version", "fingerprint", "schedule", "offsets", "predicted",
                               "provenance", "checksum"}
        if unknown:
            raise PlanError(f"{source}: unknown keys {sorted(unknown)}; see docs/plan-format.md.")
        for key in ("fingerprint", "schedule"):
            if key not in data:
                raise PlanError(f"{source}: required key {key!r} is missing.")
        try:
            plan = cls(data["fingerprint"], data["schedule"], data.get("offsets"),
                       data.get("predicted", {}), data.get("provenance", {}))
        except PlanError as exc:
            raise PlanError(f"{source}: {exc}") from None
        if "checksum" in data or need_checksum:
            expected = sha256_hex({k: v for k, v in data.items() if k != "checksum"})
            if data.get("checksum") != expected:
                raise PlanError(
                    f"{source}: key 'checksum' is {data.get('checksum')!r} but the content hashes to "
                    f"{expected!r}; the plan was edited or corrupted after it was written. Regenerate "
                    f"it (plans are written by Plan.save).")
        return plan

    # -- validation ------------------------------------------------------------------------------

    def compute_steps(self) -> list[int]:
        """Node ids of the compute steps, in order."""
        return [s["compute"] for s in self.schedule if "compute" in s]

    def validate(self, graph: OpGraph) -> None:
        """Refuse the plan unless it was made for `graph` and every compute finds its inputs resident:
        graph inputs always are; a value is resident once computed, until an explicit free; freeing a
        value that is not resident or is a graph input is an error; graph outputs must be resident at
        the end."""
        if self.fingerprint != graph.fingerprint:
            raise PlanError(
                f"plan fingerprint {self.fingerprint} does not match the graph being executed "
                f"(fingerprint {graph.fingerprint}): the plan was made for another model, loss, input "
                f"shape or dtype. Make a plan for this graph.")
        n_nodes, n_values = len(graph.nodes), len(graph.values)
        resident = {v.id for v in graph.values if v.producer is None}
        freed_at: dict[int, int] = {}
        for i, step in enumerate(self.schedule):
            if "compute" in step:
                n = step["compute"]
                if n >= n_nodes:
                    raise PlanError(f"schedule[{i}] computes node {n}, which does not exist (0..{n_nodes - 1}).")
                for v in graph.nodes[n].inputs:
                    if v not in resident:
                        why = (f"it was freed at schedule[{freed_at[v]}]" if v in freed_at
                               else f"its producer node {graph.values[v].producer} has not been computed")
                        raise PlanError(
                            f"schedule[{i}] computes node {n} ({graph.nodes[n].name}), which reads value {v} "
                            f"({graph.values[v].name}), but {why}. Compute the producer first.")
                resident.update(graph.nodes[n].outputs)
            else:
                x = step["free"]
                if x >= n_values:
                    raise PlanError(f"schedule[{i}] frees value {x}, which does not exist (0..{n_values - 1}).")
                if graph.values[x].producer is None:
                    raise PlanError(f"schedule[{i}] frees value {x} ({graph.values[x].kind} "
                                    f"{graph.values[x].name}); graph inputs are always resident.")
                if x not in resident:
                    raise PlanError(f"schedule[{i}] frees value {x} ({graph.values[x].name}), which is not resident.")
                resident.discard(x)
                freed_at[x] = i
        missing = [v for v in graph.outputs if v not in resident]
        if missing:
            raise PlanError(
                f"graph outputs {missing[:10]} ({', '.join(graph.values[v].name for v in missing[:3])}...) are "
                f"not resident at the end of the schedule; every output must be computed and not freed after.")
        if self.offsets is not None:
            bad = [k for k in self.offsets if k >= n_values]
            if bad:
                raise PlanError(f"plan offsets name values {bad[:10]} that do not exist (0..{n_values - 1}).")


def default_plan(graph: OpGraph) -> Plan:
    """The eager order (captured node order), every node computed once, no recomputation."""
    return Plan(graph.fingerprint, [{"compute": n.id} for n in graph.nodes],
                provenance={"solver": "default", "created_at": datetime.now(timezone.utc).isoformat(),
                            "memplan_version": memplan_version()})


def _is_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _id_key(k: Any) -> int:
    if isinstance(k, int) and not isinstance(k, bool) and k >= 0:
        return k
    if isinstance(k, str) and k.isdigit():
        return int(k)
    raise PlanError(f"plan offsets key {k!r} is not a value id (a non-negative integer).")


def _offset(k: Any, v: Any) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise PlanError(f"plan offsets[{k!r}] = {v!r}; offsets are non-negative integers (bytes).")
    return v
