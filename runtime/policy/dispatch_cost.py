"""What selective activation checkpointing's dispatch adds to each op of a region, measured on a device.

`torch.utils.checkpoint(..., context_fn=create_selective_checkpoint_contexts(policy))` runs a region's forward
under a Python `TorchDispatchMode` that asks the policy about every ATen call (views included) and keeps the
outputs it saves, and the region's recomputation under another that hands them back. Plain
`torch.utils.checkpoint` pays neither, and a per-op profile sees neither. It is a cost per call on the host,
larger in a real step than on a warm microbenchmark (the model's tensors evict the interpreter's caches
between calls: a Llama layer measured 3.5 ms in its step, 4x what 91 tiny ops predict), so it is measured on
the graph's own first region, replayed as the profile runs nodes. The policy form prices it
(`runtime.policy.form.dispatch_cost`) per forward node of each region run with a policy.
"""

from __future__ import annotations

import statistics
import time
from typing import Callable, Sequence

import torch
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from memplan.runtime.format.graph import OpGraph
from memplan.runtime.policy.form import Regions

REPEATS = 9
"""Interleaved replays of the region per mode; the first of each is a warm-up."""


def _recompute_all(ctx, func, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.PREFER_RECOMPUTE


def policy_dispatch_ms(graph: OpGraph, device: torch.device, inputs: dict[int, torch.Tensor],
                       functions: Sequence[Callable], repeats: int = REPEATS) -> tuple[float, float] | None:
    """(forward, recomputation) milliseconds selective checkpointing's dispatch modes add per forward node of a
    region on `device` (each at least 0): the first recorded region's forward nodes (`Regions.of_graph`)
    replayed from `inputs` (the graph's inputs, by value id) by `functions` (per node id, its callable, as the
    profile runs it), with no mode, under the forward's caching mode and under the recomputation's cached mode,
    medians of `repeats` interleaved replays each. None when the graph records no region."""
    regions = Regions.of_graph(graph)
    if not regions.members:
        return None
    nodes = next(iter(regions.members.values()))
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    live = dict(inputs)
    with torch.no_grad():
        for node in graph.nodes[:nodes[-1] + 1]:
            if node.phase != "backward":
                live.update(zip(node.outputs, functions[node.id](*(live[v] for v in node.inputs))))
        region = [(functions[n], graph.nodes[n].inputs, graph.nodes[n].outputs) for n in nodes]

        def replay() -> float:
            env = dict(live)
            sync()
            start = time.perf_counter()
            for fn, reads, writes in region:
                env.update(zip(writes, fn(*(env[v] for v in reads))))
            sync()
            return time.perf_counter() - start

        times: dict[str, list[float]] = {"plain": [], "forward": [], "recompute": []}
        for round_ in range(repeats + 1):
            forward, recompute = create_selective_checkpoint_contexts(_recompute_all)
            measured = {"plain": replay()}
            with forward:
                measured["forward"] = replay()
            with recompute:                      # hands back what the forward mode stored (nothing: all recomputed)
                measured["recompute"] = replay()
            for mode, seconds in measured.items():
                times[mode] += [seconds] if round_ else []
    base = statistics.median(times["plain"])
    return tuple(max(statistics.median(times[mode]) - base, 0.0) * 1e3 / len(nodes) for mode in ("forward", "recompute"))
