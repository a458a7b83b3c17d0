"""The plan (`memplan-plan` JSON, docs/plan-format.md): a schedule of compute/free steps over an operator
graph (each compute naming its implementation variant), optional addresses for value copies,
predictions and provenance. Torch-free.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from datetime import datetime, timezone
from importlib import metadata
from typing import Any, Iterable, Mapping, NamedTuple

from memplan.runtime.compiled.records import Decision, RegionDecision
from memplan.runtime.format.forms import COMPILED, EXECUTOR, POLICY, PlanForm
from memplan.runtime.format.graph import OpGraph
from memplan.runtime.format.jsonio import read_json, sha256_hex, write_json_atomic
from memplan.runtime.format.schedule import Absence, walk
from memplan.runtime.variants.offered import DEFAULT, GraphVariants, graph_variants

FORMAT = "memplan-plan"
VERSION = 2
READABLE_VERSIONS = (1, 2)
PREDICTED_KEYS = ("peak_bytes", "constant_bytes", "compute_cost", "time_ms", "arena_bytes", "optimizer_state_bytes",
                  "dispatch_cost")

Copy = tuple[int, int]
"""A value copy: (index of the schedule step computing it, value id)."""


class PlanError(ValueError):
    """A plan that is malformed, tampered with, of an unknown version, or invalid for a graph."""


def memplan_version() -> str:
    try:
        return metadata.version("memplan")
    except metadata.PackageNotFoundError:
        return "unknown"


def normalize_step(step: Any, where: str = "step") -> dict[str, Any]:
    """One schedule step as its JSON dict: `{"compute": N}`, `{"compute": N, "impl": name}` or
    `{"free": X}`; a compute may also carry `"holds": [X, ...]`, values it keeps live without reading them
    (docs/plan-format.md), written sorted without repeats. Accepts those dicts or the tuples
    `("compute", N[, impl])` / `("free", X)`; the default implementation is written without `impl`."""
    if type(step) is tuple and len(step) == 2 and step[0] in ("compute", "free") and _is_id(step[1]):
        return {step[0]: step[1]}                 # the solvers' steps: every simulation normalizes them
    if isinstance(step, (tuple, list)) and step and step[0] in ("compute", "free"):
        if step[0] == "compute" and len(step) in (2, 3):
            step = {"compute": step[1]} if len(step) == 2 or step[2] is None else {"compute": step[1], "impl": step[2]}
        elif step[0] == "free" and len(step) == 2:
            step = {"free": step[1]}
    if isinstance(step, dict) or isinstance(step, Mapping):     # dict first: typing.Mapping's check is slow
        keys = set(step)
        if keys in ({"compute"}, {"compute", "impl"}, {"free"}, {"compute", "holds"}, {"compute", "impl", "holds"}):
            ref = step.get("compute", step.get("free"))
            impl = step.get("impl")
            holds = step.get("holds", [])
            if _is_id(ref) and (impl is None or isinstance(impl, str)) and isinstance(holds, (list, tuple)) \
                    and all(_is_id(v) for v in holds):
                if "free" in step:
                    return {"free": ref}
                out = {"compute": ref} if impl in (None, DEFAULT) else {"compute": ref, "impl": impl}
                return {**out, "holds": sorted(set(holds))} if holds else out
    raise PlanError(
        f"{where} is {step!r:.120}; a step is {{\"compute\": node_id}} (optionally with \"impl\": name and "
        f"\"holds\": [value_id, ...]) or {{\"free\": value_id}} with non-negative integer ids.")


def _is_id(ref: Any) -> bool:
    return isinstance(ref, int) and not isinstance(ref, bool) and ref >= 0


@dataclass
class Plan:
    """A schedule for the operator graph with fingerprint `fingerprint`.

    `schedule` holds normalized step dicts; `addresses` maps a value copy (step computing it, value id)
    to its byte offset in the arena (OLLA's address assignment; `runtime.load(..., arena=True)` places
    the copy there); `predicted` holds the simulator's numbers; `provenance` says who made the plan and
    how.
    """

    fingerprint: str
    schedule: list[dict[str, Any]]
    addresses: dict[Copy, int] | None = None
    predicted: dict[str, Any] = field(default_factory=dict)
    provenance: dict[str, Any] = field(default_factory=dict)
    compiled: tuple[RegionDecision, ...] | None = None
    v1_offsets: dict[int, int] | None = field(default=None, repr=False)
    """A version-1 plan's per-value offsets, turned into `addresses` by `validate(graph)`."""

    def __post_init__(self) -> None:
        if not isinstance(self.fingerprint, str) or not self.fingerprint:
            raise PlanError(f"plan key 'fingerprint' must be a non-empty string, got {self.fingerprint!r:.80}.")
        if not isinstance(self.schedule, Iterable) or isinstance(self.schedule, (str, bytes, Mapping)):
            raise PlanError("plan key 'schedule' must be a list of steps.")
        self.schedule = [normalize_step(s, f"schedule[{i}]") for i, s in enumerate(self.schedule)]
        if self.addresses is not None:
            self.addresses = _addresses(self.addresses, self.schedule)
        if not isinstance(self.predicted, Mapping):
            raise PlanError("plan key 'predicted' must be an object.")
        for key, val in self.predicted.items():
            if key not in PREDICTED_KEYS or not (val is None or (_is_number(val) and math.isfinite(val))):
                raise PlanError(
                    f"plan predicted[{key!r}] = {val!r:.80}: allowed keys are {', '.join(PREDICTED_KEYS)}, "
                    f"each a finite number or null.")
        self.predicted = dict(self.predicted)
        if not isinstance(self.provenance, Mapping) or not all(isinstance(k, str) for k in self.provenance):
            raise PlanError("plan key 'provenance' must be an object with string keys.")
        budget = self.provenance.get("budget_bytes")
        if budget is not None and not (_is_index(budget)):
            raise PlanError(f"plan provenance['budget_bytes'] = {budget!r:.80} is not a number of bytes (a non-negative "
                            f"integer); the plan was edited after it was made: regenerate it.")
        self.provenance = dict(self.provenance)
        if self.provenance.get("form", POLICY) != POLICY:
            raise PlanError(f"plan provenance['form'] = {self.provenance['form']!r:.80}: a plan records only the policy "
                            f"form there (\"policy\"; a compiled plan has the key 'compiled', an executor plan neither); "
                            f"the plan was edited after it was made: regenerate it.")
        if self.compiled is not None:
            self.compiled = _region_decisions(self.compiled)
            if self.schedule or self.addresses:
                raise PlanError("a compiled-form plan (key 'compiled') has an empty schedule and no addresses: "
                                "inductor runs the step; regenerate the plan.")

    # -- serialization ---------------------------------------------------------------------------

    def _body(self) -> dict[str, Any]:
        if self.v1_offsets is not None:
            raise PlanError("this version-1 plan's offsets are keyed by value; call plan.validate(graph) to turn "
                            "them into copy addresses before writing it as version 2.")
        body: dict[str, Any] = {"format": FORMAT, "version": VERSION, "fingerprint": self.fingerprint,
                                "schedule": self.schedule}
        if self.addresses is not None:
            body["addresses"] = [[step, value, offset] for (step, value), offset in sorted(self.addresses.items())]
        if self.compiled is not None:
            body["compiled"] = [region.to_json() for region in self.compiled]
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
        version = data.get("version")
        if version not in READABLE_VERSIONS or isinstance(version, bool):
            raise PlanError(
                f"{source}: plan format version {version!r} is not supported (this memplan reads versions "
                f"{', '.join(map(str, READABLE_VERSIONS))}); regenerate the plan with this memplan version.")
        where = "offsets" if version == 1 else "addresses"
        unknown = set(data) - {"format", "version", "fingerprint", "schedule", where, "predicted",
                               "provenance", "checksum", *(("compiled",) if version >= 2 else ())}
        if unknown:
            raise PlanError(f"{source}: unknown keys {sorted(unknown)} for plan version {version}; see "
                            f"docs/plan-format.md.")
        for key in ("fingerprint", "schedule"):
            if key not in data:
                raise PlanError(f"{source}: required key {key!r} is missing.")
        try:
            plan = cls(data["fingerprint"], data["schedule"], data.get("addresses"),
                       data.get("predicted", {}), data.get("provenance", {}), data.get("compiled"))
            if version == 1 and data.get("offsets") is not None:
                plan.v1_offsets = _v1_offsets(data["offsets"])
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

    def _difference(self, graph: OpGraph) -> str:
        """What differs between the graph the plan was made for (as its provenance records it) and `graph`,
        in a sentence."""
        batch = self.provenance.get("batch")
        if batch is not None and "batch" in graph.meta and batch != graph.meta["batch"]:
            return (f"the plan was made for the batch {_shapes(batch)} and this step's batch is "
                    f"{_shapes(graph.meta['batch'])}.")
        captured = (graph.meta.get("rewrites") or {}).get("applied")
        if self.rewrites is None and captured is not None:
            return ("the plan records no rewrite selection, so this capture chose its rewrites on this host, and "
                    "the default choice depends on torch's thread count (pointwise convolution gradients): load "
                    "it at the thread count it was made with, or make the plan again with this memplan, which "
                    "records the selection it was made with.")
        if captured is not None and self.rewrites != captured:
            return (f"the plan's rewrite selection {self.rewrites} is not this capture's {captured}: the model "
                    f"differs.")
        return "the plan was made for another model, loss, input shape, dtype or training mode."

    @property
    def form(self) -> PlanForm:
        """How the plan runs: "compiled" (`compiled`: `runtime.load` compiles the step with inductor), "policy"
        (`runtime.apply`, `provenance.form`) or "executor" (`runtime.load`)."""
        if self.compiled is not None:
            return COMPILED
        return POLICY if self.provenance.get("form") == POLICY else EXECUTOR

    @property
    def rewrites(self) -> dict[str, list[int]] | None:
        """The rewrite selection of the graph the plan was made for (`provenance["rewrites"]["applied"]`,
        docs/graph-format.md), which `runtime.load` captures with; None for a plan that records none."""
        record = self.provenance.get("rewrites")
        return dict(record["applied"]) if isinstance(record, Mapping) and isinstance(record.get("applied"), Mapping) \
            else None

    def compute_steps(self) -> list[int]:
        """Node ids of the compute steps, in order."""
        return [s["compute"] for s in self.schedule if "compute" in s]

    def impls(self) -> set[str]:
        """Implementation variants the schedule names besides the default."""
        return {s["impl"] for s in self.schedule if "impl" in s}      # normalized steps omit the default

    def validate(self, graph: OpGraph, variants: GraphVariants | None = None) -> GraphVariants:
        """Refuse the plan unless it was made for `graph` and every compute finds its inputs resident:
        graph inputs always are; a value is resident once computed (by a variant that allocates it),
        until an explicit free; freeing a value that is not resident or is a graph input is an error;
        graph outputs must be resident at the end; each compute's `impl` is a variant the node offers;
        an in-place variant's overwritten input is no longer resident after its step;
        each address names a value that its step allocates and that does not outlive the step (the
        final copy of a graph output) nor shares storage through an in-place step. Returns the graph's
        variants."""
        if self.fingerprint != graph.fingerprint:
            raise PlanError(
                f"plan fingerprint {self.fingerprint} does not match the graph being executed "
                f"(fingerprint {graph.fingerprint}): {self._difference(graph)} Make a plan for this graph.")
        variants = graph_variants(graph) if variants is None else variants
        w = walk(self.schedule, len(graph.nodes), len(graph.values) + len(variants.values),
                 lambda v: variants.value(graph, v).producer is None,
                 lambda i, node, impl: _step_io(graph, variants, i, node, impl), graph.outputs,
                 _Complaints(graph, variants))
        allocated = {i: tuple(io.outputs) for i, io in enumerate(w.io) if io is not None}
        shared = {(w.copy_start[k], w.copy_value[k]) for k in w.shared}
        live_until = {(start, v): end for start, v, end in zip(w.copy_start, w.copy_value, w.copy_end)}
        if self.v1_offsets is not None:
            self.addresses = _resolve_v1_offsets(self.v1_offsets, allocated)
            self.v1_offsets = None
        for step, value in self.addresses or {}:
            if value not in allocated.get(step, ()):
                raise PlanError(f"plan addresses name value {value} at schedule[{step}], but that step does not "
                                f"allocate it; an address is keyed by the compute step that allocates the copy.")
            if (step, value) in shared:
                raise PlanError(f"plan addresses place value {value} ({variants.value(graph, value).name}) at "
                                f"schedule[{step}], a copy that an in-place step overwrites or writes into; their "
                                f"shared storage outlives the copy, so it cannot live in the arena: drop that address.")
            if value in graph.outputs and w.copy_start[w.final[value]] == step:
                raise PlanError(f"plan addresses place value {value} ({graph.values[value].name}) at "
                                f"schedule[{step}], its final copy as a graph output, which outlives the step and so "
                                f"cannot live in the step's arena; drop that address.")
        _check_placement(graph, variants, self.addresses or {}, live_until)
        return variants


