"""Implementation variants and arena mode, measured side by side in one run per model.

    .venv/bin/python bench/variants_arena.py [--models resnet18 mobilenet_v2 gpt2] [--batch 8] [--size 64]

For each model (random weights), one training step measured on CPU with `runtime.measure.meter.PeakMeter`
(tensor bytes allocated during the step) and wall-clock time (median of interleaved rounds):
- eager PyTorch; the default plan (eager order); the `mask` plan (every ReLU / ReLU6 whose backward
  then reads a 1-byte mask); each plan's simulated peak next to the measured one;
- arena mode of the default plan with greedy addresses (largest first, best gap) for the copies of
  the ops the CPU writes in place (`runtime.execute.arena.in_place_nodes`): the arena's size against the most
  bytes its copies hold live at once (fragmentation), the bytes left outside the arena, the measured
  arena-mode peak against the simulated one.
Gradients of every plan are compared with eager (max |diff|).
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
import warnings

import numpy as np
import torch
import torch.nn.functional as F
from rich.console import Console
from rich.table import Table

from memplan import runtime
from memplan.runtime.execute.arena import in_place_nodes
from memplan.runtime.measure.meter import PeakMeter
from memplan.runtime.variants.offered import graph_variants
from memplan.tasks.solve.core.addresses import greedy_addresses
from memplan.tasks.solve.core.problem import Problem
from memplan.tasks.solve.core.simulator import simulate


def build(name: str, batch: int, size: int):
    torch.manual_seed(0)
    if name == "gpt2":
        import transformers

        config = transformers.GPT2Config(n_layer=4, n_embd=256, n_head=4, n_positions=256, vocab_size=2048,
                                         bos_token_id=0, eos_token_id=0,
                                         resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        model = transformers.GPT2LMHeadModel(config)
        ids = torch.randint(0, 2048, (batch, 256))
        return model, (lambda m, x: m(input_ids=x, labels=x).loss), (ids,)
    import torchvision

    model = getattr(torchvision.models, name)(num_classes=10)
    return model, (lambda m, x, y: F.cross_entropy(m(x), y)), (torch.randn(batch, 3, size, size),
                                                                 torch.randint(0, 10, (batch,)))


def measure(model, loss_fn, batch, step=None):
    """(peak bytes, gradients) of one step: eager when `step` is None (dropout seeded alike)."""
    model.zero_grad(set_to_none=True)
    torch.manual_seed(1)
    with PeakMeter("cpu") as meter:
        if step is None:
            loss_fn(model, *batch).backward()
        else:
            step(*batch)
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    return meter.peak_bytes, grads


def median_ms(runs, rounds: int) -> list[float]:
    times = [[] for _ in runs]
    for _ in range(rounds):
        for fn, out in zip(runs, times):
            start = time.perf_counter()
            fn()
            out.append((time.perf_counter() - start) * 1e3)
    return [statistics.median(t) for t in times]


def bench(name: str, batch: int, size: int, rounds: int) -> list[tuple]:
    model, loss_fn, data = build(name, batch, size)
    graph = runtime.capture(model, loss_fn, data)
    variants = graph_variants(graph)
    problem = Problem.from_graph(graph, None, variants)
    default = runtime.default_plan(graph)
    masked = runtime.Plan(graph.fingerprint, [{"compute": n, "impl": "mask"} if "mask" in variants.names(n)
                                              else {"compute": n} for n in default.compute_steps()])
    sim_default, sim_mask = simulate(problem, default.schedule), simulate(problem, masked.schedule)
    in_place = in_place_nodes(graph, "cpu")
    addresses = greedy_addresses(problem, sim_default, np.array([n in in_place for n in default.compute_steps()]))
    arena_plan = runtime.Plan(graph.fingerprint, default.schedule, addresses)

    models = {k: copy.deepcopy(model) for k in ("default", "mask", "arena")}
    steps = {"default": runtime.load(default, models["default"], loss_fn, graph=graph),
             "mask": runtime.load(masked, models["mask"], loss_fn, graph=graph),
             "arena": runtime.load(arena_plan, models["arena"], loss_fn, graph=graph, arena=True)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        steps["arena"].compile(*data)
    report, = steps["arena"].arena_report.values()
    fallback = {(s, v) for s, v, *_ in report.fallback}
    sim_arena = simulate(problem, default.schedule, {c: o for c, o in addresses.items() if c not in fallback})

    eager_peak, eager_grads = measure(model, loss_fn, data)
    measured = {k: measure(models[k], loss_fn, data, steps[k]) for k in steps}
    err = {k: max(float((a - b).abs().max()) for a, b in zip(eager_grads, g)) for k, (_, g) in measured.items()}
    ms = median_ms([lambda: measure(model, loss_fn, data)] +
                   [lambda k=k: measure(models[k], loss_fn, data, steps[k]) for k in steps], rounds)

    live_placed = int(sim_arena.live_timeline(_placed_mask(sim_arena, addresses, fallback)).max(initial=0))
    mib = 2 ** 20
    rows = [
        (name, "eager", eager_peak / mib, None, 1.0, ms[0], 0.0, ""),
        (name, "default plan", measured["default"][0] / mib, sim_default.peak_bytes / mib,
         measured["default"][0] / eager_peak, ms[1], err["default"], ""),
        (name, "mask variants", measured["mask"][0] / mib, sim_mask.peak_bytes / mib,
         measured["mask"][0] / eager_peak, ms[2], err["mask"],
         f"{sum(1 for s in masked.schedule if 'impl' in s)} steps use mask"),
        (name, "arena mode", measured["arena"][0] / mib, sim_arena.arena_peak_bytes / mib,
         measured["arena"][0] / eager_peak, ms[3], err["arena"],
         f"arena {report.arena_bytes / mib:.2f} MiB = {report.arena_bytes / max(live_placed, 1):.3f}x its live peak; "
         f"{report.bytes_not_placed / mib:.2f} MiB not placed ({len(report.fallback)} copies)"),
    ]
    return rows


def _placed_mask(sim, addresses, fallback) -> np.ndarray:
    """Copies placed in the arena (an address, and not a fallback)."""
    index = sim.copy_index()
    mask = np.zeros(len(sim.copy_value), dtype=bool)
    mask[[index[c] for c in addresses if c not in fallback]] = True
    return mask


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=["resnet18", "mobilenet_v2", "gpt2"])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--size", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    table = Table("model", "run", "measured peak MiB", "simulated MiB", "peak / eager", "step ms", "max |grad diff|",
                  "notes", title=f"variants and arena mode (CPU, batch {args.batch}, {args.size}px / seq 256)")
    for name in args.models:
        for model, run, peak, sim, ratio, ms, err, note in bench(name, args.batch, args.size, args.rounds):
            table.add_row(model, run, f"{peak:.2f}", "" if sim is None else f"{sim:.2f}", f"{ratio:.3f}",
                          f"{ms:.1f}", f"{err:.2g}", note)
    Console(width=220).print(table)


if __name__ == "__main__":
    main()
