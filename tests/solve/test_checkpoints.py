import pytest

from memplan.tasks.solve.core.checkpoints import schedule_from_checkpoints
from memplan.tasks.solve.core.problem import Problem, ProblemError
from memplan.tasks.solve.core.simulator import default_schedule, simulate


def _nodes(schedule):
    return [node for _, node in schedule]


def test_chen_segment_recomputed_once_when_retained(linear):
    # n=4: forward 0..4, backward 5..8; node 8 reads 0, node 7 reads 1, node 6 reads 2, node 5 reads 3.
    p = linear(4)
    # Segment [0, 2] ends at checkpoint 2: values 0 and 1 are dropped after the forward pass.
    assert _nodes(schedule_from_checkpoints(p, [2])) == [0, 1, 2, 3, 4, 5, 6, 0, 1, 7, 8]
    # Without retention of recomputed values, node 8 needs value 0 again.
    assert _nodes(schedule_from_checkpoints(p, [2], retain_recomputed=False)) == [0, 1, 2, 3, 4, 5, 6, 0, 1, 7, 0, 8]


def test_every_value_kept_is_the_default_schedule(benchmark_paths):
    for path in benchmark_paths[:6]:
        p = Problem.from_node_link(path)
        assert schedule_from_checkpoints(p, range(p.num_values)) == default_schedule(p)


def test_fill_is_valid_and_saves_memory_on_linear_graph(linear):
    p = linear(16)
    full = simulate(p, default_schedule(p))
    sim = simulate(p, schedule_from_checkpoints(p, [0, 4, 8, 12]))
    # sqrt(n) checkpoints: memory well below checkpoint-all, each forward node recomputed at most once.
    assert sim.peak_bytes < full.peak_bytes
    assert full.compute_cost < sim.compute_cost <= full.compute_cost + 16


def test_bad_kept_ids(linear):
    with pytest.raises(ProblemError, match="kept values must be value ids"):
        schedule_from_checkpoints(linear(2), [7])
