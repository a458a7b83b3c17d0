import numpy as np
import pytest

from memplan.tasks.solve.core.problem import Problem
from memplan.tasks.solve.core.simulator import InvalidSchedule, default_schedule, simulate


def _checkmate_u_peak(p: Problem) -> int:
    """Checkmate's U recurrence (eq. 2-5) for the default order with every node once and no constant
    overhead: during step k, every output computed at or before k whose last user is at or after k."""
    pos = p.position
    last = [max([pos[u] for u in p.value_users[v]] + [pos[v]]) for v in range(p.num_values)]
    for v in p.outputs:
        last[v] = p.num_nodes
    return max(sum(int(p.value_bytes[v]) for v in range(p.num_values) if pos[v] <= k <= last[v])
               for k in range(p.num_nodes))


def test_default_schedule_matches_checkmate_recurrence(benchmark_paths):
    for path in benchmark_paths:
        if "n1000" in path.name or "n500" in path.name:
            continue
        p = Problem.from_node_link(path)
        sim = simulate(p, default_schedule(p))
        assert sim.peak_bytes == _checkmate_u_peak(p), path.name
        assert sim.compute_cost == pytest.approx(p.cost.sum())
        assert sim.num_computes == p.num_nodes and sim.constant_bytes == 0


def _diamond() -> Problem:
    """a(10) -> b(20), a -> c(40), b,c -> d(5); d is the output. Values = node ids."""
    return Problem.from_edges([1, 2, 3, 4], [10, 20, 40, 5], [(0, 1), (0, 2), (1, 3), (2, 3)])


def test_timeline_frees_after_last_read():
    p = _diamond()
    sim = simulate(p, [("compute", 0), ("compute", 1), ("compute", 2), ("compute", 3)])
    # a lives through c (its last read); b and c through d; d to the end.
    assert sim.timeline.tolist() == [10, 30, 70, 65]
    assert sim.peak_bytes == 70 and sim.peak_step == 2 and sim.compute_cost == 10


def test_a_hold_keeps_a_resident_value_live_through_its_step():
    p = _diamond()
    held = simulate(p, [("compute", 0), ("compute", 1), ("compute", 2), {"compute": 3, "holds": [0]}])
    assert held.timeline.tolist() == [10, 30, 70, 75]          # a lives through d, which does not read it
    with pytest.raises(InvalidSchedule, match=r"schedule\[4\] computes .*value 0, but it was freed at schedule\[3\]"):
        simulate(p, [("compute", 0), ("compute", 1), ("compute", 2), ("free", 0), {"compute": 3, "holds": [0]}])
    with pytest.raises(InvalidSchedule, match=r"schedule\[3\] holds value 9, which does not exist"):
        simulate(p, [("compute", 0), ("compute", 1), ("compute", 2), {"compute": 3, "holds": [9]}])


def test_recomputation_makes_a_fresh_copy_and_old_copy_dies_at_its_last_read():
    p = _diamond()
    sim = simulate(p, [{"compute": 0}, {"compute": 1}, {"compute": 0}, {"compute": 2}, {"compute": 3}])
    # first a: last read at step 1; second a: read at step 3.
    assert sim.timeline.tolist() == [10, 30, 30, 70, 65]
    assert sim.compute_cost == 11 and sim.num_computes == 5


def test_explicit_free_and_workspace_and_multi_output():
    p = Problem(name="m", cost=np.array([1.0, 1.0]), workspace=np.array([7, 100]),
                phase=("forward", "backward"), node_inputs=((0,), (1, 2)), node_outputs=((1, 2), (3,)),
                value_bytes=np.array([1000, 10, 20, 30]), value_producer=np.array([-1, 0, 0, 1]),
                outputs=(3,), order=np.array([0, 1]))
    sim = simulate(p, [("compute", 0), ("compute", 1), ("free", 1)])
    assert sim.timeline.tolist() == [37, 160, 30]
    assert sim.peak_bytes == 160 and sim.constant_bytes == 1000


def test_unread_copy_counts_only_during_its_step():
    p = _diamond()
    sim = simulate(p, [("compute", 0), ("compute", 0), ("compute", 1), ("compute", 2), ("compute", 3)])
    assert sim.timeline.tolist() == [10, 10, 30, 70, 65]


