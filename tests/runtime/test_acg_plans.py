"""ACG plans (tasks/solve/acg) run through the runtime: the step equals eager PyTorch, and the measured
peak is the simulator's prediction."""

import pytest

from memplan.tasks.solve import solve
from memplan.tasks.solve.core.problem import Problem
from memplan.tasks.solve.core.simulator import default_schedule, simulate
from memplan.tasks.solve.core.solution import SolveOptions


def acg_plan(graph, budget_fraction=None):
    """The ACG plan of `graph` (unit node costs): memory-optimal, or budgeted at a fraction of the way
    from the memory-optimal peak up to the checkpoint-all peak."""
    problem = Problem.from_graph(graph)
    peak = simulate(problem, default_schedule(problem)).peak_bytes
    solution = solve(problem, "acg", peak, SolveOptions(params={"mode": "memory"}))
    if budget_fraction is not None:
        budget = int(solution.predicted_peak_bytes + budget_fraction * (peak - solution.predicted_peak_bytes))
        solution = solve(problem, "acg", budget, SolveOptions())
    assert solution.feasible, solution.message
    return solution.to_plan(problem), solution


@pytest.mark.parametrize("name", ["bottleneck_resnet", "small_densenet"])   # residual and dense branching, small:
# bench/acg_paper_table.py plans the full-size networks (resnet50, densenet121, inception_v3, vgg16)
def test_memory_optimal_acg_plan_trains_like_eager(captured, helpers, name):
    model, loss_fn, batch, graph = captured(name)
    plan, solution = acg_plan(graph)
    steps = plan.compute_steps()
    assert len(steps) > len(graph.nodes)                          # segments are re-forwarded
    assert max(steps.count(n) for n in set(steps)) == 2           # each at most once
    result = helpers.train_plan(model, loss_fn, batch, plan, graph=graph)
    helpers.assert_same_step(helpers.train_eager(model, loss_fn, batch), result)
    assert solution.predicted_peak_bytes == helpers.simulated_peak(graph, plan.schedule)
    helpers.assert_peak_matches(result.peak, solution.predicted_peak_bytes)


def test_budgeted_acg_plan_trains_like_eager_within_its_budget(captured, helpers):
    model, loss_fn, batch, graph = captured("small_densenet")
    memory_plan, memory_optimal = acg_plan(graph)
    plan, solution = acg_plan(graph, budget_fraction=0.5)
    assert solution.objective < memory_optimal.objective          # recomputes less than the memory optimum
    result = helpers.train_plan(model, loss_fn, batch, plan, graph=graph)
    helpers.assert_same_step(helpers.train_eager(model, loss_fn, batch), result)
    assert solution.predicted_peak_bytes <= solution.budget_bytes
    helpers.assert_peak_matches(result.peak, solution.predicted_peak_bytes)
