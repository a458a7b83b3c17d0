"""Peak-directed recomputation insertion: a greedy that lowers a topological order's peak to the budget.

Start from a topological order with no recomputation (compute steps only: a copy is live from its step
through its last read, the simulator's memory). While some step exceeds the budget, take the step of the
peak p and, for each copy c live across p but not read there (value v, producer u, last read at or before
p: r1, first read after p: r2), weigh the moves that drop c after r1 and compute u again before a step
q in (p, r2] (later reads use the new copy):
- plain: the inputs of u stay live until q (their copies extended);
- inputs recomputed: the inputs of u whose extension would cross a step over the budget are recomputed
  too, just before u (one level), the others extended;
at q = r2 (the latest point) and at the first step after p where the inputs of u are still live. The
move taken maximizes (excess before - excess after) / (cost of the inserted steps + epsilon), the excess
being sum over steps of max(0, live bytes - budget); moves that do not lower the excess are never taken.
Moves are ranked by an estimate of that score (`_Insertion.estimate`) and the EXACT_MOVES best that lower
the excess are simulated exactly, by a vectorized simulation of compute-only schedules equal to
`tasks.solve.core.simulator.simulate` (the caller checks the result with it again). Finally each recomputation
is removed again, dearest first, when the schedule stays within the budget.
"""

from __future__ import annotations

import time

import numpy as np

from memplan.tasks.solve.core.problem import Problem

EXACT_MOVES = 8
"""Moves simulated exactly per insertion, the best by estimated score (`_Insertion.estimate`)."""

EPSILON = 1e-3
"""Added to a move's cost, as a fraction of the mean node cost, so that free moves compare by excess."""


