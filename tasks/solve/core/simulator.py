"""The schedule simulator: the single definition of memory (docs/plan-format.md, docs/architecture.md).

A schedule is a list of steps, `("compute", node)` / `("free", value)` tuples or the plan's JSON dicts
(`{"compute": N, "impl": ...}` / `{"free": X}`). Semantics:
- graph inputs are always resident and reported as `constant_bytes`, never in the peak;
- a compute allocates fresh copies of the node's outputs; later reads see the newest copy;
- a copy is live from the step computing it through the step holding its last read before the value
  is computed again (a copy never read lives during its own step only); an explicit free can only
  come after that last read, so it releases nothing earlier; a compute step's `holds` count as reads
  (values something outside the graph keeps live, a checkpoint's frame: runtime/policy/form.py);
- the final copy of a graph output stays live to the end;
- live memory during a compute step = live copies + the node's workspace; the peak is its maximum;
- a compute step runs the implementation variant its `impl` names (default: the node as listed): the
  variant's inputs, outputs, workspace and cost are charged;
- an in-place variant (`Variant.overwrites`, pairs (output, input)) writes each such output into its
  input's storage: the input's copy ends with the step before, the output's copy takes its bytes from the
  step on, so during the step only one of the two counts. The input value is then gone (as if freed): the
  schedule is invalid (InvalidSchedule) if a later step reads it or frees it before it is computed again;
  the problem refuses an overwritten input that is a graph input or a graph output;
- with the optimizer inside the step (`Problem.updates`, `tasks.solve.core.optimizer`), each updated
  gradient's last copy lives through its update step u (`runtime.format.schedule.update_steps`: the last step that
  computes it or reads it or its parameter); the updates run after u's node, when its scratch and the copies
  ending with u are gone, as one optimizer step over them (in `Problem.updates` order): live then = the
  copies live into step u + 1 + the gradients updated after u + their scratch: one parameter after another,
  the largest of each update's workspace plus what the update before it still holds (`ParamUpdate.carried`),
  and of each parameter updated in slices, a call per slice (`sliced_workspace`: its largest slice's, none after);
  with `Problem.foreach_updates`, all their workspaces at once (parameters of several param groups take one
  step per group, which holds no more); step u counts the larger of that and its node's live bytes; a
  gradient never computed is an InvalidSchedule;
- under DistributedDataParallel (`Problem.gradient_sync`, `tasks.solve.core.ddp`), each bucket's flat buffer
  (`runtime.format.schedule.gradient_buckets`) is allocated after its launch step's node, when its scratch and the
  copies ending with that step are gone, and lives to the end of the step: step u launching buckets counts
  the larger of its node's live bytes (+ the buffers launched before) and the copies live into step u + 1 + the
  buffers launched up to u; later steps count every buffer launched before them;
- with addresses (copy (step, value) -> byte offset), `arena_bytes` is the extent they span and
  `arena_peak_bytes` = arena_bytes + max over compute steps of (unplaced live copies + workspace): the
  arena is one allocation for the whole step, copies without an address are allocated as usual.
  `check_addresses` refuses two copies live at the same step whose byte ranges overlap.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Iterable, Mapping, NamedTuple, Sequence

import numpy as np

from memplan.runtime.format.plan import PlanError, normalize_step
from memplan.runtime.format.schedule import Absence, Walk, gradient_buckets, update_steps, walk
from memplan.runtime.variants.offered import DEFAULT
from memplan.tasks.solve.core.problem import GradientSync, Problem


class InvalidSchedule(ValueError):
    """A schedule that cannot run: unknown node or value, an input not resident, a graph output
    missing at the end."""


class AddressConflict(InvalidSchedule):
    """Two value copies live at the same step whose addresses overlap, or an address that names no copy."""


@dataclass(frozen=True)
class Simulation:
    """`timeline[i]`: live bytes during step i (a compute step includes the node's workspace, or the optimizer
    updates after it where those hold more; a free step shows what stays live after it). `peak_step` is the
    first compute step reaching the peak.
    Copy c of value `copy_value[c]` is live during steps `copy_start[c]..copy_end[c]` (`copy_start` is
    the step computing it, so (copy_start[c], copy_value[c]) is the copy's key in plan addresses).
    `arena_bytes` / `arena_peak_bytes` are set when the schedule was simulated with addresses;
    `shares_storage` marks the copies of in-place steps (`in_place`)."""

    peak_bytes: int
    peak_step: int
    compute_cost: float
    constant_bytes: int
    num_computes: int
    timeline: np.ndarray
    copy_value: np.ndarray
    copy_start: np.ndarray
    copy_end: np.ndarray
    copy_bytes: np.ndarray
    workspace: np.ndarray
    is_compute: np.ndarray
    arena_bytes: int | None = None
    arena_peak_bytes: int | None = None
    shares_storage: np.ndarray | None = None

    @property
    def in_place(self) -> np.ndarray:
        """Copies that share storage through an in-place step: each overwritten input copy and the output
        copy written into it (no address may place them: the output outlives the input's slot)."""
        return np.zeros(len(self.copy_value), dtype=bool) if self.shares_storage is None else self.shares_storage

    def live_values(self, step: int) -> np.ndarray:
        """Values with a copy live during `step`."""
        live = (self.copy_start <= step) & (self.copy_end >= step)
        return np.unique(self.copy_value[live])

    def copy_index(self) -> dict[tuple[int, int], int]:
        """(step computing it, value) -> copy index."""
        return {(int(s), int(v)): c for c, (s, v) in enumerate(zip(self.copy_start, self.copy_value))}

    def live_timeline(self, copies: np.ndarray) -> np.ndarray:
        """Bytes of the copies selected by the boolean mask `copies` live during each step."""
        return _live_bytes(self.copy_start[copies], self.copy_end[copies], self.copy_bytes[copies],
                           len(self.timeline))

    def outlives_step(self, problem: Problem) -> np.ndarray:
        """Copies that outlive the step: the final copies of graph outputs (no arena address for them)."""
        return (self.copy_end == len(self.timeline) - 1) & problem.is_output[self.copy_value]


def _live_bytes(starts: np.ndarray, ends: np.ndarray, nbytes: np.ndarray, steps: int) -> np.ndarray:
    """Per step, the bytes of the copies live then (copy c from step starts[c] through ends[c])."""
    delta = np.zeros(steps + 1, dtype=np.int64)
    np.add.at(delta, starts, nbytes)
    np.add.at(delta, ends + 1, -nbytes)
    return np.cumsum(delta[:-1])


def normalize_schedule(schedule: Iterable[Any]) -> list[dict[str, Any]]:
    """The schedule as plan step dicts; raises InvalidSchedule naming the first malformed step."""
    try:
        return [normalize_step(step, f"schedule[{i}]") for i, step in enumerate(schedule)]
    except PlanError as exc:
        raise InvalidSchedule(str(exc)) from None


def simulate(problem: Problem, schedule: Iterable[Any],
             addresses: Mapping[tuple[int, int], int] | None = None) -> Simulation:
    """Peak, memory timeline and compute cost of `schedule` on `problem`, and with `addresses` the arena
    they need (module docstring); addresses are checked by `check_addresses`."""
    steps = normalize_schedule(schedule)
    w = walk(steps, problem.num_nodes, problem.num_values, lambda v: problem.value_producer[v] < 0,
             lambda i, node, impl: _step_io(problem, i, node, impl), problem.outputs, _Complaints(problem))
    is_compute = np.array([io is not None for io in w.io], dtype=bool)
    workspace = np.array([0 if io is None else io.workspace for io in w.io], dtype=np.int64)
    cost = sum(float(io.cost) for io in w.io if io is not None)
    values = np.asarray(w.copy_value, dtype=np.int64)
    starts = np.asarray(w.copy_start, dtype=np.int64)
    ends = np.asarray(w.copy_end, dtype=np.int64)
    updating = _in_step_updates(problem, w, ends) if problem.updates else None
    nbytes = problem.value_bytes[values]
    timeline = _live_bytes(starts, ends, nbytes, len(steps)) + workspace
    outlive = np.zeros(len(values), dtype=np.int64)       # final output copies outlive the last step
    outlive[[w.final[v] for v in problem.outputs]] = 1
    if updating is not None:                   # the updates after step u: what lives on, their gradients, scratch
        scratch, grads = updating
        during = _live_bytes(starts, ends - 1 + outlive, nbytes, len(steps)) + grads + scratch
        timeline = np.where(grads > 0, np.maximum(timeline, during), timeline)
    buffers = np.zeros(len(steps), dtype=np.int64)
    if problem.gradient_sync is not None:
        launched = _bucket_launches(problem, problem.gradient_sync, w)
        buffers = np.cumsum(launched)
        after = _live_bytes(starts, ends - 1 + outlive, nbytes, len(steps)) + buffers
        timeline = timeline + buffers - launched
        timeline = np.where(launched > 0, np.maximum(timeline, after), timeline)
    compute_live = np.where(is_compute, timeline, -1)
    peak_step = int(np.argmax(compute_live)) if is_compute.any() else -1
    sim = Simulation(
        peak_bytes=int(compute_live[peak_step]) if peak_step >= 0 else 0,
        peak_step=peak_step,
        compute_cost=cost,
        constant_bytes=problem.constant_bytes,
        num_computes=int(is_compute.sum()),
        timeline=timeline,
        copy_value=values,
        copy_start=starts,
        copy_end=ends,
        copy_bytes=nbytes,
        workspace=workspace,
        is_compute=is_compute,
        shares_storage=np.isin(np.arange(len(values)), w.shared) if w.shared else None,
    )
    if addresses is None:
        return sim
    placed, offsets = check_addresses(problem, sim, addresses)
    arena = int((offsets[placed] + nbytes[placed]).max(initial=0))
    unplaced = np.where(is_compute, sim.live_timeline(~placed) + workspace + buffers, 0)
    return replace(sim, arena_bytes=arena, arena_peak_bytes=arena + int(unplaced.max(initial=0)))


def _in_step_updates(problem: Problem, w: Walk, ends: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Extend each updated gradient's last copy through its update step (in `ends`). Per step, the update
    scratch (module docstring) and the bytes of the gradients updated after it."""
    scratch, grads = np.zeros(len(w.io), dtype=np.int64), np.zeros(len(w.io), dtype=np.int64)
    carried = np.zeros(len(w.io), dtype=np.int64)         # what the previous update after the step still holds
    last_copy = {v: k for k, v in enumerate(w.copy_value)}
    for u, step in zip(problem.updates, update_steps(w.io, [(u.grads, u.params) for u in problem.updates])):
        if step is None:
            missing = next(g for g in u.grads if g not in last_copy)
            raise InvalidSchedule(f"the schedule never computes value {missing}, a gradient of parameter value "
                                  f"{u.params[0]}; with the optimizer inside the step every parameter it updates "
                                  f"needs its gradient computed.")
        for g in u.grads:
            ends[last_copy[g]] = max(ends[last_copy[g]], step)
        if problem.foreach_updates:
            scratch[step] += u.workspace
        else:
            scratch[step] = max(scratch[step], carried[step] + u.workspace, u.sliced_workspace)
            carried[step] = u.carried
        grads[step] += int(problem.value_bytes[list(u.grads)].sum())
    return scratch, grads


def _bucket_launches(problem: Problem, sync: GradientSync, w: Walk) -> np.ndarray:
    """Per step, the bytes of the DDP bucket buffers launched right after it (`sync`: the problem's)."""
    launched = np.zeros(len(w.io), dtype=np.int64)
    sizes = problem.value_bytes[list(sync.grads)].tolist()
    for bucket in gradient_buckets(w.io, sync.grads, sizes, sync.cap_bytes):
        launched[bucket.step] += bucket.nbytes
    return launched


def check_addresses(problem: Problem, sim: Simulation,
                    addresses: Mapping[tuple[int, int], int]) -> tuple[np.ndarray, np.ndarray]:
    """Refuse (AddressConflict) an address that names no copy of the schedule, one for the final copy of a
    graph output (it outlives the step, so it cannot live in the step's arena), one for a copy of an
    in-place step (`Simulation.in_place`), or two copies live at a
    common step whose byte ranges [offset, offset + bytes) overlap. Returns (placed mask, offset per copy)."""
    index = sim.copy_index()
    placed = np.zeros(len(sim.copy_value), dtype=bool)
    offsets = np.zeros(len(sim.copy_value), dtype=np.int64)
    outlives, in_place = sim.outlives_step(problem), sim.in_place
    for (step, value), offset in addresses.items():
        c = index.get((int(step), int(value)))
        if c is None:
            raise AddressConflict(f"address for value {value} at schedule[{step}]: that step does not allocate "
                                  f"the value, so there is no such copy.")
        if outlives[c]:
            raise AddressConflict(f"address for value {value} at schedule[{step}]: it is the final copy of a "
                                  f"graph output, which outlives the step and cannot live in its arena.")
        if in_place[c]:
            raise AddressConflict(f"address for value {value} at schedule[{step}]: that copy is overwritten in "
                                  f"place by a later step, or written in place into another copy; in-place copies "
                                  f"live outside the arena, so drop the address (or run that step out of place).")
        placed[c], offsets[c] = True, int(offset)
    ids = np.flatnonzero(placed & (sim.copy_bytes > 0))
    start, end = sim.copy_start[ids], sim.copy_end[ids]
    lo, hi = offsets[ids], offsets[ids] + sim.copy_bytes[ids]
    for k in range(len(ids)):
        clash = (start[k + 1:] <= end[k]) & (end[k + 1:] >= start[k]) & (lo[k + 1:] < hi[k]) & (hi[k + 1:] > lo[k])
        if clash.any():
            j = k + 1 + int(np.argmax(clash))
            a, b = ids[k], ids[j]
            raise AddressConflict(
                f"value {sim.copy_value[a]} (computed at schedule[{sim.copy_start[a]}], bytes {lo[k]}..{hi[k]}) and "
                f"value {sim.copy_value[b]} (computed at schedule[{sim.copy_start[b]}], bytes {lo[j]}..{hi[j]}) "
                f"are live together from schedule[{max(start[k], start[j])}] but their addresses overlap.")
    return placed, offsets


class _StepIO(NamedTuple):
    inputs: Sequence[int]
    outputs: Sequence[int]
    overwrites: Sequence[tuple[int, int]]
    workspace: int
    cost: float


def _step_io(problem: Problem, i: int, node: int, impl: str | None) -> Any:
    """What compute step `i` reads, allocates and overwrites, with its workspace and cost."""
    if impl is None or impl == DEFAULT:
        return _StepIO(problem.node_inputs[node], problem.node_outputs[node], (), problem.workspace[node],
                       problem.cost[node])
    try:
        return problem.variant(node, impl)
    except KeyError as exc:
        raise InvalidSchedule(f"schedule[{i}]: {exc.args[0]}") from None


class _Complaints:
    """The simulator's wording of an invalid schedule (`runtime.format.schedule.Complaints`)."""

    def __init__(self, problem: Problem):
        self.problem = problem

    def error(self, message: str) -> InvalidSchedule:
        return InvalidSchedule(message)

    def absent_input(self, step: int, node: int, value: int, why: Absence) -> InvalidSchedule:
        return InvalidSchedule(f"schedule[{step}] computes {self.problem.node_label(node)}, which reads "
                               f"value {value}, but {_why_absent(self.problem, value, why)}.")

    def free_input(self, step: int, value: int) -> InvalidSchedule:
        return InvalidSchedule(f"schedule[{step}] frees value {value}, a graph input; graph inputs are always "
                               f"resident.")

    def free_absent(self, step: int, value: int, why: Absence) -> InvalidSchedule:
        detail = f": {_why_absent(self.problem, value, why)}" if why.overwritten is not None else ""
        return InvalidSchedule(f"schedule[{step}] frees value {value}, which is not resident{detail}.")

    def missing_outputs(self, missing: list[int]) -> InvalidSchedule:
        return InvalidSchedule(f"graph outputs {missing[:10]} are not resident at the end of the schedule "
                               f"({len(missing)} missing); compute each and do not free it afterwards.")


def _why_absent(problem: Problem, v: int, why: Absence) -> str:
    """Why value `v` has no resident copy: freed, overwritten in place, or never computed."""
    if why.freed is not None:
        return f"it was freed at schedule[{why.freed}]"
    if why.overwritten is not None and why.by is not None:     # set together (runtime.format.schedule.walk)
        return (f"schedule[{why.overwritten}] ran {problem.node_label(why.by)} in place, overwriting it; compute "
                f"value {v} again before this step or run that step without overwriting it")
    return (f"its producer {problem.node_label(int(problem.value_producer[v]))} has not been computed "
            f"by a variant that allocates it ({', '.join(_allocating(problem, v))})")


def _allocating(problem: Problem, value: int) -> list[str]:
    node = int(problem.value_producer[value])
    return [impl for impl in problem.impls(node) if value in problem.variant(node, impl).outputs]


def default_schedule(problem: Problem) -> list[tuple[str, int]]:
    """Every node once, in the default order (no recomputation)."""
    return [("compute", int(node)) for node in problem.order]