class _StepIO(NamedTuple):
    inputs: tuple[int, ...]
    outputs: tuple[int, ...]
    overwrites: tuple[tuple[int, int], ...]


def _step_io(graph: OpGraph, variants: GraphVariants, i: int, node: int, impl: str | None) -> _StepIO:
    try:
        inputs, outputs = variants.io(graph, node, impl)
    except KeyError as exc:
        raise PlanError(f"schedule[{i}]: {exc.args[0]}") from None
    spec = variants.spec(node, impl)
    return _StepIO(tuple(inputs), tuple(outputs), tuple(spec.overwrites) if spec is not None else ())


class _Complaints:
    """The plan's wording of an invalid schedule (`runtime.format.schedule.Complaints`)."""

    def __init__(self, graph: OpGraph, variants: GraphVariants):
        self.graph, self.variants = graph, variants

    def error(self, message: str) -> PlanError:
        return PlanError(message)

    def absent_input(self, step: int, node: int, value: int, why: Absence) -> PlanError:
        graph, variants = self.graph, self.variants
        reason = (f"it was freed at schedule[{why.freed}]" if why.freed is not None else
                  f"schedule[{why.overwritten}] overwrote it in place" if why.overwritten is not None
                  else f"its producer node {variants.value(graph, value).producer} has not been "
                       f"computed by a variant that allocates it")
        return PlanError(f"schedule[{step}] computes node {node} ({graph.nodes[node].name}), which reads value "
                         f"{value} ({variants.value(graph, value).name}), but {reason}. Compute the producer first.")

    def free_input(self, step: int, value: int) -> PlanError:
        v = self.graph.values[value]
        return PlanError(f"schedule[{step}] frees value {value} ({v.kind} {v.name}); graph inputs are always resident.")

    def free_absent(self, step: int, value: int, why: Absence) -> PlanError:
        return PlanError(f"schedule[{step}] frees value {value} ({self.variants.value(self.graph, value).name}), "
                         f"which is not resident.")

    def missing_outputs(self, missing: list[int]) -> PlanError:
        return PlanError(
            f"graph outputs {missing[:10]} ({', '.join(self.graph.values[v].name for v in missing[:3])}...) are "
            f"not resident at the end of the schedule; every output must be computed and not freed after.")


