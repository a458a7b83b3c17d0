"""Check capture's rewrites on the device that runs them: which instances of a pass compute, on one step's
real values, bit for bit what the ops they replace compute (a pass of `WITHIN_TOLERANCE`: within its tolerance).

`exact_instances` applies a pass to a copy of the joint graph with every default instance (recording each
instance's region: runtime/tracing/rewrites.py), runs the graph before the pass once on the step's real inputs
(the model's parameters and buffers and the batch), keeping only the values the regions read and replace
and the generator state before each random op they replace, then runs each region alone on those values
(from that generator state) and compares its results with the replaced values (`instance_exact`). One
step per pass that has instances (a pass without default instances costs a dry run of its matching), plus the regions' own ops.
"""

from __future__ import annotations

import operator
from typing import Callable, Sequence

import torch
from torch import fx

from memplan.runtime.tracing.rewrites import WITHIN_TOLERANCE, Instance, Rewriter

_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def bit_identical(a: object, b: object) -> bool:
    """Whether two results are the same bits: tensors of one dtype and shape whose elements have equal bit
    patterns (every NaN counts as the same NaN; 0.0 and -0.0 differ); None matches None."""
    if not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor):
        return a is None and b is None
    if a.dtype != b.dtype or a.shape != b.shape or a.device != b.device:
        return False
    if a.is_floating_point():
        a, b = (torch.where(t.isnan(), torch.full((), float("nan"), dtype=t.dtype, device=t.device), t) for t in (a, b))
    bits = _BITS.get(a.element_size()) if not a.is_complex() else None
    if bits is None:
        return torch.equal(a, b)
    return torch.equal(a.contiguous().view(bits), b.contiguous().view(bits))


def within(a: object, b: object, rtol: float, atol: float) -> bool:
    """Whether two results are tensors of one dtype and shape within `rtol` / `atol` (NaNs where each has them)."""
    if not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor):
        return a is None and b is None
    return (a.dtype == b.dtype and a.shape == b.shape and a.device == b.device
            and torch.allclose(a, b, rtol=rtol, atol=atol, equal_nan=True))


def instance_exact(name: str, index: int, replaced: Sequence[object], results: Sequence[object]) -> bool:
    """Whether instance `index` of pass `name` is exact: each of its results is bit-identical to the value
    it replaces, or for a pass of `WITHIN_TOLERANCE` (another summation order by design) within its tolerance."""
    tolerance = WITHIN_TOLERANCE.get(name)
    same = bit_identical if tolerance is None else lambda a, b: within(a, b, *tolerance)
    return len(replaced) == len(results) and all(same(a, b) for a, b in zip(replaced, results))


def exact_instances(gm: fx.GraphModule, name: str, rewrite: Callable[[fx.Graph, Rewriter, bool], None],
                    on_cpu: bool, inputs: Sequence[torch.Tensor]) -> tuple[list[int], list[int]]:
    """(exact, inexact): the indices of the instances `rewrite` (pass `name`) applies by default to `gm`'s
    graph, split by whether each is bit-identical on `inputs` (the graph's placeholders, in order) on this
    device and thread count. `gm` is left as it is."""
    count = Rewriter(gm.graph, ())                         # selects nothing: counts without rewriting
    rewrite(gm.graph, count, on_cpu)
    if not count.defaults:
        return [], []
    probe = fx.Graph()
    copies: dict[fx.Node, fx.Node] = {}
    probe.output(probe.graph_copy(gm.graph, copies))
    live = {copy: node for node, copy in copies.items()}
    rw = Rewriter(probe, None, record=True)
    rewrite(probe, rw, on_cpu)
    if not rw.instances:
        return [], []
    stands_for = {new: old for inst in rw.instances for old, new in inst.outputs if isinstance(new, fx.Node)}
    regions = [_region(inst, stands_for, live) for inst in rw.instances]
    keep = {live[n] for _, reads in regions for n in reads} | {live[old] for i in rw.instances for old, _ in i.outputs}
    random = {live[i.random] for i in rw.instances if i.random is not None}
    with torch.random.fork_rng(devices=_cuda_devices(inputs)), torch.no_grad():
        torch.manual_seed(0)
        kept, states = _Keeper(gm, keep, random).values(inputs)
        exact, inexact = [], []
        for inst, (module, reads) in zip(rw.instances, regions):
            if inst.random is not None:
                torch.set_rng_state(states[live[inst.random]])
            results = module(*(kept[live[n]] for n in reads))
            replaced = [kept[live[old]] for old, _ in inst.outputs]
            (exact if instance_exact(name, inst.index, replaced, results) else inexact).append(inst.index)
    return exact, inexact


def _region(inst: Instance, stands_for: dict[fx.Node, fx.Node],
            live: dict[fx.Node, fx.Node]) -> tuple[fx.GraphModule, list[fx.Node]]:
    """The instance's inserted nodes as a module `f(*reads) -> results` (one per replaced value), and the
    probe nodes of the graph before the pass whose values `reads` are (another instance's replacement
    stands for the value it replaced)."""
    new = set(inst.new)
    reads: dict[fx.Node, fx.Node] = {}                     # read node -> node of the graph before the pass
    for m in inst.new:
        for a in m.all_input_nodes:
            if a not in new:
                source = stands_for.get(a, a)
                if source not in live:
                    raise RuntimeError(f"rewrite region of {m.name} reads {a.name}, an intermediate of another "
                                       f"instance of the same pass; its value cannot be checked alone.")
                reads.setdefault(a, source)
    g = fx.Graph()
    env = {a: g.placeholder(f"read{i}") for i, a in enumerate(reads)}
    for m in inst.new:
        env[m] = g.node_copy(m, env.__getitem__)
    g.output(tuple(env[r] if isinstance(r, fx.Node) else g.call_function(operator.getitem, (env[r[0]], r[1]))
                   for _, r in inst.outputs))
    return fx.GraphModule(torch.nn.Module(), g), list(reads.values())


class _Keeper(fx.Interpreter):
    """Runs a graph once, keeping the values of the nodes `keep` and the CPU generator state before each
    node of `random`."""

    def __init__(self, gm: fx.GraphModule, keep: set[fx.Node], random: set[fx.Node]):
        super().__init__(gm)
        self.keep, self.random = keep, random
        self.kept: dict[fx.Node, object] = {}
        self.states: dict[fx.Node, torch.Tensor] = {}

    def run_node(self, n: fx.Node) -> object:
        if n in self.random:
            self.states[n] = torch.get_rng_state()
        result = super().run_node(n)
        if n in self.keep:
            self.kept[n] = result
        return result

    def values(self, inputs: Sequence[torch.Tensor]) -> tuple[dict, dict]:
        self.run(*inputs)
        return self.kept, self.states


def _cuda_devices(tensors: Sequence[torch.Tensor]) -> list[int]:
    return sorted({t.device.index or 0 for t in tensors if t.device.type == "cuda"})
