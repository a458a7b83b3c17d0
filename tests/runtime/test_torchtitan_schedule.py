"""torchtitan's selective checkpointing decisions (save matmul outputs, recompute every other op of a layer)
as a memplan schedule (bench/peers.py `torchtitan_schedule`): it recomputes exactly each layer's other ops
before that layer's backward, trains like eager at its simulated peak, and the exact remat MILP
(`checkmate`) finds a schedule at least as cheap within that peak (issue 34's question: does the search
miss torchtitan's point?)."""

import importlib.util
from pathlib import Path

import torch
import torch.nn.functional as F

from memplan import runtime
from memplan.runtime.policy.form import Regions
from memplan.tasks.solve import solve
from memplan.tasks.solve.core.problem import Problem
from memplan.tasks.solve.core.simulator import simulate
from memplan.tasks.solve.core.solution import SolveOptions
from tests.runtime.projection_net import Net


def _bench_peers():
    """bench/peers.py, where the torchtitan-style peer lives (bench/ is scripts, not a package)."""
    path = Path(__file__).resolve().parents[2] / "bench" / "peers.py"
    spec = importlib.util.spec_from_file_location("bench_peers", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_PEERS = _bench_peers()
torchtitan_schedule, torchtitan_solution = _PEERS.torchtitan_schedule, _PEERS.torchtitan_solution

MATMUL = ("aten.addmm.default", "aten.mm.default")


def captured():
    torch.manual_seed(0)
    model, loss_fn = Net(), lambda m, x, y: F.cross_entropy(m(x), y)
    batch = (torch.randn(64, 32), torch.randint(0, 8, (64,)))
    return model, loss_fn, batch, runtime.capture(model, loss_fn, batch)


def test_each_layer_recomputes_its_non_matmul_ops_right_before_its_backward():
    _, _, _, graph = captured()
    problem = Problem.from_graph(graph)
    computes = [s["compute"] for s in torchtitan_schedule(problem, graph)]
    layers = Regions.of_problem(problem).members
    assert list(layers) == ["blocks.0", "blocks.1", "blocks.2"]
    assert sorted(set(computes)) == list(range(len(graph.nodes)))
    again = [i for i, n in enumerate(computes) if n in computes[:i]]
    expected = [n for name in reversed(layers) for n in Regions.of_problem(problem).rerun[name]
                if graph.nodes[n].targets[0] not in MATMUL]
    assert [computes[i] for i in again] == expected and len(expected) == 6   # mul, sin per layer: the output
    # projection saves sin's output before it runs, where checkpoint's recomputation stops
    for nodes in layers.values():         # each layer's reruns: together, and read by the next step, a backward
        reruns = [i for i in again if computes[i] in nodes]
        assert reruns == list(range(reruns[0], reruns[-1] + 1))
        after = graph.nodes[computes[reruns[-1] + 1]]
        made = {v for i in reruns for v in graph.nodes[computes[i]].outputs}
        assert after.phase == "backward" and set(after.inputs) & made


def test_the_schedule_trains_like_eager_at_its_simulated_peak(helpers):
    model, loss_fn, batch, graph = captured()
    problem = Problem.from_graph(graph)
    solution = torchtitan_solution(problem, graph)
    assert solution.predicted_peak_bytes == simulate(problem, torchtitan_schedule(problem, graph)).peak_bytes
    result = helpers.train_plan(model, loss_fn, batch, solution.to_plan(problem), graph=graph)
    helpers.assert_same_step(helpers.train_eager(model, loss_fn, batch), result)
    helpers.assert_peak_matches(result.peak, solution.predicted_peak_bytes)


def test_the_exact_milp_is_at_least_as_cheap_within_the_schedules_peak():
    _, _, _, graph = captured()
    costs = {n.id: (10.0 if n.targets[0] in MATMUL else 1.0, 0) for n in graph.nodes}
    problem = Problem.from_graph(graph, costs)
    titan = torchtitan_solution(problem, graph)
    none = simulate(problem, [("compute", n.id) for n in graph.nodes])
    assert titan.predicted_peak_bytes < none.peak_bytes and titan.objective == problem.cost.sum() + 6
    milp = solve(problem, "checkmate", titan.predicted_peak_bytes, SolveOptions(time_limit=60))
    assert milp.feasible and milp.predicted_peak_bytes <= titan.predicted_peak_bytes
    assert milp.objective <= titan.objective + 1e-9