ITEM_BYTES = {"float64": 8, "float32": 4, "float16": 2, "bfloat16": 2, "int64": 8, "int32": 4, "int16": 2,
              "int8": 1, "uint8": 1, "bool": 1, "complex64": 8, "complex128": 16}
MAX_ARENA_BYTES = 2**62
"""No arena extends past this byte (an address beyond it is a corrupt plan, not a large model)."""


def _check_placement(graph: OpGraph, variants: GraphVariants, addresses: Mapping[Copy, int],
                     live_until: Mapping[Copy, int]) -> None:
    """Refuse addresses the arena cannot hold: an offset not a multiple of the value's element size (the arena
    is viewed as that dtype there), a copy ending past `MAX_ARENA_BYTES`, or two copies live at a common step
    (from the step computing each to its last read, as `tasks.solve.core.simulator` counts them) whose byte ranges
    [offset, offset + bytes) overlap. A sweep over the copies by first step, each checked against the placed
    copies still live."""
    live: list[tuple[int, int, int, Copy]] = []           # (last step, low byte, high byte, copy)
    for copy in sorted(addresses, key=lambda c: c[0]):
        step, value = copy
        offset, info = addresses[copy], variants.value(graph, value)
        item = ITEM_BYTES.get(info.dtype, 16)
        if offset % item:
            raise PlanError(f"plan addresses place value {value} ({info.name}, {info.dtype}) at byte {offset}, "
                            f"which is not a multiple of its element size {item}; the arena is viewed as that dtype "
                            f"there. Regenerate the plan's addresses.")
        if offset + info.bytes > MAX_ARENA_BYTES:
            raise PlanError(f"plan addresses place value {value} ({info.name}) at byte {offset}, past any arena "
                            f"(2**62 bytes); the plan is corrupt. Regenerate it.")
        live = [entry for entry in live if entry[0] >= step]
        low, high = offset, offset + info.bytes
        for _, other_low, other_high, other in live:
            if low < other_high and other_low < high:
                raise PlanError(
                    f"plan addresses overlap: value {value} ({info.name}, computed at schedule[{step}], bytes "
                    f"{low}..{high}) and value {other[1]} (computed at schedule[{other[0]}], bytes "
                    f"{other_low}..{other_high}) are live together at schedule[{step}]. The addresses were not "
                    f"made for this schedule or were edited; regenerate them (addresses = \"greedy\" or \"olla\").")
        if info.bytes:
            live.append((live_until.get(copy, step), low, high, copy))


