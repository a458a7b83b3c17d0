"""Step time of eager PyTorch vs memplan's default plan (same model, same batch, one run, interleaved).

    .venv/bin/python bench/runtime_overhead.py [--model resnet18] [--batch 8] [--size 64] [--rounds 30]

Prints median and best step times (wall clock and process CPU time, the latter less sensitive to other
jobs on a shared host) and their ratios to eager (target: default plan within 3% of eager on CPU).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F
import torchvision
from rich.console import Console
from rich.table import Table

from memplan import runtime


def cross_entropy(model, x, y):
    return F.cross_entropy(model(x), y)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="resnet18")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--size", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=1,
                    help="intra-op threads (1 keeps the comparison stable on a shared host)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    torch.manual_seed(0)
    device = torch.device(args.device)
    model = getattr(torchvision.models, args.model)(num_classes=10).to(device)
    batch = (torch.randn(args.batch, 3, args.size, args.size, device=device),
             torch.randint(0, 10, (args.batch,), device=device))
    t0 = time.perf_counter()
    graph = runtime.capture(model, cross_entropy, batch)
    capture_s = time.perf_counter() - t0
    step = runtime.load(runtime.default_plan(graph), model, cross_entropy, graph=graph)

    def eager():
        cross_entropy(model, *batch).backward()

    def planned():
        step(*batch)

    def timed(fn):
        model.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t, c = time.perf_counter(), time.process_time()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter() - t, time.process_time() - c

    for _ in range(3):
        timed(eager), timed(planned)
    times: dict[str, list[tuple[float, float]]] = {"eager": [], "default plan": []}
    for i in range(args.rounds):   # alternate which goes first, so drift hits both alike
        order = [("eager", eager), ("default plan", planned)]
        for name, fn in order if i % 2 == 0 else order[::-1]:
            times[name].append(timed(fn))

    table = Table(title=f"{args.model}, batch {args.batch}x3x{args.size}x{args.size}, {device}, "
                        f"{torch.get_num_threads()} threads, {args.rounds} interleaved rounds "
                        f"(capture {capture_s:.1f} s, {graph.meta['aten_call_nodes']} ATen calls -> "
                        f"{len(graph.nodes)} operator nodes)")
    table.add_column("runner")
    table.add_column("clock")
    table.add_column("median ms", justify="right")
    table.add_column("best ms", justify="right")
    table.add_column("median / eager", justify="right")
    table.add_column("best / eager", justify="right")
    for k, clock in enumerate(("wall", "cpu")):
        base = [t[k] for t in times["eager"]]
        for name, ts in times.items():
            ts = [t[k] for t in ts]
            med, best = statistics.median(ts), min(ts)
            table.add_row(name, clock, f"{med * 1e3:.2f}", f"{best * 1e3:.2f}",
                          f"{med / statistics.median(base):.3f}", f"{best / min(base):.3f}")
    Console().print(table)


if __name__ == "__main__":
    main()
