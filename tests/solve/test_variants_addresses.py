"""Implementation variants and addresses in the shared simulator, on hand-computed and random graphs."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from memplan.tasks.solve import solve
from memplan.tasks.solve.core.addresses import ALIGNMENT, greedy_addresses, placeable
from memplan.tasks.solve.core.problem import Problem, ProblemError, Variant
from memplan.tasks.solve.core.simulator import AddressConflict, InvalidSchedule, default_schedule, simulate


def relu_sum_problem() -> Problem:
    """x (input) -> 0: a = relu(x) (40 B) -> 1: s = sum(a) (4 B, the loss) ; 2: g = backward reading a
    (40 B, the gradient). Variant "mask" of node 0 also allocates m (10 B, variant-only value 4);
    variant "mask" of node 2 reads m instead of a."""
    return Problem(
        name="relu-sum", cost=np.array([1.0, 1.0, 2.0]), workspace=np.zeros(3, np.int64),
        phase=("forward", "loss", "backward"), node_inputs=((0,), (1,), (1,)), node_outputs=((1,), (2,), (3,)),
        value_bytes=np.array([40, 40, 4, 40, 10]), value_producer=np.array([-1, 0, 1, 2, 0]), outputs=(2, 3),
        order=np.arange(3),
        variants=((Variant("mask", 1.5, 6, (0,), (1, 4)),), (), (Variant("mask", 1.0, 0, (4,), (3,)),)),
        num_variant_values=1)


def test_the_chosen_variant_is_charged_memory_workspace_and_time():
    p = relu_sum_problem()
    default = simulate(p, default_schedule(p))
    assert default.timeline.tolist() == [40, 44, 84] and default.peak_bytes == 84 and default.compute_cost == 4.0
    masked = simulate(p, [("compute", 0, "mask"), ("compute", 1), ("compute", 2, "mask")])
    # a + m + workspace 6; a (last read by the sum) + m + s; m + s + g
    assert masked.timeline.tolist() == [56, 54, 54] and masked.peak_bytes == 56 and masked.compute_cost == 3.5
    assert p.impls(0) == ("default", "mask") and p.variant(2, "mask").inputs == (4,)


def test_variants_that_do_not_fit_together_are_refused():
    p = relu_sum_problem()
    with pytest.raises(InvalidSchedule, match=r"reads value 4, but its producer node 0 has not been computed by a "
                                              r"variant that allocates it \(mask\)"):
        simulate(p, [("compute", 0), ("compute", 1), ("compute", 2, "mask")])
    with pytest.raises(InvalidSchedule, match="node 1 has no implementation variant 'mask'; it offers default"):
        simulate(p, [("compute", 0), ("compute", 1, "mask"), ("compute", 2)])
    with pytest.raises(ProblemError, match="variant names"):
        Problem(**{**relu_sum_problem().__dict__, "variants": ((Variant("default", 1, 0, (0,), (1,)),), (), ())})


def test_recompute_only_solvers_see_the_problem_without_variants():
    p = relu_sum_problem()
    assert p.without_variants().num_values == 4 and not p.without_variants().has_variants
    sol = solve(p, "checkpoint-all", 10**6)
    assert sol.schedule == default_schedule(p) and sol.predicted_peak_bytes == 84


def test_addresses_give_the_arena_and_the_arena_mode_peak():
    p = relu_sum_problem()
    schedule = [("compute", 0, "mask"), ("compute", 1), ("compute", 2, "mask")]
    sim = simulate(p, schedule)
    addresses = greedy_addresses(p, sim)
    assert set(addresses) == {(0, 1), (0, 4)}           # s and g are final copies of graph outputs
    placed = simulate(p, schedule, addresses)
    # both pad to 64 B; m lives longer, so it goes first (at 0) and a above it (at 64)
    assert addresses == {(0, 4): 0, (0, 1): ALIGNMENT} and placed.arena_bytes == ALIGNMENT + 40
    # arena for the whole step + the unplaced copies and workspace at each step: max(6, 4, 44)
    assert placed.arena_peak_bytes == ALIGNMENT + 40 + 44 and placed.peak_bytes == sim.peak_bytes


def test_the_checker_refuses_overlaps_final_outputs_and_unknown_copies():
    p = relu_sum_problem()
    schedule = [("compute", 0, "mask"), ("compute", 1), ("compute", 2, "mask")]
    with pytest.raises(AddressConflict, match=r"value 1 .* and value 4 .* are live together from schedule\[0\]"):
        simulate(p, schedule, {(0, 1): 0, (0, 4): 39})
    assert simulate(p, schedule, {(0, 1): 0, (0, 4): 40}).arena_bytes == 50   # touching is fine
    with pytest.raises(AddressConflict, match="final copy of a graph output"):
        simulate(p, schedule, {(2, 3): 0})
    with pytest.raises(AddressConflict, match="does not allocate the value"):
        simulate(p, schedule, {(1, 1): 0})


@st.composite
def schedules(draw):
    """A random DAG (one value per node, graph output: the last node) and a valid schedule of it with
    random recomputations inserted after the producers of their inputs."""
    n = draw(st.integers(2, 9))
    edges = [(i, j) for j in range(1, n) for i in range(j) if draw(st.booleans())]
    nbytes = draw(st.lists(st.integers(0, 300), min_size=n, max_size=n))
    p = Problem.from_edges([1.0] * n, nbytes, edges)
    steps = [("compute", i) for i in range(n)]
    for _ in range(draw(st.integers(0, 6))):
        node = draw(st.integers(0, n - 1))
        first = max([steps.index(("compute", s)) + 1 for s, t in edges if t == node], default=0)
        steps.insert(draw(st.integers(first, len(steps) - 1)), ("compute", node))
    return p, steps


@settings(max_examples=150, deadline=None)
@given(schedules())
def test_greedy_placement_is_valid_and_between_the_live_bound_and_the_sum(case):
    p, schedule = case
    sim = simulate(p, schedule)
    addresses = greedy_addresses(p, sim)
    ids = np.flatnonzero(placeable(p, sim))
    assert len(addresses) == len(ids)
    # independent overlap check: every pair of copies live at a common step occupies disjoint bytes
    copies = [(int(sim.copy_start[c]), int(sim.copy_end[c]), addresses[int(sim.copy_start[c]), int(sim.copy_value[c])],
               int(sim.copy_bytes[c])) for c in ids]
    for i, (s1, e1, o1, b1) in enumerate(copies):
        assert o1 % ALIGNMENT == 0
        for s2, e2, o2, b2 in copies[i + 1:]:
            assert not (s1 <= e2 and s2 <= e1 and o1 < o2 + b2 and o2 < o1 + b1)
    placed = simulate(p, schedule, addresses)                 # the simulator's checker agrees
    live = max((sum(b for s, e, _, b in copies if s <= k <= e) for k in range(len(schedule))), default=0)
    padded = sum(-(-b // ALIGNMENT) * ALIGNMENT for *_, b in copies)
    assert live <= placed.arena_bytes <= padded