def default_plan(graph: OpGraph) -> Plan:
    """The eager order (captured node order), every node computed once, no recomputation."""
    return Plan(graph.fingerprint, [{"compute": n.id} for n in graph.nodes],
                provenance={"solver": "default", "created_at": datetime.now(timezone.utc).isoformat(),
                            "memplan_version": memplan_version(), **graph_provenance(graph)})


def graph_provenance(graph: OpGraph) -> dict[str, Any]:
    """What a plan records about the graph it was made for: its rewrite record (`rewrites`: the selection
    `runtime.load` captures with, and where it was verified) and its batch's shapes and dtypes (`batch`),
    where the graph's meta has them."""
    return {key: graph.meta[key] for key in ("rewrites", "batch", "capture") if key in graph.meta}


def _shapes(batch: Any) -> str:
    """A recorded batch (`[{"shape": [...], "dtype": ...}, ...]`) as `[2, 3] float32, [2] int64`."""
    return ", ".join(f"{b.get('shape')} {b.get('dtype')}" if isinstance(b, Mapping) else str(b) for b in batch)


_FINGERPRINT = frozenset("0123456789abcdef")


def _region_decisions(regions: Any) -> tuple[RegionDecision, ...]:
    """The typed `compiled` key: a list of {"fingerprint": 64 hex digits, "recompute": [node name, ...],
    "save": [node name, ...]}, fingerprints distinct, no node both recomputed and saved."""
    if all(isinstance(r, RegionDecision) for r in regions) and not isinstance(regions, (str, bytes, Mapping)):
        parsed = tuple(regions)
    else:
        parsed = tuple(_region_decision(r, i) for i, r in enumerate(_list(regions, "compiled")))
    for i, region in enumerate(parsed):
        both = region.decision.recompute & region.decision.save
        if both:
            raise PlanError(f"plan compiled[{i}] both recomputes and saves {sorted(both)[:3]}; a node is one or the "
                            f"other: regenerate the plan.")
    fingerprints = [r.fingerprint for r in parsed]
    if len(set(fingerprints)) != len(fingerprints):
        raise PlanError("plan key 'compiled' names one joint graph fingerprint twice; regenerate the plan.")
    return parsed


