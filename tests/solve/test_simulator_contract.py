"""The simulator's contract at its edges: which copies are live at a step, the exact refusals (ids one past
the end, graph inputs), integer timelines, and address conflicts at the first and last shared step."""

from __future__ import annotations

import numpy as np
import pytest

from memplan.tasks.solve.core.problem import Problem, Variant
from memplan.tasks.solve.core.simulator import AddressConflict, InvalidSchedule, simulate


def with_input() -> Problem:
    """Graph input x (value 0, 8 B); node 0: a = f(x) (value 1, 10 B); node 1: b = g(x, a) (value 2,
    20 B); node 2: y = h(b, x) (value 3, 5 B, the output). Node 1 reads the graph input first."""
    return Problem(name="with-input", cost=np.array([1.0, 2.0, 4.0]), workspace=np.array([0, 3, 0], np.int64),
                   phase=("forward",) * 3, node_inputs=((0,), (0, 1), (2, 0)), node_outputs=((1,), (2,), (3,)),
                   value_bytes=np.array([8, 10, 20, 5], np.int64), value_producer=np.array([-1, 0, 1, 2]),
                   outputs=(3,), order=np.arange(3))


def test_a_graph_input_read_before_an_activation_does_not_hide_the_activation_read():
    sim = simulate(with_input(), [("compute", 0), ("compute", 1), ("compute", 2)])
    # a lives through node 1 (its reader, which reads x first); b through node 2; y to the end
    assert sim.timeline.tolist() == [10, 10 + 20 + 3, 20 + 5]
    assert sim.peak_bytes == 33 and sim.peak_step == 1 and sim.constant_bytes == 8
    assert sim.copy_end.tolist() == [1, 2, 2]


def test_live_values_are_those_whose_copy_spans_the_step_inclusively():
    p = with_input()
    sim = simulate(p, [("compute", 0), ("compute", 1), ("compute", 2), ("compute", 0)])
    assert sim.live_values(0).tolist() == [1]
    assert sim.live_values(1).tolist() == [1, 2]           # a's last read, b computed
    assert sim.live_values(2).tolist() == [2, 3]           # b's last read, y computed
    assert sim.live_values(3).tolist() == [1, 3]           # a again (never read: its own step), y to the end


def test_timelines_and_copies_are_integers():
    sim = simulate(with_input(), [("compute", 0), ("compute", 1), ("compute", 2)])
    for array in (sim.timeline, sim.copy_value, sim.copy_start, sim.copy_end, sim.copy_bytes, sim.workspace):
        assert array.dtype == np.int64
    assert sim.is_compute.dtype == bool and isinstance(sim.peak_bytes, int)


@pytest.mark.parametrize("schedule, message", [
    ([("compute", 3)], r"^schedule\[0\] computes node 3, which does not exist \(0..2\)\.$"),
    ([("compute", 0), ("free", 4)], r"^schedule\[1\] frees value 4, which does not exist \(0..3\)\.$"),
    ([("compute", 0), ("free", 0)], r"^schedule\[1\] frees value 0, a graph input; graph inputs are always resident\.$"),
    ([("compute", 0), ("free", 2)], r"^schedule\[1\] frees value 2, which is not resident\.$"),
    ([("compute", 0), ("free", 1), ("compute", 1)], r"^schedule\[2\] computes .*, which reads value 1, but it was "
                                                    r"freed at schedule\[1\]\.$"),
    ([("compute", 0), ("compute", 1)], r"^graph outputs \[3\] are not resident at the end of the schedule \(1 missing\)"),
    ([("compute", 0), ("compute", 1), ("compute", 2), ("free", 3)], r"^graph outputs \[3\]"),
    (["run 0"], r"^schedule\[0\] is 'run 0'"),
])
def test_refusals_name_the_step_and_the_valid_range(schedule, message):
    with pytest.raises(InvalidSchedule, match=message):
        simulate(with_input(), schedule)


def test_the_output_is_live_to_the_end_even_when_computed_first():
    """Graph outputs of a schedule that frees and recomputes: the final copy lives to the end."""
    p = with_input()
    sim = simulate(p, [("compute", 0), ("compute", 1), ("compute", 2), ("free", 2), ("compute", 0)])
    assert sim.copy_end.tolist() == [1, 2, 4, 4]
    assert sim.timeline.tolist()[-2:] == [5, 15]


