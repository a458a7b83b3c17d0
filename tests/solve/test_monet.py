"""MONeT's program (tasks/solve/monet): exact against a brute force over its schedule space, never worse
than MONeT-NoOp, MONeT-NoOp close to Checkmate, predictions from the simulator."""

from __future__ import annotations

import functools
import importlib
import itertools
from dataclasses import replace

import numpy as np
import pytest

from memplan.tasks.solve import solve
from memplan.tasks.solve.core.problem import Problem, Variant
from memplan.tasks.solve.core.simulator import InvalidSchedule, simulate
from memplan.tasks.solve.core.solution import SolveOptions, min_budget_lower_bound

ALONE = SolveOptions(portfolio=False, time_limit=60)


def masked_chain(seed: int, n: int = 4) -> Problem:
    """Forward f_0..f_{n-1} (f_{n-1} the loss), f_j reading f_{j-1} (f_0 the input) and, at random, a
    skip from f_{j-2}; backward b_{n-2}..b_0, b_j reading the gradient of b_{j+1} and f_j's output
    (or its input, at random). Some f_j are ReLU-like: variant "mask" also allocates a small mask
    value, and b_j's variant "mask" reads it instead of f_j's output. Random bytes and costs."""
    rng = np.random.default_rng(seed)
    inputs, outputs, phase, cost = [], [], [], []
    value_bytes, producer = [int(rng.integers(2, 9))], [-1]           # value 0: the batch

    def value(nbytes: int, node: int) -> int:
        value_bytes.append(nbytes)
        producer.append(node)
        return len(value_bytes) - 1

    fout = []
    for j in range(n):
        ins = [0] if j == 0 else [fout[j - 1]]
        if j >= 2 and rng.random() < 0.5:
            ins.append(fout[j - 2])
        inputs.append(tuple(ins))
        fout.append(value(4 if j == n - 1 else int(rng.integers(2, 13)), j))
        outputs.append((fout[j],))
        phase.append("loss" if j == n - 1 else "forward")
        cost.append(float(rng.integers(1, 6)))
    grad, reads = None, {}
    for j in range(n - 2, -1, -1):
        node = len(inputs)
        saved = fout[j] if rng.random() < 0.7 else (0 if j == 0 else fout[j - 1])
        reads[j] = (node, saved)
        inputs.append(tuple(x for x in (grad, saved) if x is not None))
        grad = value(int(rng.integers(2, 9)), node)
        outputs.append((grad,))
        phase.append("backward")
        cost.append(float(rng.integers(1, 6)))
    nodes = len(inputs)
    variants: list[tuple[Variant, ...]] = [() for _ in range(nodes)]
    masks = 0
    for j in range(n - 1):
        node, saved = reads[j]
        if saved == fout[j] and rng.random() < 0.7:
            mask = value(int(rng.integers(1, 3)), j)
            masks += 1
            variants[j] = (Variant("mask", cost[j] + 0.5, int(rng.integers(0, 3)), inputs[j], (fout[j], mask)),)
            variants[node] = (Variant("mask", cost[node], 0, tuple(mask if x == saved else x for x in inputs[node]),
                                      outputs[node]),)
    # graph outputs: the loss and the input gradient of b_0; variant-only values come last already
    return Problem(name=f"masked-chain-{seed}", cost=np.array(cost), workspace=np.zeros(nodes, np.int64),
                   phase=tuple(phase), node_inputs=tuple(inputs), node_outputs=tuple(outputs),
                   value_bytes=np.array(value_bytes, np.int64), value_producer=np.array(producer, np.int64),
                   outputs=(fout[-1], grad), order=np.arange(nodes), variants=tuple(variants) if masks else (),
                   num_variant_values=masks)


def brute_force(problem: Problem, budget: int) -> float | None:
    """Cheapest simulated schedule of MONeT's space (`schedule_space`) within `budget`."""
    peaks, costs = schedule_space(problem)
    fit = costs[peaks <= budget]
    return float(fit.min()) if len(fit) else None


