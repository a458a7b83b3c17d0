"""The one checker of valid schedules (torch-free), shared by the plan's validation (`runtime.format.plan.Plan.validate`)
and the simulator (`tasks.solve.core.simulator.simulate`).

A schedule is valid when every compute finds its inputs resident: graph inputs always are; a value is
resident once computed (by an implementation that allocates it), until an explicit free or an in-place
step that overwrites it; freeing a value that is not resident or is a graph input is an error; graph
outputs must be resident at the end. A compute step's `holds` must be resident too: values it keeps live
without reading them (what a checkpoint's frame holds, runtime/policy/form.py). `walk` checks this and
returns the value copies with their live ranges: a copy lives from the step computing it to its last read
or hold (the step before an in-place step that overwrites it), a graph output's final copy to the end.
Each caller words its own errors (`Complaints`).
`update_steps` (the optimizer inside the step) and `gradient_buckets` (DistributedDataParallel's all-reduce)
place per-gradient actions on a schedule, for the executor and the simulator alike; `update_slices` says in which
elementwise slices the optimizer inside the step updates a large parameter.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping, Protocol, Sequence


class StepIO(Protocol):
    """What a compute step reads, allocates and overwrites in place ((output, overwritten input) pairs)."""

    @property
    def inputs(self) -> Sequence[int]: ...

    @property
    def outputs(self) -> Sequence[int]: ...

    @property
    def overwrites(self) -> Sequence[tuple[int, int]]: ...


@dataclass(frozen=True)
class Absence:
    """Why a value has no resident copy: freed at step `freed`, overwritten in place at step `overwritten`
    (by node `by`), or neither (never computed by an implementation that allocates it)."""

    freed: int | None = None
    overwritten: int | None = None
    by: int | None = None


class Complaints(Protocol):
    """The caller's exceptions for each way a schedule is invalid (step index first); `error(message)` for a
    node or value id out of range."""

    def error(self, message: str) -> Exception: ...
    def absent_input(self, step: int, node: int, value: int, why: Absence) -> Exception: ...
    def free_input(self, step: int, value: int) -> Exception: ...
    def free_absent(self, step: int, value: int, why: Absence) -> Exception: ...
    def missing_outputs(self, missing: list[int]) -> Exception: ...


@dataclass
class Walk:
    """The copies of a valid schedule: copy k holds `copy_value[k]`, computed at `copy_start[k]` and live
    through `copy_end[k]`; `shared` lists the copies of in-place steps (an overwritten input's and the output
    written into it), `io[i]` is step i's `StepIO` (None for a free) and `final[v]` value v's last copy."""

    copy_value: list[int] = field(default_factory=list)
    copy_start: list[int] = field(default_factory=list)
    copy_end: list[int] = field(default_factory=list)
    shared: list[int] = field(default_factory=list)
    io: list[Any] = field(default_factory=list)
    final: dict[int, int] = field(default_factory=dict)


def walk(steps: Iterable[Mapping[str, Any]], num_nodes: int, num_values: int, is_input: Callable[[int], bool],
         io: Callable[[int, int, str | None], StepIO], outputs: Sequence[int], complaints: Complaints) -> Walk:
    """Check the normalized `steps` (module docstring) and return their copies; `io(step, node, impl)` raises
    the caller's error for an implementation the node does not offer."""
    w = Walk()
    copy_value, copy_end = w.copy_value, w.copy_end
    current: dict[int, int] = {}                   # value -> its resident copy
    freed_at: dict[int, int] = {}
    overwritten_at: dict[int, tuple[int, int]] = {}
    for i, step in enumerate(steps):
        if "compute" in step:
            node = step["compute"]
            if node >= num_nodes:
                raise complaints.error(f"schedule[{i}] computes node {node}, which does not exist (0..{num_nodes - 1}).")
            spec = io(i, node, step.get("impl"))
            w.io.append(spec)
            holds = step.get("holds", ())                 # kept live through the step, not read
            missing = next((v for v in holds if v >= num_values), None)
            if missing is not None:
                raise complaints.error(f"schedule[{i}] holds value {missing}, which does not exist "
                                       f"(0..{num_values - 1}).")
            for v in (*spec.inputs, *holds):
                if is_input(v):
                    continue
                if v not in current:
                    raise complaints.absent_input(i, node, v, _absence(v, freed_at, overwritten_at))
                copy_end[current[v]] = i
            for _, v in spec.overwrites:              # the input's copy ends with the step before
                c = current.pop(v)
                copy_end[c] = i - 1
                w.shared.append(c)
                freed_at.pop(v, None)
                overwritten_at[v] = (i, node)
            if spec.overwrites:
                w.shared.extend(len(copy_value) + list(spec.outputs).index(o) for o, _ in spec.overwrites)
            for v in spec.outputs:
                current[v] = len(copy_value)
                copy_value.append(v)
                w.copy_start.append(i)
                copy_end.append(i)
        else:
            w.io.append(None)
            v = step["free"]
            if v >= num_values:
                raise complaints.error(f"schedule[{i}] frees value {v}, which does not exist (0..{num_values - 1}).")
            if is_input(v):
                raise complaints.free_input(i, v)
            if v not in current:
                raise complaints.free_absent(i, v, _absence(v, freed_at, overwritten_at))
            del current[v]
            freed_at[v] = i
            overwritten_at.pop(v, None)
    missing = [v for v in outputs if v not in current]
    if missing:
        raise complaints.missing_outputs(missing)
    for v in outputs:
        w.copy_end[current[v]] = len(w.io) - 1
    w.final = current
    return w


