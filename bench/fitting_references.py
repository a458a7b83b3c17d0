"""Which reference step fits a device memory limit: each in-device reference of tasks/fit/reference.py
(eager, per-block checkpointing, nested checkpointing) run once on the CPU at one batch size, its measured
peak plus the resident bytes beside the limit, side by side in one run.

    .venv/bin/python bench/fitting_references.py [--model resnet18] [--batch 40] [--limit 191069988]
                                                 [--optimizer adamw]

Defaults: docs/fit.md's ResNet-18 `memplan fit` answer (batch 40 under 191,069,988 B, AdamW's state
resident). Micro-batches are left out where the model has BatchNorm or dropout, as the reference stage leaves
them out; the host's reference is eager's step run without the limit (the eager row). Prints one row per
reference: total bytes, MiB, the margin to the limit, and one step's time (under the meter) relative to
eager's.

A second table bounds the rounding a host reference for a GPU must allow (`HOST_RTOL`, `HOST_ATOL`): the
CPU's fp32 step against the same step in fp64, loss and every gradient, the largest |fp32 - fp64| and
the least (rtol, atol) multiple that covers it. CUDA's fp32 step rounds as much in its own order, so the
CPU and GPU steps differ by at most about twice this.
"""

from __future__ import annotations

import argparse
import copy
import time

from rich.console import Console
from rich.table import Table

from memplan.runtime.measure.meter import PeakMeter
from memplan.tasks.config import load_config
from memplan.tasks.fit.reference import EAGER, NESTED_CHECKPOINT, PER_BLOCK_CHECKPOINT, checkpoint_blocks, \
    checkpoint_nested, training_step
from memplan.tasks.fit.memory_limit import MemoryLimit
from memplan.tasks.models import build_batch, build_loss, build_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="pipeline.toml")
    parser.add_argument("--model", default="resnet18")
    parser.add_argument("--batch", type=int, default=40)
    parser.add_argument("--limit", type=int, default=191069988)
    parser.add_argument("--optimizer", default="adamw")
    args = parser.parse_args()

    spec = next(m for m in load_config(args.config).models if m.name == args.model)
    limit = MemoryLimit(limit_bytes=args.limit, optimizer=args.optimizer)
    base, loss_fn = build_model(spec, 0), build_loss(spec)
    batch = build_batch(spec, args.batch, 0, "cpu")
    resident = limit.module_resident_bytes(base, batch)
    table = Table(title=f"{args.model} at batch {args.batch}: limit {args.limit:,} B ({args.limit / 2**20:.2f} MiB), "
                        f"{resident:,} B resident ({args.optimizer})")
    for column in ("reference", "total B", "MiB", "vs limit", "step time / eager"):
        table.add_column(column, justify="left" if column == "reference" else "right")
    eager_ms = None
    references = [(EAGER, None), (PER_BLOCK_CHECKPOINT, checkpoint_blocks), (NESTED_CHECKPOINT, checkpoint_nested)]
    for kind, wrap in references:
        model = copy.deepcopy(base)
        if wrap is not None:
            wrap(model)
        step = training_step(model, loss_fn, batch, keep_buffers=wrap is not None)
        start = time.perf_counter()
        with PeakMeter("cpu") as meter:
            step()
        ms = (time.perf_counter() - start) * 1000
        eager_ms = eager_ms or ms
        total = meter.peak_bytes + resident
        margin = (limit.limit_bytes - total) / 2**20
        table.add_row(kind, f"{total:,}", f"{total / 2**20:.2f}",
                      f"fits ({margin:.2f} MiB spare)" if margin >= 0 else f"misses by {-margin:.2f} MiB",
                      f"{ms / eager_ms:.2f}")
    Console().print(table)
    Console().print(rounding_table(base, loss_fn, batch))


def rounding_table(base, loss_fn, batch) -> Table:
    """The fp32 step's loss and gradients against fp64's, and the share of `HOST_RTOL`/`HOST_ATOL` they use."""
    import torch

    from memplan.tasks.fit.reference import HOST_ATOL, HOST_RTOL

    states = []
    for dtype in (torch.float32, torch.float64):
        model = copy.deepcopy(base).to(dtype)
        inputs = tuple(t.to(dtype) if t.is_floating_point() else t for t in batch)
        loss = training_step(model, loss_fn, inputs)()
        states.append({"loss": loss.detach(), **{n: p.grad for n, p in model.named_parameters()}})
    table = Table(title=f"one fp32 step against fp64 (host tolerance rtol {HOST_RTOL:g}, atol {HOST_ATOL:g})")
    for column in ("tensors", "largest |fp32 - fp64|", "largest |fp32 - fp64| / (atol + rtol |fp64|)"):
        table.add_column(column, justify="right")
    worst_abs = worst_share = 0.0
    for name, single in states[0].items():
        double = states[1][name]
        diff = (single.double() - double).abs()
        worst_abs = max(worst_abs, float(diff.max()))
        worst_share = max(worst_share, float((diff / (HOST_ATOL + HOST_RTOL * double.abs())).max()))
    table.add_row(str(len(states[0])), f"{worst_abs:.3g}", f"{worst_share:.3g}")
    return table


if __name__ == "__main__":
    main()