@functools.lru_cache(maxsize=4)
def schedule_space(problem: Problem) -> tuple[np.ndarray, np.ndarray]:
    """(peak, cost) of every valid schedule of MONeT's space: the forward pass once (each node any
    implementation), then before each backward node (any implementation) any set of forward nodes
    recomputed in forward order, each with any implementation."""
    fwd = [i for i in range(problem.num_nodes) if problem.is_recomputable[i]]
    bwd = [i for i in range(problem.num_nodes) if not problem.is_recomputable[i]]
    steps_of = lambda node: [("compute", node, impl) for impl in problem.impls(node)]   # noqa: E731

    def recompute_sets(limit: int) -> list[list]:
        out = [[]]
        for size in range(1, limit + 1):
            for subset in itertools.combinations(fwd[:limit], size):
                out += [list(c) for c in itertools.product(*(steps_of(i) for i in subset))]
        return out

    # backward node b_j (stage n-2-j) reads values of f_0..f_j only, so later nodes are never worth recomputing
    stage_sets = [recompute_sets(len(bwd) - k) for k in range(len(bwd))]
    found = []
    for forward in itertools.product(*(steps_of(i) for i in fwd)):
        for stages in itertools.product(*([r + [b] for r in sets for b in steps_of(node)]
                                          for node, sets in zip(bwd, stage_sets))):
            schedule = list(forward) + [s for stage in stages for s in stage]
            try:
                sim = simulate(problem, schedule)
            except InvalidSchedule:
                continue
            found.append((sim.peak_bytes, sim.compute_cost))
    peaks, costs = np.array(found, dtype=float).reshape(-1, 2).T
    return peaks, costs


def _budgets(problem: Problem) -> list[int]:
    """From the eager peak down to the smallest budget any schedule could fit."""
    eager = simulate(problem, [("compute", int(i)) for i in problem.order]).peak_bytes
    lower = min_budget_lower_bound(problem)
    return sorted({int(lower + f * (eager - lower)) for f in (1.0, 0.6, 0.3, 0.0)})


@pytest.mark.parametrize("seed", [4, 5, 6, 9])   # 5, 6, 9: variants beat NoOp; 9: only with them
def test_monet_equals_brute_force_over_its_schedule_space(seed):
    p = masked_chain(seed)
    for budget in _budgets(p):
        expected = brute_force(p, budget)
        sol = solve(p, "monet", budget, ALONE)
        if expected is None:
            assert not sol.feasible, (budget, sol.schedule)
            continue
        assert sol.feasible and sol.objective == pytest.approx(expected), (seed, budget, sol.schedule)
        assert sol.predicted_peak_bytes == simulate(p, sol.schedule).peak_bytes <= budget
        noop = solve(p, "monet-noop", budget, ALONE)
        expected_noop = brute_force(p.without_variants(), budget)
        assert (noop.objective if noop.feasible else None) == pytest.approx(expected_noop)
        assert not noop.feasible or sol.objective <= noop.objective + 1e-9


def test_monet_noop_is_within_ten_percent_of_checkmate(linear):
    """The two model the same problem (MONeT's space is Checkmate's with recomputation only right before
    backward nodes), on Checkmate's linear graph and on branching chains."""
    for p in (linear(8), masked_chain(4, n=5).without_variants(), masked_chain(6, n=5).without_variants()):
        for budget in _budgets(p):
            exact = solve(p, "checkmate", budget, ALONE)
            noop = solve(p, "monet-noop", budget, ALONE)
            assert noop.feasible == exact.feasible, (p.name, budget)
            if exact.feasible:
                assert exact.objective <= noop.objective + 1e-9 <= 1.1 * exact.objective, (p.name, budget)
                assert noop.predicted_peak_bytes == simulate(p, noop.schedule).peak_bytes <= budget


def two_masks(mask_cost: float, bitmask_cost: float) -> Problem:
    """f_0 (ReLU-like: 16 B output a) -> loss f_1; backward b_0 reads a. Variants of f_0: "mask" also allocates a
    4 B mask, "bitmask" a 1 B packed one; b_0's variant of the same name reads that mask instead of a."""
    return Problem(name="two-masks", cost=np.array([1.0, 1.0, 1.0]), workspace=np.zeros(3, np.int64),
                   phase=("forward", "loss", "backward"), node_inputs=((0,), (1,), (1,)), node_outputs=((1,), (2,), (3,)),
                   value_bytes=np.array([4, 16, 4, 16, 4, 1], np.int64), value_producer=np.array([-1, 0, 1, 2, 0, 0]),
                   outputs=(2, 3), order=np.arange(3), num_variant_values=2,
                   variants=((Variant("mask", mask_cost, 0, (0,), (1, 4)), Variant("bitmask", bitmask_cost, 0, (0,), (1, 5))),
                             (), (Variant("mask", 1.0, 0, (4,), (3,)), Variant("bitmask", 1.0, 0, (5,), (3,)))))