def _absence(v: int, freed_at: Mapping[int, int], overwritten_at: Mapping[int, tuple[int, int]]) -> Absence:
    if v in freed_at:
        return Absence(freed=freed_at[v])
    if v in overwritten_at:
        return Absence(overwritten=overwritten_at[v][0], by=overwritten_at[v][1])
    return Absence()


def update_steps(io: Sequence[StepIO | None],
                 updates: Sequence[tuple[Sequence[int], Sequence[int]]]) -> list[int | None]:
    """For each parameter tensor's (gradient values, parameter values) (several of each for a tensor held under
    several names, whose gradients the step sums), the step after which an optimizer inside the step updates
    it: the last compute step that allocates one of the gradients or reads any of these values (so no later
    step reads a parameter already updated, nor a gradient already freed); None when some gradient is never
    computed. `io[i]` is step i's `StepIO` (None for a free), as `Walk.io` holds them."""
    last: dict[int, int] = {}
    computed: set[int] = set()
    for i, spec in enumerate(io):
        if spec is None:
            continue
        for v in (*spec.inputs, *spec.outputs):
            last[v] = i
        computed.update(spec.outputs)
    return [max(last[v] for v in (*grads, *params) if v in last) if computed.issuperset(grads) else None
            for grads, params in updates]


UPDATE_SLICE_BYTES = 2**20
"""The optimizer inside the step updates a parameter of more bytes than this in elementwise slices of at most
this many bytes (`update_slices`), where its update allocates temporaries (AdamW's single-tensor kernels hold 2x
the bytes they update): they then hold 2x a slice, not 2x the parameter. 1 MiB: ResNet-18's 9 MiB layer4 weights
in 9 slices, whose temporaries (2 MiB, not 18 MiB) leave the gradient (9 MiB) most of the update's memory, each
slice's update still long enough that its per-call cost is small beside its kernels' (bench/optimizer_in_step.py)."""

SLICE_ALIGN = 64
"""Slices start at multiples of this many bytes (a cache line; every element size divides it)."""


def update_slices(nbytes: int, slice_bytes: int | None) -> list[tuple[int, int]]:
    """The byte ranges [start, end) in which an update of a parameter of `nbytes` runs: the whole when
    `slice_bytes` is None or `nbytes` at most `slice_bytes`, else consecutive ranges of `slice_bytes` rounded down
    to a multiple of `SLICE_ALIGN` (at least `SLICE_ALIGN`), the last one shorter."""
    if slice_bytes is None or nbytes <= slice_bytes:
        return [(0, nbytes)]
    size = max(SLICE_ALIGN, slice_bytes // SLICE_ALIGN * SLICE_ALIGN)
    return [(start, min(start + size, nbytes)) for start in range(0, nbytes, size)]


@dataclass(frozen=True)
class GradientBucket:
    """Gradients all-reduced together: indices `members` into the gradients of `gradient_buckets`, in the order
    they become final, filling a flat buffer of `nbytes`; launched right after schedule step `step` (its last
    member's final step) and waited for at the end of the step."""

    step: int
    members: tuple[int, ...]
    nbytes: int


def gradient_buckets(io: Sequence[StepIO | None], grads: Sequence[int], nbytes: Sequence[int],
                     cap_bytes: int) -> list[GradientBucket]:
    """DistributedDataParallel's buckets for a schedule: gradient values `grads` (of `nbytes` each) in the order
    they become final (the last compute step allocating each; ties in the order of `grads`), grouped greedily
    into buckets of at most `cap_bytes` (a gradient larger than the cap is a bucket alone). A gradient the
    schedule never computes is left out. `io[i]` is step i's `StepIO` (None for a free), as `Walk.io` holds them."""
    if cap_bytes <= 0:
        raise ValueError(f"the bucket cap must be a positive number of bytes, not {cap_bytes}.")
    final: dict[int, int] = {}
    for i, spec in enumerate(io):
        for v in spec.outputs if spec is not None else ():
            final[v] = i
    order = sorted((final[g], k) for k, g in enumerate(grads) if g in final)
    buckets: list[GradientBucket] = []
    members: list[int] = []
    size = 0
    for position, (step, k) in enumerate(order):
        members.append(k)
        size += int(nbytes[k])
        following = order[position + 1][1] if position + 1 < len(order) else None
        if following is None or size + int(nbytes[following]) > cap_bytes:
            buckets.append(GradientBucket(step, tuple(members), size))
            members, size = [], 0
    return buckets