class _Schedules:
    """Vectorized simulation of compute-only schedules (default implementations) of one problem."""

    def __init__(self, problem: Problem):
        p = problem
        internal = p.value_producer >= 0
        ins = [[v for v in dict.fromkeys(vs) if internal[v]] for vs in p.node_inputs]
        self.in_len = np.array([len(x) for x in ins], dtype=np.int64)
        self.in_ptr = np.concatenate([[0], np.cumsum(self.in_len)])
        self.in_idx = np.array([v for x in ins for v in x], dtype=np.int64)
        self.out_len = np.array([len(x) for x in p.node_outputs], dtype=np.int64)
        self.out_ptr = np.concatenate([[0], np.cumsum(self.out_len)])
        self.out_idx = np.array([v for x in p.node_outputs for v in x], dtype=np.int64)
        self.nbytes = p.value_bytes.astype(np.float64)
        self.workspace = p.workspace.astype(np.float64)
        self.outputs = np.asarray(p.outputs, dtype=np.int64)
        self.inputs = ins

    @staticmethod
    def _gather(ptr: np.ndarray, lens: np.ndarray, idx: np.ndarray, steps: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        n = lens[steps]
        total = int(n.sum())
        owner = np.repeat(np.arange(len(steps)), n)
        offset = np.arange(total) - np.repeat(np.cumsum(n) - n, n)
        return owner, idx[ptr[steps][owner] + offset]

    def simulate(self, steps: np.ndarray):
        """(live bytes per step, copy step, copy value, copy end, read step, read copy), or None when a
        step reads a value not computed before it."""
        m = len(steps)
        cstep, cval = self._gather(self.out_ptr, self.out_len, self.out_idx, steps)
        rstep, rval = self._gather(self.in_ptr, self.in_len, self.in_idx, steps)
        key = cval * (m + 1) + cstep
        order = np.argsort(key, kind="stable")
        sorted_key = key[order]
        at = np.searchsorted(sorted_key, rval * (m + 1) + rstep) - 1
        if np.any(at < 0) or np.any(cval[order[np.maximum(at, 0)]] != rval):
            return None
        rcopy = order[at]
        end = cstep.copy()
        np.maximum.at(end, rcopy, rstep)
        last = np.searchsorted(sorted_key, self.outputs * (m + 1) + m) - 1
        if np.any(last < 0) or np.any(cval[order[np.maximum(last, 0)]] != self.outputs):
            return None
        end[order[last]] = m - 1
        nbytes = self.nbytes[cval]
        delta = np.bincount(cstep, nbytes, m + 1) - np.bincount(end + 1, nbytes, m + 1)
        live = np.cumsum(delta)[:m] + self.workspace[steps]
        return live, cstep, cval, end, rstep, rcopy


def peak_insertion_schedule(problem: Problem, budget: int, order: np.ndarray | None = None,
                            deadline: float | None = None, max_inserts: int | None = None,
                            improve_passes: int = 0, max_copies: int | None = None
                            ) -> list[tuple[str, int]] | None:
    """The greedy's schedule (module docstring) from `order` (default: the problem's), or None when no move
    lowers the excess, `deadline` (perf_counter seconds) passes or more than `max_inserts` (default: the
    number of nodes) recomputations would be needed. `improve_passes`: passes of remove-and-repair after
    it (each recomputation, dearest first, removed and the greedy rerun; kept when cheaper), stopping at
    `deadline` with the best schedule so far. `max_copies`: no node is computed more often."""
    search = _Insertion(problem, budget, deadline, max_inserts, max_copies)
    steps = search.repair(np.asarray(problem.order if order is None else order, dtype=np.int64))
    if steps is None:
        return None
    steps = search.prune(steps)
    for _ in range(improve_passes):
        better = search.improve(steps)
        if better is None:
            break
        steps = better
    return [("compute", int(v)) for v in steps]


class _Insertion:
    """The greedy's moves on compute-only schedules of one problem within one budget."""

    def __init__(self, problem: Problem, budget: int, deadline: float | None, max_inserts: int | None,
                 max_copies: int | None):
        self.p, self.budget, self.deadline, self.max_copies = problem, budget, deadline, max_copies
        self.sims = _Schedules(problem)
        self.cost = problem.cost.astype(np.float64)
        self.eps = EPSILON * max(float(self.cost.mean()), 1e-9)
        self.max_inserts = problem.num_nodes if max_inserts is None else max_inserts

    def excess(self, live: np.ndarray) -> float:
        return float(np.maximum(live - self.budget, 0.0).sum())

    def late(self) -> bool:
        return self.deadline is not None and time.perf_counter() > self.deadline

    def repair(self, steps: np.ndarray, tabu: int = -1) -> np.ndarray | None:
        """Insert recomputations into `steps` until it fits (module docstring), or None; the node `tabu`
        is not recomputed by itself."""
        p, sims, cost = self.p, self.sims, self.cost
        producer, recomputable, is_output = p.value_producer, p.is_recomputable, p.is_output
        state = sims.simulate(steps)
        inserted = 0
        while state is not None:
            live, cstep, cval, end, rstep, rcopy = state
            base = self.excess(live)
            if base <= 0:
                return steps
            if inserted >= self.max_inserts or self.late():
                return None
            peak = int(np.argmax(live))
            over = live > self.budget
            over_prefix = np.concatenate([[0], np.cumsum(over)])
            read_here = set(rcopy[rstep == peak].tolist())
            copies = np.bincount(steps, minlength=p.num_nodes)
            cross = live - np.bincount(cstep, sims.nbytes[cval], len(steps)) - sims.workspace[steps]
            by_value = np.argsort(cval * (len(steps) + 1) + cstep, kind="stable")
            keys = (cval * (len(steps) + 1) + cstep)[by_value]

            def newest_copy(values: np.ndarray, before: int) -> np.ndarray:
                """The newest copy of each of `values` computed before step `before`."""
                return by_value[np.searchsorted(keys, values * (len(steps) + 1) + before) - 1]

            by_copy = np.argsort(rcopy, kind="stable")
            read_steps = rstep[by_copy]
            read_ptr = np.searchsorted(rcopy[by_copy], np.arange(len(cstep) + 1))
            moves = []
            for c in np.flatnonzero((cstep < peak) & (end > peak)).tolist():
                v = int(cval[c])
                u = int(producer[v])
                if c in read_here or is_output[v] or not recomputable[u] or u == tabu:
                    continue
                reads = read_steps[read_ptr[c]:read_ptr[c + 1]]
                later, earlier = reads[reads > peak], reads[reads <= peak]
                if later.size == 0:
                    continue
                r1 = int(earlier.max()) if earlier.size else int(cstep[c])
                for q, extra, extended in _moves(sims, p, u, peak, int(later.min()), newest_copy, end, over_prefix):
                    if self.max_copies is not None and copies[extra + [u]].max() >= self.max_copies:
                        continue
                    gain = base - self.estimate(base, live, cross, v, r1, q, extra, extended)
                    if gain > 0:
                        moves.append((gain / (float(cost[extra + [u]].sum()) + self.eps), q, extra + [u]))
            best, best_score, tried = None, 0.0, 0
            for _, q, block in sorted(moves, key=lambda move: -move[0]):
                if tried >= EXACT_MOVES:
                    break
                new = np.insert(steps, q, block)
                trial = sims.simulate(new)
                if trial is None:
                    continue
                gain = base - self.excess(trial[0])
                if gain > 0:
                    tried += 1
                    score = gain / (float(cost[block].sum()) + self.eps)
                    if score > best_score:
                        best, best_score = (new, trial), score
            if best is None:
                return None
            steps, state = best
            inserted += 1
        return None

    def estimate(self, base: float, live: np.ndarray, cross: np.ndarray, v: int, r1: int, q: int,
                 extra: list[int], extended: dict[int, int]) -> float:
        """Excess after the move, estimated for ranking: v's copy ends at r1 and a new one starts at q,
        the `extended` inputs (value -> last live step) stay live until q, the inserted steps hold the
        values live across q plus those inputs and the recomputed `extra` values."""
        nbytes = self.sims.nbytes
        lo = min([r1, *extended.values()]) + 1
        delta = np.zeros(q - lo + 1)
        delta[r1 + 1 - lo] -= nbytes[v]
        for x, last in extended.items():
            delta[last + 1 - lo] += nbytes[x]
        window = live[lo:q]
        after = self.excess(window + np.cumsum(delta[:-1])) - self.excess(window)
        during = cross[q] + sum(nbytes[x] for x in extended) + sum(nbytes[list(self.p.node_outputs[w])].sum()
                                                                    for w in extra)
        return base + after + max(during - self.budget, 0.0)

    def prune(self, steps: np.ndarray) -> np.ndarray:
        """Remove recomputations (not first computations), dearest first, while the schedule fits."""
        keep = np.ones(len(steps), dtype=bool)
        for i in sorted(_repeats(steps), key=lambda i: -float(self.cost[steps[i]])):
            keep[i] = False
            trial = self.sims.simulate(steps[keep])
            if trial is None or trial[0].max() > self.budget:
                keep[i] = True
        return steps[keep]

    def improve(self, steps: np.ndarray) -> np.ndarray | None:
        """One pass of remove-and-repair over the recomputations of `steps` (dearest first): the cheaper
        schedule at the end of the pass, or None when none was found."""
        best, best_cost, improved = steps, float(self.cost[steps].sum()), False
        for node in sorted({int(best[i]) for i in _repeats(best)}, key=lambda v: -float(self.cost[v])):
            if self.late():
                break
            at = [i for i in _repeats(best) if best[i] == node]
            if not at:
                continue
            trial = self.repair(np.delete(best, at[0]), tabu=node)
            if trial is None:
                continue
            trial = self.prune(trial)
            if float(self.cost[trial].sum()) < best_cost - 1e-9:
                best, best_cost, improved = trial, float(self.cost[trial].sum()), True
        return best if improved else None


def _repeats(steps: np.ndarray) -> list[int]:
    """Indices of the steps computing a node again (not its first computation)."""
    seen: set[int] = set()
    out = []
    for i, v in enumerate(steps.tolist()):
        if v in seen:
            out.append(i)
        seen.add(v)
    return out


def _over_between(over_prefix: np.ndarray, last: int, q: int) -> bool:
    """Whether a step over the budget lies in (last, q): extending a copy live through `last` to q adds to it."""
    return over_prefix[q] - over_prefix[last + 1] > 0


def _moves(sims: _Schedules, p: Problem, u: int, peak: int, r2: int, newest_copy, end: np.ndarray,
           over_prefix: np.ndarray):
    """(insertion step q, inputs of u recomputed first, inputs extended: value -> last live step) for
    recomputing u after `peak` by `r2`."""
    producer = p.value_producer
    ins = sims.inputs[u]
    # the last live step of each input's newest copy before r2 (the one u would read)
    newest = dict(zip(ins, end[newest_copy(np.asarray(ins, dtype=np.int64), r2)].tolist())) if ins else {}
    held = max(newest.values(), default=peak)
    positions = {r2}
    if peak < held < r2:
        positions.add(held + 1)
    for q in sorted(positions):
        extended = {v: last for v, last in newest.items() if last < q}
        yield q, [], extended
        redo = [v for v in extended if _over_between(over_prefix, extended[v], q) and p.is_recomputable[producer[v]]]
        if redo:
            order = sorted({int(producer[v]) for v in redo}, key=lambda w: int(p.position[w]))
            yield q, order, {v: last for v, last in extended.items() if v not in redo}
