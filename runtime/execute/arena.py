"""Arena mode (`runtime.load(..., arena=True)`): value copies live at the plan's addresses in one arena.

Each step allocates one `uint8` arena of `arena_bytes` at its start and keeps it to its end. A compute
step whose allocating (head) op has an ATen `out=` overload with a kernel for the device's backend
(CPU, CUDA) runs through it: a result with an address is written into the view
`arena[off:off + bytes].view(dtype).as_strided(shape, stride)` (layout of the captured result), a result
without one (e.g. a gradient, which outlives the step) into a fresh tensor of
that layout. Copies with an address whose step cannot do that (no out= overload, a result that is not a
tensor, a non-default implementation variant) are allocated as usual: they are the step's fallback
copies, reported in an `ArenaReport` and one `ArenaFallbackWarning` per compile.

An out= overload registered only as CompositeExplicitAutograd (e.g. `convolution.out`, `clone.out`,
`native_layer_norm.out`) is, for most ops, ATen's generated wrapper that computes the functional result
into a temporary and copies it into `out`: placing through it would cost the temporary on top of the
arena slot, which no meter that sees only dispatched ops (the CPU PeakMeter) would notice. Such steps
fall back, so what the report calls placed really is written in place; the factory fills of
`IN_PLACE_COMPOSITES` are the known composites that write in place.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from functools import cache

import torch
from torch import fx

from memplan.runtime.format.graph import OpGraph, backend
from memplan.runtime.tracing.ops import op_of
from memplan.runtime.format.plan import Plan
from memplan.runtime.variants.ops import head_node
from memplan.runtime.variants.offered import DEFAULT, GraphVariants


class ArenaFallbackWarning(UserWarning):
    """Value copies with plan addresses were allocated outside the arena."""


@dataclass
class ArenaReport:
    """What arena mode placed for one compiled batch signature. `arena_bytes` is the extent of the copies
    placed (max offset + bytes); `fallback` lists the copies with an address allocated outside the arena
    as (schedule step, value id, bytes, ATen target of the step, `[impl]` for a variant)."""

    arena_bytes: int = 0
    placed: int = 0
    fallback: list[tuple[int, int, int, str]] = field(default_factory=list)

    @property
    def bytes_not_placed(self) -> int:
        return sum(nbytes for _, _, nbytes, _ in self.fallback)

    def warning(self) -> str:
        counts = Counter(target for *_, target in self.fallback)
        ops = ", ".join(f"{target} ({count})" for target, count in counts.most_common())
        return (f"arena mode: {len(self.fallback)} value copies with plan addresses ({self.bytes_not_placed} bytes) "
                f"are allocated outside the arena, because their step's op has no ATen out= overload that writes "
                f"in place on this device (none, or ATen's generated one that computes into a temporary and "
                f"copies) or runs a non-default implementation: {ops}. Their memory comes on top of the arena's "
                f"{self.arena_bytes} bytes; TrainStep.arena_report lists them.")


@dataclass(frozen=True)
class Placement:
    """How one compute step writes its head op's results: through `out_op`, whose write arguments are
    `out_names` and which lacks the head's keyword arguments `dropped`; per result (in return order) its
    (arena offset, bytes), or None for a fresh tensor."""

    out_op: torch._ops.OpOverload
    out_names: tuple[str, ...]
    dropped: tuple[str, ...]
    slots: tuple[tuple[int, int] | None, ...]


IN_PLACE_COMPOSITES = frozenset({"aten::ones.out", "aten::zeros.out", "aten::full.out"})
"""Composite out= overloads known to write in place (factories: resize the out tensor, then fill it)."""

TENSOR_OPTIONS = ("dtype", "layout", "device", "pin_memory")
"""Keyword arguments of factory ops that an out= overload may lack: the out tensor carries them."""


@cache
def out_overload(op: torch._ops.OpOverload, backend: str = "CPU") -> tuple[torch._ops.OpOverload, tuple[str, ...],
                                                                          tuple[str, ...]] | None:
    """The out= overload of functional `op` that writes in place on `backend` ("CPU", "CUDA"), its write
    arguments' names and the tensor options of `op` it lacks, found by schema: the overload of the same
    packet whose kwarg-only write-alias arguments are as many as `op`'s tensor returns and whose other
    arguments match `op`'s (name, type, kwarg-only), but for tensor options (`TENSOR_OPTIONS`) it may
    lack, and which has a kernel for `backend` (module docstring). None when there is none."""
    schema = op._schema
    if not schema.returns or any(str(r.type) != "Tensor" for r in schema.returns):
        return None
    for name in op._overloadpacket.overloads():
        candidate = getattr(op._overloadpacket, name)
        args = candidate._schema.arguments
        outs = [a for a in args if a.kwarg_only and a.alias_info is not None and a.alias_info.is_write]
        rest = [(a.name, str(a.type), a.kwarg_only) for a in args if a not in outs]
        names = {a.name for a in args}
        dropped = tuple(a.name for a in schema.arguments if a.kwarg_only and a.name in TENSOR_OPTIONS
                        and a.name not in names)
        key = [(a.name, str(a.type), a.kwarg_only) for a in schema.arguments if a.name not in dropped]
        if len(outs) == len(schema.returns) and rest == key:
            if candidate.name() not in IN_PLACE_COMPOSITES and \
                    not torch._C._dispatch_has_kernel_for_dispatch_key(candidate.name(), backend):
                return None
            return candidate, tuple(a.name for a in outs), dropped
    return None


def in_place_nodes(graph: OpGraph, device: str) -> set[int]:
    """Nodes whose default implementation arena mode writes in place on `device`: the allocating op
    (`targets[0]`) has an out= overload with a kernel for the device's backend (`out_overload`) and every
    result is a tensor the graph lists as a value. Planners give addresses to these nodes' copies only;
    any other copy would leave an unused hole in the arena. Works on graphs loaded from JSON."""
    found = set()
    for node in graph.nodes:
        op = op_of(node.targets[0])
        if op is not None and out_overload(op, backend(device)) is not None \
                and len(op._schema.returns) == len(node.outputs):
            found.add(node.id)
    return found


def _results(graph: OpGraph, node: int, head: fx.Node) -> list[int]:
    """Value id of each result of the head op, in return order."""
    program = graph.program
    found: dict[int, int] = {}
    for v in graph.nodes[node].outputs:
        where = program.primary[v]
        if where is head:
            found[0] = v
        elif isinstance(where, tuple):
            found[where[1]] = v
        else:                                              # the getitem of the head's tuple
            found[where.args[1]] = v
    return [found[i] for i in range(len(found))]


def plan_arena(graph: OpGraph, plan: Plan, variants: GraphVariants,
               device: str = "cpu") -> tuple[dict[int, Placement], ArenaReport]:
    """Placement per compute step that writes into the arena on `device`, and the report (module
    docstring)."""
    key = backend(device)
    addresses = plan.addresses or {}
    by_step: dict[int, list[int]] = {}
    for step, value in sorted(addresses):
        by_step.setdefault(step, []).append(value)
    placements: dict[int, Placement] = {}
    report = ArenaReport()
    for i, addressed in by_step.items():
        n, impl = plan.schedule[i]["compute"], plan.schedule[i].get("impl", DEFAULT)
        head = head_node(graph, n)
        val = head.meta["val"]
        results = val if isinstance(val, (tuple, list)) else (val,)
        found = out_overload(head.target, key) if impl == DEFAULT else None
        if found is None or not all(isinstance(t, torch.Tensor) for t in results):
            target = str(head.target) if impl == DEFAULT else f"{head.target}[{impl}]"
            report.fallback += [(i, v, variants.value(graph, v).bytes, target) for v in addressed]
            continue
        slots = tuple((addresses[i, v], graph.values[v].bytes) if (i, v) in addresses else None
                      for v in _results(graph, n, head))
        placements[i] = Placement(*found, slots)
        report.placed += len(addressed)
        report.arena_bytes = max([report.arena_bytes] + [off + nbytes for off, nbytes in filter(None, slots)])
    return placements, report


def new_arena(nbytes: int, device: str) -> torch.Tensor:
    return torch.empty(nbytes, dtype=torch.uint8, device=device)


def arena_view(arena: torch.Tensor, offset: int, nbytes: int, dtype: torch.dtype, shape: tuple, stride: tuple,
               storage_offset: int) -> torch.Tensor:
    """The tensor of layout (shape, stride, storage_offset) at byte `offset` of the arena."""
    base = arena[offset:offset + nbytes].view(dtype)
    return base.as_strided(shape, stride, base.storage_offset() + storage_offset)


def fresh_result(dtype: torch.dtype, shape: tuple, stride: tuple, device: str) -> torch.Tensor:
    return torch.empty_strided(shape, stride, dtype=dtype, device=device)


def keep_alive(arena: torch.Tensor) -> None:
    """Read the arena at the end of the step, so it lives for the whole step (as the simulator counts)."""


def emit_out_call(g: fx.Graph, head: fx.Node, resolve, placement: Placement, arena: fx.Node, device: str) -> fx.Node:
    """Emit the head op of a placed step as its out= overload writing into arena views / fresh tensors."""
    val = head.meta["val"]
    outs = []
    for t, slot in zip(val if isinstance(val, (tuple, list)) else (val,), placement.slots):
        shape, stride = tuple(int(s) for s in t.shape), tuple(int(s) for s in t.stride())
        if slot is None:
            outs.append(g.call_function(fresh_result, (t.dtype, shape, stride, device)))
        else:
            outs.append(g.call_function(arena_view, (arena, *slot, t.dtype, shape, stride, int(t.storage_offset()))))
    args = fx.map_arg(head.args, resolve)
    kwargs = {k: v for k, v in fx.map_arg(head.kwargs, resolve).items() if k not in placement.dropped}
    return g.call_function(placement.out_op, args, {**kwargs, **dict(zip(placement.out_names, outs))})
