"""Combining block options along the chain: a dynamic program over (block, option) pairs.

The chain runs every block's forward part in order, then every block's backward part in reverse.
Let A_i be the bytes retained by blocks 0..i-1 (the sum of their options' `retained`) and E_i the
bytes made by later blocks and live during block i's backward (`BlockChain.external`). Choosing
option o for block i is allowed when
    A_i + forward_peak(o) <= M   and   A_i + E_i + backward_peak(o) <= M,
and costs cost_i(o). The program minimizes the total cost over A (states bucketed to M / BUCKETS
bytes, the cheapest kept per bucket, dominated states dropped); the simulator then judges the
composed schedule (`tasks.solve.hierarchical.solver`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

BUCKETS = 4096


@dataclass(frozen=True)
class Choice:
    """Block i's option `o`: cost, forward peak, backward peak, retained bytes."""

    cost: float
    forward_peak: int
    backward_peak: int
    retained: int


def chain_dp(choices: Sequence[Sequence[Choice]], external: np.ndarray, budget: float) -> list[int] | None:
    """The option index per block minimizing the total cost under `budget` (module docstring), or None
    when no combination fits."""
    quantum = max(budget / BUCKETS, 1.0)
    states: dict[int, tuple[float, int, int, int]] = {0: (0.0, 0, -1, -1)}   # bucket -> cost, A, parent, option
    layers = []
    for i, options in enumerate(choices):
        nxt: dict[int, tuple[float, int, int, int]] = {}
        for bucket, (cost, held, _, _) in states.items():
            for o, c in enumerate(options):
                if held + c.forward_peak > budget or held + external[i] + c.backward_peak > budget:
                    continue
                total, after = cost + c.cost, held + c.retained
                b = int(after // quantum)
                if b not in nxt or total < nxt[b][0]:
                    nxt[b] = (total, after, bucket, o)
        states = _pareto(nxt)
        layers.append(states)
        if not states:
            return None
    bucket = min(states, key=lambda b: states[b][0])
    picked = []
    for layer in reversed(layers):
        _, _, parent, o = layer[bucket]
        picked.append(o)
        bucket = parent
    return picked[::-1]


def _pareto(states: dict[int, tuple[float, int, int, int]]) -> dict[int, tuple[float, int, int, int]]:
    """States not dominated by one holding fewer bytes at no more cost."""
    kept, best = {}, np.inf
    for b in sorted(states):
        if states[b][0] < best:
            kept[b] = states[b]
            best = states[b][0]
    return kept


def chain_peak(choices: Sequence[Sequence[Choice]], external: np.ndarray, picked: Sequence[int]) -> int:
    """The program's estimate of the composed schedule's peak: the largest left-hand side of the two
    constraints over the blocks (module docstring)."""
    held, peak = 0, 0
    for i, o in enumerate(picked):
        c = choices[i][o]
        peak = max(peak, held + c.forward_peak, held + int(external[i]) + c.backward_peak)
        held += c.retained
    return peak
