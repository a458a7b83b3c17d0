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


# -- nested recomputation across blocks (Rotor, Beaumont et al. 2019) ------------------------------

NESTED_BUCKETS = 256
"""Memory units of the nested program: the budget is split into this many (amounts rounded up)."""


@dataclass(frozen=True)
class Sweep:
    """Block i run forward keeping only its outputs (Rotor's F_ck): cost, the block's own peak while it
    runs, and the bytes of its outputs (the next block's input, `x_{i+1}`)."""

    cost: float
    peak: int
    output: int


Op = tuple[str, int, int]
"""("forward", i, o): block i's forward part under option o; ("sweep", i, -1): block i's forward keeping
only its outputs; ("backward", i, o): block i's backward part under option o."""


def nested_chain_dp(choices: Sequence[Sequence[Choice]], sweeps: Sequence[Sweep], external: np.ndarray,
                    budget: float) -> list[Op] | None:
    """Rotor's recurrence over blocks s..t with m bytes free (x_s held by the caller), where a block
    boundary need not be kept until its backward:
        C(s, t, m) = min( min_o  cost_s(o) + C(s+1, t, m - retained_s(o)),                      [keep]
                              with forward_peak_s(o), E_s + backward_peak_s(o), retained_s(o) <= m;
                          min_{s < s' <= t}  sum_{k=s}^{s'-1} sweep_k.cost + C(s', t, m - x_{s'}) + C(s, s'-1, m) )
                              with x_k + sweep_k.peak <= m for s <= k < s' (x_s counted by the caller)  [recompute]
    and C(s, s, m) the best [keep] option alone. [keep] with every block is `chain_dp`'s composition; the
    [recompute] branch runs blocks s..s'-1 forward twice (once now, once after block s'..t's backward).
    Returns the operations in order (`Op`), or None when nothing fits."""
    unit = max(budget / NESTED_BUCKETS, 1.0)
    up = lambda x: int(np.ceil(x / unit - 1e-9))  # noqa: E731
    total = int(budget // unit)
    k = len(choices)
    fwd = [[up(c.forward_peak) for c in opts] for opts in choices]
    bwd = [[up(int(external[i]) + c.backward_peak) for c in opts] for i, opts in enumerate(choices)]
    kept = [[up(c.retained) for c in opts] for opts in choices]
    x = [up(s.output) for s in sweeps]
    peak = [up(s.peak) for s in sweeps]
    memo: dict[tuple[int, int, int], tuple[float, tuple]] = {}

    def best(s: int, t: int, m: int) -> tuple[float, tuple]:
        key = (s, t, m)
        if key in memo:
            return memo[key]
        answer: tuple[float, tuple] = (np.inf, ())
        for o, c in enumerate(choices[s]):
            if fwd[s][o] > m or bwd[s][o] > m or kept[s][o] > m:
                continue
            rest = (0.0, ()) if s == t else best(s + 1, t, m - kept[s][o])
            if c.cost + rest[0] < answer[0]:
                answer = (c.cost + rest[0], ("keep", o))
        swept = 0.0
        for split in range(s + 1, t + 1):
            j = split - 1
            if peak[j] + (x[j - 1] if j > s else 0) > m or x[j] > m:
                break
            swept += sweeps[j].cost
            later, earlier = best(split, t, m - x[j]), best(s, j, m)
            if swept + later[0] + earlier[0] < answer[0]:
                answer = (swept + later[0] + earlier[0], ("recompute", split))
        memo[key] = answer
        return answer

    def ops(s: int, t: int, m: int) -> list[Op]:
        kind, arg = best(s, t, m)[1]
        if kind == "keep":
            inner = [] if s == t else ops(s + 1, t, m - kept[s][arg])
            return [("forward", s, arg), *inner, ("backward", s, arg)]
        return [("sweep", i, -1) for i in range(s, arg)] + ops(arg, t, m - x[arg - 1]) + ops(s, arg - 1, m)

    if k == 0 or not np.isfinite(best(0, k - 1, total)[0]):
        return None
    return ops(0, k - 1, total)