@pytest.mark.parametrize("mask_cost, bitmask_cost", [(1.5, 2.5), (2.5, 1.5)])
def test_monet_chooses_between_a_byte_mask_and_a_bit_mask_by_time_and_bytes(mask_cost, bitmask_cost):
    """Where a node offers both masks, the cheaper one wins when both fit, the bit mask when only it fits."""
    p = two_masks(mask_cost, bitmask_cost)
    peak = {impl: simulate(p, [("compute", 0, impl), ("compute", 1), ("compute", 2, impl)]).peak_bytes
            for impl in ("default", "mask", "bitmask")}
    assert peak["bitmask"] < peak["mask"] < peak["default"]
    for budget, chosen in [(peak["mask"], "mask" if mask_cost < bitmask_cost else "bitmask"),
                           (peak["bitmask"], "bitmask")]:
        sol = solve(p, "monet", budget, ALONE)
        assert sol.feasible and sol.objective == pytest.approx(brute_force(p, budget)), budget
        assert [s for s in sol.schedule if s[1] == 0] == [("compute", 0, chosen)], (budget, sol.schedule)


def test_monet_returns_its_warm_schedule_when_the_milp_ends_on_a_costlier_one(monkeypatch):
    """A MILP stopped early can hold an incumbent costlier than the schedule that started it (a start that
    lies outside MONeT's space does not even seed it): the cheaper of the two is returned."""
    monet_solver = importlib.import_module("memplan.tasks.solve.monet.solver")
    p = masked_chain(6, n=5).without_variants()
    budget = _budgets(p)[-1]                       # the eager order fits: the warm start is checkpoint-all
    costlier = next(s.schedule for b in _budgets(p)[:-1]
                    if (s := solve(p, "checkmate", b, ALONE)).feasible and s.objective > p.cost.sum())
    assert simulate(p, costlier).peak_bytes <= budget and simulate(p, costlier).compute_cost > p.cost.sum()
    monkeypatch.setattr(monet_solver, "schedule_from_solution", lambda L, x: costlier)
    sol = solve(p, "monet-noop", budget, ALONE)
    assert sol.feasible and sol.objective == pytest.approx(p.cost.sum()) and sol.status == "feasible"
    # a MILP answer the simulator refuses (a backward node before its input exists) is dropped, not raised
    monkeypatch.setattr(monet_solver, "schedule_from_solution", lambda L, x: costlier[::-1])
    sol = solve(p, "monet-noop", budget, ALONE)
    assert sol.feasible and sol.objective == pytest.approx(p.cost.sum()) and sol.status == "feasible"


def test_monet_auto_warm_start_runs_hierarchical_then_ap_greedy_when_checkpoint_all_does_not_fit(monkeypatch):
    """warm_start 'auto' below the eager peak: hierarchical's schedule seeds the MILP, and ap-greedy runs
    only when hierarchical has none; the optimum is the brute force's either way."""
    from memplan.tasks.solve import SOLVERS
    from memplan.tasks.solve.core.solution import Solution

    p = masked_chain(6, n=5).without_variants()
    budget, optimum = next((b, s) for b in reversed(_budgets(p)[:-1])
                           if (s := solve(p, "monet-noop", b, ALONE)).feasible)
    assert simulate(p, [("compute", int(i)) for i in p.order]).peak_bytes > budget
    calls = []

    def fake_hierarchical(schedule):
        def run(problem, b, options):
            calls.append("hierarchical")
            return Solution("hierarchical", b, "feasible" if schedule else "no_solution", schedule=schedule)
        return run

    real_ap = SOLVERS["ap-greedy"]
    monkeypatch.setitem(SOLVERS, "ap-greedy", lambda *a: calls.append("ap-greedy") or real_ap(*a))
    for schedule, expected in ((optimum.schedule, ["hierarchical"]), (None, ["hierarchical", "ap-greedy"])):
        calls.clear()
        monkeypatch.setitem(SOLVERS, "hierarchical", fake_hierarchical(schedule))
        sol = solve(p, "monet-noop", budget, ALONE)
        assert calls == expected
        assert sol.feasible and sol.objective == pytest.approx(brute_force(p, budget))