@pytest.mark.parametrize("schedule, message", [
    ([("compute", 1)], "has not been computed"),
    ([("compute", 0), ("free", 0), ("compute", 1)], r"freed at schedule\[1\]"),
    ([("compute", 9)], "does not exist"),
    ([("compute", 0), ("free", 0), ("free", 0)], "not resident"),
    ([("compute", 0), ("compute", 1), ("compute", 2)], r"graph outputs \[3\]"),
    ([("compute", 0), ("compute", 1), ("compute", 2), ("compute", 3), ("free", 3)], r"graph outputs \[3\]"),
    ([("run", 0)], "a step is"),
])
def test_invalid_schedules_are_rejected(schedule, message):
    with pytest.raises(InvalidSchedule, match=message):
        simulate(_diamond(), schedule)


def _in_place_relu(extra_reader: bool = False) -> Problem:
    """f0: x (input, 4 B) -> a (16 B); f1 (ReLU-like): a -> b (16 B), variant "inplace" writes b into a;
    loss f2: b (and a, with `extra_reader`) -> l (4 B); backward b0: b -> g (4 B). Outputs l and g."""
    from memplan.tasks.solve.core.problem import Variant

    f2_inputs = (2, 1) if extra_reader else (2,)
    return Problem(name="in-place-relu", cost=np.ones(4), workspace=np.zeros(4, np.int64),
                   phase=("forward", "forward", "loss", "backward"), node_inputs=((0,), (1,), f2_inputs, (2,)),
                   node_outputs=((1,), (2,), (3,), (4,)), value_bytes=np.array([4, 16, 16, 4, 4], np.int64),
                   value_producer=np.array([-1, 0, 1, 2, 3]), outputs=(3, 4), order=np.arange(4),
                   variants=((), (Variant("inplace", 1.0, 0, (1,), (2,), ((2, 1),)),), (), ()))


def test_an_in_place_step_allocates_nothing_for_its_output():
    p = _in_place_relu()
    default = simulate(p, default_schedule(p))
    in_place = simulate(p, [("compute", 0), ("compute", 1, "inplace"), ("compute", 2), ("compute", 3)])
    # by hand: a | a + b | b + l | b + l + g, and in place a's copy ends before step 1 where b takes its bytes
    assert default.timeline.tolist() == [16, 32, 20, 24] and default.peak_bytes == 32
    assert in_place.timeline.tolist() == [16, 16, 20, 24] and in_place.peak_bytes == 24
    assert in_place.in_place.tolist() == [True, True, False, False] and not default.in_place.any()


def test_reading_or_freeing_an_overwritten_value_is_refused_until_it_is_computed_again():
    p = _in_place_relu(extra_reader=True)
    with pytest.raises(InvalidSchedule, match=r"schedule\[2\] computes node 2, which reads value 1, but "
                                              r"schedule\[1\] ran node 1 in place, overwriting it"):
        simulate(p, [("compute", 0), ("compute", 1, "inplace"), ("compute", 2), ("compute", 3)])
    with pytest.raises(InvalidSchedule, match=r"frees value 1, which is not resident: schedule\[1\] ran node 1 in place"):
        simulate(p, [("compute", 0), ("compute", 1, "inplace"), ("free", 1)])
    again = simulate(p, [("compute", 0), ("compute", 1, "inplace"), ("compute", 0), ("compute", 2), ("compute", 3)])
    assert again.timeline.tolist() == [16, 16, 32, 36, 24] and again.compute_cost == 5


def test_an_in_place_pair_must_overwrite_an_internal_value_of_equal_size():
    from dataclasses import replace

    from memplan.tasks.solve.core.problem import ProblemError, Variant

    p = _in_place_relu()
    for overwrites, outputs in [(((2, 0),), (3, 4)), (((2, 1),), (1, 3, 4))]:   # a graph input; a graph output
        variant = Variant("inplace", 1.0, 0, (0, 1), (2,), overwrites)
        with pytest.raises(ProblemError, match="overwrites input .* with output 2; an in-place pair"):
            replace(p, variants=((), (variant,), (), ()), outputs=outputs)


def test_copies_of_an_in_place_step_get_no_address():
    from memplan.tasks.solve.core.addresses import greedy_addresses
    from memplan.tasks.solve.core.simulator import AddressConflict

    p = _in_place_relu()
    schedule = [("compute", 0), ("compute", 1, "inplace"), ("compute", 2), ("compute", 3)]
    sim = simulate(p, schedule)
    assert greedy_addresses(p, sim) == {}                      # a and b share storage; l and g are outputs
    with pytest.raises(AddressConflict, match=r"value 1 at schedule\[0\]: that copy is overwritten in place"):
        simulate(p, schedule, {(0, 1): 0})
