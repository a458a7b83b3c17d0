import numpy as np
import pytest

from tasks.solve.problem import Problem
from tasks.solve.simulator import InvalidSchedule, default_schedule, simulate


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
