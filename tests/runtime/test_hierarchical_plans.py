"""Hierarchical plans (tasks/solve/hierarchical) run through the runtime: the step equals eager PyTorch,
and the measured peak is the simulator's prediction."""

from memplan.tasks.solve import solve
from memplan.tasks.solve.core.problem import Problem
from memplan.tasks.solve.core.simulator import default_schedule, simulate
from memplan.tasks.solve.core.solution import SolveOptions


def test_hierarchical_gpt2_plan_trains_like_eager_within_its_budget(captured, helpers):
    model, loss_fn, batch, graph = captured("gpt2")
    problem = Problem.from_graph(graph)
    budget = int(0.7 * simulate(problem, default_schedule(problem)).peak_bytes)
    solution = solve(problem, "hierarchical", budget,
                     SolveOptions(time_limit=120, portfolio=False, params={"block_size": 12, "inner_time_limit": 1.0}))
    assert solution.feasible, solution.message
    assert solution.objective > problem.cost.sum()                     # it recomputes to fit
    plan = solution.to_plan(problem)
    result = helpers.train_plan(model, loss_fn, batch, plan, graph=graph)
    helpers.assert_same_step(helpers.train_eager(model, loss_fn, batch), result)
    assert solution.predicted_peak_bytes <= budget
    assert solution.predicted_peak_bytes == helpers.simulated_peak(graph, plan.schedule)
    helpers.assert_peak_matches(result.peak, solution.predicted_peak_bytes)
