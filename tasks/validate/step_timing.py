"""Step times measured side by side: runs take turns round by round (`paired_step_times`) and an overhead is the
median of per-round ratios with its distribution-free 95% interval (`median_interval`); tasks/validate/stage.py
times plans against their reference step (and no-recomputation plans) this way."""

from __future__ import annotations

import statistics
import time
from math import comb
from typing import Any, Callable, Sequence

import torch
from torch import nn


def median_interval(samples: Sequence[float], confidence: float = 0.95) -> tuple[float, float] | None:
    """Distribution-free interval of the median of `samples`: the order statistics x_(k) and x_(n+1-k),
    k the largest rank with P(Binomial(n, 1/2) < k) <= (1 - confidence) / 2; None when even the whole
    range falls short of `confidence` (fewer than 6 samples at 95%)."""
    ordered = sorted(samples)
    n = len(ordered)
    tail, k = 0.0, 0
    while k < n and tail + comb(n, k) / 2**n <= (1 - confidence) / 2:
        tail += comb(n, k) / 2**n
        k += 1
    return (ordered[k - 1], ordered[n - k]) if k else None


def paired_step_times(runs: list[tuple[nn.Module, Callable[[], Any]]], device: str, warmup: int, steps: int,
                      max_steps: int, precision: float, clock: Callable[[], float] = time.perf_counter,
                      ) -> list[list[float]]:
    """Wall times (ms, CUDA synchronised) of each run's step, the runs taking turns round by round so that a
    busy host slows a round's runs alike, in reverse order every other round so that no run always goes
    first (caches warmed by the step before); gradients are cleared between steps. The rounds after `warmup`
    are timed: at least `steps` of them, then more, up to `max_steps`, until for every run after the first
    the `median_interval` of its per-round time ratios to the first run reaches no further than `precision`
    from their median."""
    cuda = device.startswith("cuda")
    times: list[list[float]] = [[] for _ in runs]
    rounds = 0
    while True:
        turns = list(zip(runs, times))
        for (model, step), measured in turns if rounds % 2 == 0 else reversed(turns):
            if cuda:
                torch.cuda.synchronize(device)
            start = clock()
            step()
            if cuda:
                torch.cuda.synchronize(device)
            if rounds >= warmup:
                measured.append((clock() - start) * 1000)
            model.zero_grad(set_to_none=True)
        rounds += 1
        timed = rounds - warmup
        if timed >= max(steps, max_steps) or (timed >= steps and all(
                _settled([t / e for t, e in zip(other, times[0])], precision) for other in times[1:])):
            return times


def _settled(ratios: list[float], precision: float) -> bool:
    interval = median_interval(ratios)
    middle = statistics.median(ratios)
    return interval is not None and middle - interval[0] <= precision and interval[1] - middle <= precision
