"""DistributedDataParallel, as the planner sees it (torch-free).

`runtime.load(plan, DistributedDataParallel(model), ...)` all-reduces the parameter gradients in buckets, as
DDP's reducer does: in the order the planned backward makes them final, each bucket (at most DDP's
`bucket_cap_mb`) copied into a flat buffer and its all-reduce launched right after the step computing its
last gradient, all waited for at the end of the step (`runtime.format.schedule.gradient_buckets`, the rule the
runtime runs). `under_ddp(problem, gradients, bucket_mb)` is that problem: each bucket's buffer lives from its
launch to the end of the step, and the simulator charges it (tasks/solve/core/simulator.py).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Sequence

from memplan.tasks.solve.core.problem import GradientSync, Problem

MB = 1024 * 1024
"""DDP's megabyte (`bucket_cap_mb` is in MiB)."""

DEFAULT_BUCKET_MB = 25.0
"""DistributedDataParallel's default `bucket_cap_mb`."""


def bucket_cap_bytes(bucket_mb: float) -> int:
    """`bucket_cap_mb` in bytes, as DDP converts it."""
    return int(bucket_mb * MB)


def under_ddp(problem: Problem, gradients: Sequence[tuple[Sequence[int], Sequence[int]]],
              bucket_mb: float = DEFAULT_BUCKET_MB) -> Problem:
    """`problem` with its gradients all-reduced in DDP buckets of `bucket_mb` (module docstring); `gradients` is
    `runtime.format.graph.OpGraph.gradient_updates()` (each gradient value is bucketed alone, tied ones too)."""
    if not bucket_mb > 0:
        raise ValueError(f"ddp_bucket_mb must be a positive number of MiB (DDP's bucket_cap_mb), not {bucket_mb!r}.")
    grads = tuple(g for gs, _ in gradients for g in gs)
    return replace(problem, gradient_sync=GradientSync(grads, bucket_cap_bytes(bucket_mb)))
