"""Variants fixed family by family (tasks/solve/core/fixed_variants.py) and `dtr` planning with them: the fixed
problem simulates exactly as the original with the chosen implementations named, and `dtr` uses a
variant where only a variant fits."""

from __future__ import annotations

import numpy as np
import pytest

from memplan.tasks.solve import solve
from memplan.tasks.solve.core.fixed_variants import candidate_choices, family_choice, fixed_problem, tag_schedule
from memplan.tasks.solve.core.problem import Problem, Variant
from memplan.tasks.solve.core.simulator import default_schedule, simulate
from memplan.tasks.solve.core.solution import SolveOptions
from tests.solve.test_monet import _budgets, brute_force, masked_chain, two_masks


def random_schedule(problem: Problem, rng: np.random.Generator) -> list:
    """The default order with, before each backward node, a random subset of the forward nodes recomputed."""
    fwd = [int(i) for i in problem.order if problem.is_recomputable[i]]
    out = [("compute", i) for i in fwd]
    for node in problem.order:
        if not problem.is_recomputable[node]:
            out += [("compute", i) for i in fwd if rng.random() < 0.3] + [("compute", int(node))]
    return out


@pytest.mark.parametrize("seed", [4, 5, 6, 9])
def test_a_fixed_problem_simulates_like_the_original_running_the_chosen_variants(seed):
    p = masked_chain(seed)
    rng = np.random.default_rng(seed)
    choices = candidate_choices(p)
    assert choices[0] == {} and len(choices) >= 1 + bool(p.has_variants)
    for choice in choices:
        fixed = fixed_problem(p, choice)
        assert not fixed.has_variants
        for schedule in [default_schedule(fixed), *(random_schedule(fixed, rng) for _ in range(5))]:
            a, b = simulate(fixed, schedule), simulate(p, tag_schedule(schedule, choice))
            assert (a.peak_bytes, a.compute_cost) == (b.peak_bytes, pytest.approx(b.compute_cost)), (choice, schedule)


def test_a_variant_whose_producer_cannot_make_what_it_reads_is_not_chosen():
    """Only the backward node offers "mask" here (the forward has no variant making the mask): fixing the
    family chooses nothing."""
    p = two_masks(1.5, 2.5)
    lone = Problem(**{**p.__dict__, "variants": ((), (), p.variants[2])})
    assert family_choice(p, ("mask",)) == {0: "mask", 2: "mask"}
    assert family_choice(lone, ("mask",)) == {}


def test_competing_families_are_tried_one_against_the_other():
    p = two_masks(1.5, 2.5)
    assert candidate_choices(p) == [{}, {0: "bitmask", 2: "bitmask"}, {0: "mask", 2: "mask"}]


@pytest.mark.parametrize("mask_cost, bitmask_cost", [(1.5, 2.5), (2.5, 1.5)])
def test_dtr_runs_the_variant_that_fits_and_the_cheaper_when_both_do(mask_cost, bitmask_cost):
    p = two_masks(mask_cost, bitmask_cost)
    peak = {impl: simulate(p, [("compute", 0, impl), ("compute", 1), ("compute", 2, impl)]).peak_bytes
            for impl in ("mask", "bitmask")}
    for budget in (peak["mask"], peak["bitmask"]):
        assert not solve(p, "dtr", budget, SolveOptions(params={"variants": False})).feasible
        sol = solve(p, "dtr", budget)
        assert sol.feasible and sol.objective == pytest.approx(brute_force(p, budget)), (budget, sol.schedule)
        assert sol.predicted_peak_bytes == simulate(p, sol.schedule).peak_bytes <= budget


@pytest.mark.parametrize("seed", [4, 5, 6, 9])
def test_dtr_with_variants_is_valid_and_never_worse_than_without(seed):
    """With no time limit the walks are deterministic and the no-variant choice is among those tried."""
    p = masked_chain(seed)
    for budget in _budgets(p):
        plain = solve(p, "dtr", budget, SolveOptions(params={"variants": False}))
        sol = solve(p, "dtr", budget)
        assert sol.feasible or not plain.feasible
        if sol.feasible:
            assert sol.predicted_peak_bytes == simulate(p, sol.schedule).peak_bytes <= budget
            assert not plain.feasible or sol.objective <= plain.objective + 1e-9


def test_a_forward_variant_replacing_what_a_default_backward_reads_is_not_chosen():
    """Node 0's "compact" variant makes value 4 instead of value 1, which the backward (offering no such
    variant) reads: fixing the family must leave node 0 on its default."""
    p = Problem(name="compact", cost=np.ones(3), workspace=np.zeros(3, np.int64), phase=("forward", "loss", "backward"),
                node_inputs=((0,), (1,), (1,)), node_outputs=((1,), (2,), (3,)),
                value_bytes=np.array([4, 16, 4, 16, 2], np.int64), value_producer=np.array([-1, 0, 1, 2, 0]),
                outputs=(2, 3), order=np.arange(3), num_variant_values=1,
                variants=((Variant("compact", 1.0, 0, (0,), (4,)),), (), ()))
    assert family_choice(p, ("compact",)) == {}
    assert candidate_choices(p) == [{}]