def chain(n: int = 4, nbytes: int = 10) -> Problem:
    return Problem.from_edges([1.0] * n, [nbytes] * n, [(i, i + 1) for i in range(n - 1)])


@pytest.mark.parametrize("addresses, clash", [
    ({(0, 0): 0, (1, 1): 9}, True),          # a (steps 0-1) and b (1-2) share step 1 and byte 9
    ({(0, 0): 0, (1, 1): 10}, False),        # adjacent ranges
    ({(1, 1): 0, (0, 0): 9}, True),          # the same, listed the other way round
    ({(0, 0): 10, (1, 1): 0}, False),
    ({(0, 0): 0, (2, 2): 0}, False),         # a ends at step 1, c starts at step 2
    ({(1, 1): 0, (2, 2): 5}, True),          # b (1-2) and c (2-3) share step 2
])
def test_overlapping_addresses_clash_only_when_the_copies_share_a_step(addresses, clash):
    p = chain()
    schedule = [("compute", i) for i in range(4)]
    if clash:
        with pytest.raises(AddressConflict, match="are live together from schedule"):
            simulate(p, schedule, addresses)
    else:
        sim = simulate(p, schedule, addresses)
        assert sim.arena_bytes == max(o for o in addresses.values()) + 10


def test_a_clash_names_both_copies_and_their_byte_ranges():
    p = chain()
    with pytest.raises(AddressConflict) as err:
        simulate(p, [("compute", i) for i in range(4)], {(0, 0): 0, (1, 1): 4})
    assert str(err.value) == ("value 0 (computed at schedule[0], bytes 0..10) and value 1 (computed at "
                              "schedule[1], bytes 4..14) are live together from schedule[1] but their "
                              "addresses overlap.")


def test_the_first_of_several_later_clashes_is_named():
    p = Problem.from_edges([1.0] * 4, [10, 10, 10, 10], [(0, 1), (0, 2), (0, 3), (1, 3), (2, 3)])
    schedule = [("compute", i) for i in range(4)]
    with pytest.raises(AddressConflict, match=r"value 0 .* and value 2 \(computed at schedule\[2\]"):
        simulate(p, schedule, {(0, 0): 0, (1, 1): 10, (2, 2): 5})


def test_empty_copies_never_clash():
    p = Problem.from_edges([1.0] * 3, [0, 10, 10], [(0, 1), (1, 2)])
    sim = simulate(p, [("compute", i) for i in range(3)], {(0, 0): 0, (1, 1): 0})
    assert sim.arena_bytes == 10


def test_one_byte_copies_can_clash():
    p = Problem.from_edges([1.0] * 3, [1, 1, 1], [(0, 1), (1, 2)])
    with pytest.raises(AddressConflict):
        simulate(p, [("compute", i) for i in range(3)], {(0, 0): 0, (1, 1): 0})


def test_an_output_computed_first_is_resident_at_the_end():
    """The output's copy is the schedule's first (copy index 0)."""
    p = Problem(name="first", cost=np.ones(2), workspace=np.zeros(2, np.int64), phase=("forward",) * 2,
                node_inputs=((), (0,)), node_outputs=((0,), (1,)), value_bytes=np.array([4, 6], np.int64),
                value_producer=np.array([0, 1]), outputs=(0, 1), order=np.arange(2))
    sim = simulate(p, [("compute", 0), ("compute", 1)])
    assert sim.timeline.tolist() == [4, 10] and sim.copy_end.tolist() == [1, 1]


def test_an_empty_copy_inside_another_copy_s_bytes_does_not_clash():
    """A 0-byte value placed strictly inside a live 10-byte value's range occupies no byte of it."""
    p = Problem.from_edges([1.0] * 3, [10, 0, 10], [(0, 1), (1, 2)])
    sim = simulate(p, [("compute", i) for i in range(3)], {(0, 0): 0, (1, 1): 5})
    assert sim.arena_bytes == 10 and sim.arena_peak_bytes == 10 + 10     # the unplaced output at the end


