"""OLLA (Steiner et al. 2022) against PyTorch's order and allocator, measured side by side in one run.

    .venv/bin/python bench/olla.py [--models resnet18 mobilenet_v2 gpt2] [--batches 1 32] [--size 64]
                                   [--time-limit 60]

For each model (random weights, CPU, 1 thread) and batch size, one training step:
- peak with PyTorch's order (the captured graph's order, run as the default plan) and with OLLA's
  order: simulated, and measured running each plan (`runtime.measure.meter.PeakMeter`, tensor bytes); the
  whole-graph ILP's lower bound on the optimal peak, when it got one; and the OLLA plan's measured peak
  against eager PyTorch's. Paper (sec. 5.3): 22.5% less at batch 1, 10.1% at batch 32 on average. The
  step has no optimizer, so gradients stay resident to its end (the paper's weight updates free
  them early).
- fragmentation of OLLA's addresses: arena bytes against the most bytes the placed copies hold live
  at once, (arena - live) / arena, for every copy of the step ("all") and for the copies of ops the
  CPU writes in place (what arena mode places here). Paper (sec. 5.4): 0%.
- solve seconds of the lifetime ILP (with its window search) and of the location ILP ("all"), against
  the paper's 5-minute cap; the lifetime ILP's status and where its order came from.
- on CUDA only (a column printed when a GPU is present): the caching allocator's peak reserved bytes
  for eager PyTorch and for the OLLA plan in arena mode.
Gradients of the OLLA plan are compared with eager (max |diff|).
"""

from __future__ import annotations

import argparse
import copy
import warnings

import numpy as np
import torch
import torch.nn.functional as F
from rich.console import Console
from rich.table import Table

from memplan import runtime
from memplan.runtime.execute.arena import ArenaFallbackWarning, in_place_nodes
from memplan.runtime.measure.meter import PeakMeter
from memplan.runtime.format.plan import Plan
from memplan.tasks.solve.olla import olla_addresses
from memplan.tasks.solve.olla.lifetime import lifetime_order
from memplan.tasks.solve.core.problem import Problem
from memplan.tasks.solve.core.simulator import default_schedule, simulate

PAPER_CAP_S = 300.0


def build(name: str, batch: int, size: int):
    torch.manual_seed(0)
    if name == "gpt2":
        import transformers

        config = transformers.GPT2Config(n_layer=2, n_embd=128, n_head=4, n_positions=64, vocab_size=512,
                                         bos_token_id=0, eos_token_id=0)
        ids = torch.randint(0, 512, (batch, 64))
        return transformers.GPT2LMHeadModel(config).train(), (lambda m, x: m(input_ids=x, labels=x).loss), (ids,)
    import torchvision

    model = getattr(torchvision.models, name)(num_classes=10)
    return model, (lambda m, x, y: F.cross_entropy(m(x), y)), (torch.randn(batch, 3, size, size),
                                                                 torch.randint(0, 10, (batch,)))


def step_peak(model, loss_fn, batch, device: str, plan=None, graph=None, arena: bool = False):
    """(measured peak bytes, gradients, CUDA peak reserved bytes or None) of one step, eager when
    `plan` is None; dropout seeded alike."""
    model = copy.deepcopy(model)
    step = None if plan is None else runtime.load(plan, model, loss_fn, graph=graph, arena=arena)
    if step is not None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ArenaFallbackWarning)
            step.compile(*batch)
    cuda = device.startswith("cuda")
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    torch.manual_seed(1)
    with PeakMeter(device) as meter:
        if step is None:
            loss_fn(model, *batch).backward()
        else:
            step(*batch)
    reserved = torch.cuda.max_memory_reserved() if cuda else None
    return meter.peak_bytes, [p.grad for p in model.parameters()], reserved


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="+", default=["resnet18", "mobilenet_v2", "gpt2"])
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 32])
    parser.add_argument("--size", type=int, default=64, help="image side of the torchvision models")
    parser.add_argument("--time-limit", type=float, default=60.0, help="seconds per ILP (paper: 300)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    console = Console(width=220)

    table = Table(title=f"OLLA vs PyTorch's order and allocator ({device}, ILPs limited to {args.time_limit:.0f} s)")
    for column in ("model", "batch", "nodes", "PyTorch order peak (sim / measured)", "OLLA / PyTorch order (sim)",
                   "OLLA / PyTorch order (measured)", "ILP bound / OLLA", "OLLA plan / eager (measured)", "frag. all",
                   "frag. in place", "lifetime s / 300", "lifetime ILP", "location s / 300", "max |grad diff|"):
        table.add_column(column, justify="right" if column != "model" else "left")
    if device == "cuda":
        table.add_column("reserved arena / eager", justify="right")
    for name in args.models:
        for b in args.batches:
            model, loss_fn, batch = build(name, b, args.size)
            model, batch = model.to(device), tuple(t.to(device) for t in batch)
            graph = runtime.capture(model, loss_fn, batch)
            problem = Problem.from_graph(graph)
            default = simulate(problem, default_schedule(problem)).peak_bytes
            order = lifetime_order(problem, time_limit=args.time_limit, gap=0.0)
            schedule = [("compute", v) for v in order.order]
            sim = simulate(problem, schedule)
            everything = olla_addresses(problem, sim, time_limit=args.time_limit)
            nodes = in_place_nodes(graph, device)
            in_place = olla_addresses(problem, sim, np.array([v in nodes for v in order.order]),
                                      time_limit=args.time_limit)
            eager_peak, eager_grads, eager_reserved = step_peak(model, loss_fn, batch, device)
            default_peak, _, _ = step_peak(model, loss_fn, batch, device, runtime.default_plan(graph), graph)
            plan = Plan(graph.fingerprint, schedule)
            olla_peak, grads, _ = step_peak(model, loss_fn, batch, device, plan, graph)
            diff = max(float((a - b).abs().max()) for a, b in zip(grads, eager_grads))
            bound = "-" if order.bound_bytes is None else f"{order.bound_bytes / order.peak_bytes:.3f}"
            row = [name, str(b), str(problem.num_nodes), f"{default / 2**20:.2f} / {default_peak / 2**20:.2f} MiB",
                   f"{order.peak_bytes / default:.3f}", f"{olla_peak / default_peak:.3f}", bound,
                   f"{olla_peak / eager_peak:.3f}", _frag(everything), _frag(in_place), f"{order.seconds:.1f}",
                   f"{order.status}, {order.source}", f"{everything.seconds:.1f}", f"{diff:.1e}"]
            if device == "cuda":
                arena_plan = Plan(graph.fingerprint, schedule, in_place.addresses)
                *_, arena_reserved = step_peak(model, loss_fn, batch, device, arena_plan, graph, arena=True)
                row.append(f"{arena_reserved / eager_reserved:.3f}")
            table.add_row(*row)
            console.print(f"done {name} batch {b}", style="dim")
    console.print(table)
    console.print("frag. = (arena - live bytes of the placed copies) / arena; paper: 0%. OLLA / PyTorch: "
                  "paper 0.775 (batch 1) and 0.899 (batch 32) on average.")


def _frag(placed) -> str:
    if not placed.arena_bytes:
        return "-"
    return f"{(placed.arena_bytes - placed.live_bytes) / placed.arena_bytes:.1%} ({placed.source})"


if __name__ == "__main__":
    main()