def test_in_place_variants_are_never_fixed():
    """A problem without variants cannot say that a step writes into its input: `inplace` is skipped."""
    relu = Problem(name="relu", cost=np.ones(3), workspace=np.zeros(3, np.int64), phase=("forward", "forward", "loss"),
                   node_inputs=((0,), (1,), (2,)), node_outputs=((1,), (2,), (3,)),
                   value_bytes=np.array([4, 8, 8, 4], np.int64), value_producer=np.array([-1, 0, 1, 2]),
                   outputs=(3,), order=np.arange(3),
                   variants=((), (Variant("inplace", 1.0, 0, (1,), (2,), ((2, 1),)),), ()))
    assert family_choice(relu, ("inplace",)) == {} and candidate_choices(relu) == [{}]


def fast_first(cost: float, workspace: int = 0) -> Problem:
    """f_0 -> f_1 -> loss; b_1 reads the loss and f_0's output, b_0 b_1's and the input. f_0 (cost 2) offers
    "fast": the same reads and values at `cost`, with `workspace`. Checkpoint-all peaks at 20 bytes (the loss
    step); 16 bytes need f_0 recomputed for b_1."""
    return Problem(name="fast-first", cost=np.array([2.0, 2.0, 1.0, 1.0, 1.0]), workspace=np.zeros(5, np.int64),
                   phase=("forward", "forward", "loss", "backward", "backward"),
                   node_inputs=((0,), (1,), (2,), (3, 1), (4, 0)), node_outputs=((1,), (2,), (3,), (4,), (5,)),
                   value_bytes=np.array([4, 8, 8, 4, 2, 4], np.int64), value_producer=np.array([-1, 0, 1, 2, 3, 4]),
                   outputs=(3, 5), order=np.arange(5),
                   variants=((Variant("fast", cost, workspace, (0,), (1,)),), (), (), (), ()))


@pytest.mark.parametrize("cost, workspace, fixed", [(1.0, 0, True), (1.9, 0, True), (1.95, 0, False), (1.0, 4, False)])
def test_a_variant_that_only_saves_time_is_fixed_in_every_choice(cost, workspace, fixed):
    """Same reads and values, no more workspace and at least 5% cheaper (1.9 of 2): every candidate runs it, and
    `dtr` reaches the cheapest schedule of MONeT's space with and without recomputing f_0, running it each time;
    2.5% cheaper, or more workspace: not fixed (nor memory-saving: it saves no bytes)."""
    p = fast_first(cost, workspace)
    assert candidate_choices(p) == ([{0: "fast"}] if fixed else [{}])
    if not fixed:
        return
    for budget, runs in [(20, 1), (16, 2)]:
        sol = solve(p, "dtr", budget)
        assert sol.feasible and sol.objective == pytest.approx(brute_force(p, budget)), (budget, sol.schedule)
        assert [s[2:] for s in sol.schedule if s[0] == "compute" and s[1] == 0] == [("fast",)] * runs


def test_a_variant_is_fixed_where_it_needs_less_workspace_and_dtr_prices_its_time():
    """f_0 and f_1 both offer "lean", reading and making their defaults' values: at f_0 it needs no workspace
    where the default needs 16 B (and costs 3, not 2), at f_1 8 B where the default needs none. Fixed on all
    nodes the family saves nothing at checkpoint-all (f_0's step, 8 + 16 B, becomes f_1's, 8 + 8 + 8 B), so the
    lean candidate fixes it on f_0 alone; at 20 B only that choice fits (f_0: 8 B, f_1: 16 B, the loss step
    20 B), and dtr runs it at cost 3 + 2 + 1 + 1 + 1."""
    from dataclasses import replace

    from memplan.tasks.solve.core.fixed_variants import lean_choice

    p = replace(fast_first(2.0), workspace=np.array([16, 0, 0, 0, 0], np.int64),
                variants=((Variant("lean", 3.0, 0, (0,), (1,)),), (Variant("lean", 1.0, 8, (1,), (2,)),), (), (), ()))
    assert simulate(p, default_schedule(p)).peak_bytes == 24
    assert lean_choice(p) == {0: "lean"}
    assert candidate_choices(p) == [{}, {0: "lean"}]
    sol = solve(p, "dtr", 20)
    assert sol.feasible and sol.objective == pytest.approx(8.0)
    assert [s[2:] for s in sol.schedule if s[0] == "compute" and s[1] in (0, 1)] == [("lean",), ()]


@pytest.mark.parametrize("solver", ["checkmate-approx", "checkmate"])
def test_a_portfolio_solver_planning_without_variants_is_never_costlier_than_dtr_running_them(solver):
    """f_0's "fast" variant halves its cost (time only): `dtr` runs it, the recompute-only solver plans without it
    (checkmate's MILP proves its own answer optimal there). The answer is never costlier than dtr's, variants
    counted: dtr's schedule, its source named, no bound of the smaller space kept."""
    p = fast_first(1.0)
    for budget in (20, 16):
        dtr = solve(p, "dtr", budget)
        alone = solve(p, solver, budget, SolveOptions(portfolio=False))
        sol = solve(p, solver, budget)
        assert alone.feasible and alone.objective > dtr.objective == pytest.approx(brute_force(p, budget))
        assert sol.objective == dtr.objective and sol.source == "dtr" and sol.schedule == dtr.schedule
        assert sol.status == "feasible" and sol.bound is None
        assert simulate(p, sol.schedule).peak_bytes == sol.predicted_peak_bytes <= budget