def test_arena_peak_is_the_arena_when_nothing_unplaced_is_live_at_a_compute_step():
    """Every copy but the (empty) output is placed, and a free step sits between computes: the arena-mode
    peak is the arena itself, not one byte more."""
    p = Problem.from_edges([1.0] * 4, [10, 10, 10, 0], [(0, 1), (1, 2), (2, 3)])
    schedule = [("compute", 0), ("compute", 1), ("free", 0), ("compute", 2), ("compute", 3)]
    sim = simulate(p, schedule, {(0, 0): 0, (1, 1): 10, (3, 2): 0})
    assert sim.arena_bytes == 20 and sim.arena_peak_bytes == 20


def test_arena_peak_adds_the_workspace_of_the_step():
    """with_input() with a 30-byte workspace on node 1; a at 0..10 and b at 10..30 fill a 30-byte arena;
    at node 1 nothing unplaced is live but its workspace: arena-mode peak 30 + 30."""
    p = Problem(**{**with_input().__dict__, "workspace": np.array([0, 30, 0], np.int64)})
    sim = simulate(p, [("compute", 0), ("compute", 1), ("compute", 2)], {(0, 1): 0, (1, 2): 10})
    assert sim.arena_bytes == 30 and sim.arena_peak_bytes == 60


def test_missing_outputs_are_listed_up_to_ten():
    n = 12
    p = Problem(name="wide", cost=np.ones(n), workspace=np.zeros(n, np.int64), phase=("forward",) * n,
                node_inputs=((),) * n, node_outputs=tuple((i,) for i in range(n)),
                value_bytes=np.ones(n, np.int64), value_producer=np.arange(n), outputs=tuple(range(n)),
                order=np.arange(n))
    with pytest.raises(InvalidSchedule, match=r"^graph outputs \[1, 2, 3, 4, 5, 6, 7, 8, 9, 10\] are not "
                                              r"resident at the end of the schedule \(11 missing\)"):
        simulate(p, [("compute", 0)])


def test_a_value_only_variants_allocate_names_every_such_variant():
    """x -> 0: a (default; variants mask and packed also allocate m) -> 1 reads m: computing node 0 by
    default leaves m unallocated, and the refusal lists both variants that would allocate it."""
    p = Problem(name="two-masks", cost=np.ones(2), workspace=np.zeros(2, np.int64), phase=("forward", "backward"),
                node_inputs=((0,), (1,)), node_outputs=((1,), (2,)), value_bytes=np.array([8, 8, 8, 2]),
                value_producer=np.array([-1, 0, 1, 0]), outputs=(2,), order=np.arange(2),
                variants=((Variant("mask", 1.0, 0, (0,), (1, 3)), Variant("packed", 1.0, 0, (0,), (1, 3))),
                          (Variant("from_mask", 1.0, 0, (3,), (2,)),)),
                num_variant_values=1)
    with pytest.raises(InvalidSchedule, match=r"has not been computed by a variant that allocates it "
                                              r"\(mask, packed\)\.$"):
        simulate(p, [("compute", 0), ("compute", 1, "from_mask")])


def test_two_outputs_of_one_step_clash_even_when_one_lives_only_in_that_step():
    """Node 0 computes a (read by node 1) and u (never read: live in its own step only) at overlapping
    addresses: both are live at schedule[0]."""
    p = Problem(name="two-outputs", cost=np.ones(2), workspace=np.zeros(2, np.int64), phase=("forward",) * 2,
                node_inputs=((), (0,)), node_outputs=((0, 1), (2,)), value_bytes=np.array([8, 8, 4], np.int64),
                value_producer=np.array([0, 0, 1]), outputs=(2,), order=np.arange(2))
    with pytest.raises(AddressConflict, match=r"live together from schedule\[0\]"):
        simulate(p, [("compute", 0), ("compute", 1)], {(0, 0): 0, (0, 1): 4})


def test_the_peak_of_empty_values_is_zero_at_a_compute_step():
    """Every value 0 bytes, no workspace, a free step in between: the peak is 0 bytes, at a compute step."""
    p = Problem.from_edges([1.0] * 3, [0, 0, 0], [(0, 1), (1, 2)])
    sim = simulate(p, [("compute", 0), ("compute", 1), ("free", 0), ("compute", 2)])
    assert sim.peak_bytes == 0 and sim.is_compute[sim.peak_step]