def _region_decision(region: Any, i: int) -> RegionDecision:
    where = f"plan compiled[{i}]"
    if not isinstance(region, Mapping) or set(region) != {"fingerprint", "recompute", "save"}:
        raise PlanError(f"{where} is {region!r:.120}; each is {{\"fingerprint\": hex, \"recompute\": [names], "
                        f"\"save\": [names]}}.")
    fingerprint = region["fingerprint"]
    if not (isinstance(fingerprint, str) and len(fingerprint) == 64 and set(fingerprint) <= _FINGERPRINT):
        raise PlanError(f"{where}['fingerprint'] = {fingerprint!r:.80} is not 64 lower-case hex digits (a joint "
                        f"graph's SHA-256).")
    names = {key: _list(region[key], f"{where}[{key!r}]") for key in ("recompute", "save")}
    for key, items in names.items():
        if not all(isinstance(n, str) and n for n in items):
            raise PlanError(f"{where}[{key!r}] must list node names (non-empty strings).")
    return RegionDecision(fingerprint, Decision(frozenset(names["recompute"]), frozenset(names["save"])))


def _list(value: Any, where: str) -> list[Any]:
    if not isinstance(value, (list, tuple)):
        raise PlanError(f"plan key {where} must be a list, got {type(value).__name__}.")
    return list(value)