def test_monet_auto_warm_start_on_a_problem_with_variants_is_monet_noops_answer(monkeypatch):
    """Below the eager peak, `monet` first solves MONeT-NoOp's program (every node at its default) and
    starts its own MILP from that answer, so it cannot end worse than `monet-noop`."""
    monet_solver = importlib.import_module("memplan.tasks.solve.monet.solver")
    p = masked_chain(6)                                       # variants beat NoOp here (see above)
    eager = simulate(p, [("compute", int(i)) for i in p.order]).peak_bytes
    budget = next(b for b in reversed(_budgets(p)) if b < eager and solve(p, "monet-noop", b, ALONE).feasible)
    runs, real = [], monet_solver.solve_milp
    monkeypatch.setattr(monet_solver, "solve_milp", lambda model, opts: runs.append((model, opts.mip_start))
                        or real(model, opts))
    sol = solve(p, "monet", budget, ALONE)
    noop = solve(p, "monet-noop", budget, ALONE)
    (noop_model, _), (model, start), _ = runs               # monet-noop inside monet, monet, monet-noop alone
    assert noop_model.num_variables < model.num_variables and start is not None
    assert sol.feasible and noop.feasible and sol.objective < noop.objective
    assert sol.objective == pytest.approx(brute_force(p, budget))


def relu_chain(seed: int) -> Problem:
    """f0: batch -> a; f1 (ReLU): a -> r, its input read by it alone; loss f2: r -> l; backward b2 reads r,
    b1 (the ReLU's) reads its gradient and r, b0 its gradient and the batch. Variants of f1: "mask" (also a
    mask m, which b1's "mask" reads instead of r), "inplace" (r written into a) and "mask-inplace"; b0's
    cheaper "output" reads a instead of the batch (after an in-place f1, only a recomputed a). Random bytes."""
    rng = np.random.default_rng(seed)
    B = int(rng.integers(6, 13))
    g2, g1, g0 = (int(x) for x in rng.integers(2, 7, 3))
    m = int(rng.integers(1, 3))
    #                  batch a  r  l  g2  g1  g0  m
    value_bytes = np.array([3, B, B, 1, g2, g1, g0, m], np.int64)
    a, r, l, vg2, vg1, vg0, vm = range(1, 8)
    return Problem(
        name=f"relu-chain-{seed}", cost=np.array([2.0, 1.0, 1.0, 1.0, 1.0, 4.0]), workspace=np.zeros(6, np.int64),
        phase=("forward", "forward", "loss", "backward", "backward", "backward"),
        node_inputs=((0,), (a,), (r,), (r,), (vg2, r), (vg1, 0)),
        node_outputs=((a,), (r,), (l,), (vg2,), (vg1,), (vg0,)),
        value_bytes=value_bytes, value_producer=np.array([-1, 0, 1, 2, 3, 4, 5, 1]), outputs=(l, vg0),
        order=np.arange(6), num_variant_values=1,
        variants=((), (Variant("mask", 1.5, 0, (a,), (r, vm)), Variant("inplace", 0.75, 0, (a,), (r,), ((r, a),)),
                       Variant("mask-inplace", 1.25, 0, (a,), (r, vm), ((r, a),))),
                  (), (), (Variant("mask", 1.0, 0, (vg2, vm), (vg1,)),), (Variant("output", 0.5, 0, (vg1, a), (vg0,)),)))


def out_of_place(p: Problem) -> Problem:
    """`p` without its in-place implementations."""
    return replace(p, variants=tuple(tuple(v for v in offered if not v.overwrites) for offered in p.variants))


def test_monet_with_in_place_relu_equals_brute_force_and_in_place_lowers_the_smallest_budget():
    p = relu_chain(0)
    lower = min_budget_lower_bound(p)
    eager = simulate(p, [("compute", int(i)) for i in p.order]).peak_bytes
    for q in (p, out_of_place(p)):
        for budget in [*range(lower, eager + 1), int(p.value_bytes.sum())]:   # and one where everything fits
            expected = brute_force(q, budget)
            sol = solve(q, "monet", budget, ALONE)
            assert (sol.objective if sol.feasible else None) == pytest.approx(expected), (q.name, budget, sol.schedule)
            assert not sol.feasible or sol.predicted_peak_bytes == simulate(q, sol.schedule).peak_bytes <= budget
    # the smallest budget any schedule fits needs the ReLU in place: without it, nothing fits there
    smallest = next(b for b in range(lower, eager + 1) if brute_force(p, b) is not None)
    assert brute_force(out_of_place(p), smallest) is None and smallest < eager
    sol = solve(p, "monet", smallest, ALONE)
    assert any(s[1] == 1 and s[2].endswith("inplace") for s in sol.schedule if len(s) > 2)