def _is_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _is_index(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def _addresses(addresses: Any, schedule: list[dict[str, Any]]) -> dict[Copy, int]:
    """`{(step, value): offset}` from a mapping or from the JSON list of `[step, value, offset]`."""
    if isinstance(addresses, Mapping):
        addresses = [(*key, offset) if isinstance(key, tuple) else (key, offset) for key, offset in addresses.items()]
    if isinstance(addresses, (str, bytes)) or not isinstance(addresses, Iterable):
        raise PlanError("plan key 'addresses' must be a list of [step, value, offset] triples.")
    out: dict[Copy, int] = {}
    for entry in addresses:
        flat = tuple(entry) if isinstance(entry, (list, tuple)) else ()
        if len(flat) != 3 or not all(_is_index(x) for x in flat):
            raise PlanError(f"plan addresses entry {entry!r:.80} is not [step, value, offset] with non-negative "
                            f"integers.")
        step, value, offset = flat
        if step >= len(schedule) or "compute" not in schedule[step]:
            raise PlanError(f"plan addresses entry {list(flat)} names schedule[{step}], which is not a compute step.")
        if (step, value) in out:
            raise PlanError(f"plan addresses give copy (step {step}, value {value}) twice.")
        out[step, value] = offset
    return out


def _resolve_v1_offsets(offsets: dict[int, int], allocated: dict[int, tuple[int, ...]]) -> dict[Copy, int]:
    """Version-1 offsets as addresses of each value's one copy (its only compute step)."""
    steps: dict[int, list[int]] = {}
    for step, values in allocated.items():
        for v in values:
            steps.setdefault(v, []).append(step)
    out = {}
    for value, offset in offsets.items():
        found = steps.get(value, [])
        if len(found) != 1:
            raise PlanError(f"version-1 plan offsets place value {value}, which the schedule computes "
                            f"{len(found)} times; a per-value offset can place only a value computed once. "
                            f"Regenerate the plan (version 2 keys addresses by compute step).")
        out[found[0], value] = offset
    return out


def _v1_offsets(offsets: Any) -> dict[int, int]:
    """Version-1 `offsets`: value id -> byte offset."""
    if not isinstance(offsets, Mapping):
        raise PlanError("plan key 'offsets' (version 1) must be an object mapping value ids to byte offsets.")
    out = {}
    for k, v in offsets.items():
        key = int(k) if isinstance(k, str) and k.isdigit() else k
        if not _is_index(key) or not _is_index(v):
            raise PlanError(f"plan offsets[{k!r}] = {v!r:.40}: version-1 offsets map value ids to byte offsets, "
                            f"both non-negative integers.")
        out[key] = v
    return out


def plan_id(plan: Plan) -> str:
    """Content address of a plan: SHA-256 of its canonical JSON without `checksum` and `created_at`."""
    body = plan.to_json()
    body.pop("checksum")
    body["provenance"] = {k: v for k, v in body["provenance"].items() if k != "created_at"}
    return sha256_hex(body)
