"""MONeT plans (tasks/solve/monet) run through the runtime: a small conv net with ReLU masks trains exactly
like eager PyTorch under `monet` plans at several budgets (and `hierarchical` with `inner = "monet"`), at the
simulator's peak. Only the bit-exact variant rules are offered here (ReLU masks, compact max-pool
indices, in-place ReLU); the rules that are exact within the validation tolerance are checked in test_variant_rules.py."""

import torch
import torch.nn.functional as F
from torch import nn

from memplan import runtime
from memplan.runtime.variants.offered import graph_variants
from memplan.tasks.solve import solve
from memplan.tasks.solve.core.problem import Problem
from memplan.tasks.solve.core.simulator import default_schedule, simulate
from memplan.tasks.solve.core.solution import SolveOptions


class SmallConvNet(nn.Module):
    """conv -> BN -> ReLU -> conv -> ReLU -> max-pool -> linear."""

    def __init__(self):
        super().__init__()
        self.c1, self.bn, self.c2 = nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.Conv2d(8, 8, 3, padding=1)
        self.fc = nn.Linear(8 * 8 * 8, 10)

    def forward(self, x):
        h = F.relu(self.bn(self.c1(x)))
        h = F.max_pool2d(F.relu(self.c2(h)), 2)
        return self.fc(h.flatten(1))


def test_monet_plans_train_exactly_like_eager_at_the_simulated_peak(helpers):
    torch.manual_seed(0)
    model = SmallConvNet().to(helpers.device)
    loss_fn = lambda m, x, y: F.cross_entropy(m(x), y)  # noqa: E731
    batch = (torch.randn(4, 3, 16, 16).to(helpers.device), torch.randint(0, 10, (4,)).to(helpers.device))
    graph = runtime.capture(model, loss_fn, batch)
    problem = Problem.from_graph(graph, None, graph_variants(graph, rules=("mask", "compact", "inplace")))
    eager_peak = simulate(problem, default_schedule(problem)).peak_bytes
    eager = helpers.train_eager(model, loss_fn, batch)
    used_variants = recomputed = in_place = False
    hierarchical = SolveOptions(time_limit=60, portfolio=False, params={"inner": "monet", "inner_time_limit": 2.0})
    for fraction, solution in [
            *((f, solve(problem, "monet", int(f * eager_peak), SolveOptions(time_limit=60, portfolio=False)))
              for f in (0.9, 0.75, 0.7)),
            (0.75, solve(problem, "hierarchical", int(0.75 * eager_peak), hierarchical))]:
        budget = int(fraction * eager_peak)
        assert solution.feasible, (fraction, solution.message)
        if solution.solver == "monet":
            noop = solve(problem, "monet-noop", budget, SolveOptions(time_limit=60, portfolio=False))
            assert not noop.feasible or solution.objective <= noop.objective + 1e-9
        used_variants |= any(len(step) == 3 for step in solution.schedule)
        in_place |= any(len(step) == 3 and step[2].endswith("inplace") for step in solution.schedule)
        recomputed |= solution.objective > problem.cost.sum()
        plan = solution.to_plan(problem)
        result = helpers.train_plan(model, loss_fn, batch, plan, graph=graph)
        helpers.assert_same_step(eager, result, rtol=0, atol=0)
        assert solution.predicted_peak_bytes == simulate(problem, plan.schedule).peak_bytes <= budget
        helpers.assert_peak_matches(result.peak, solution.predicted_peak_bytes)
    assert used_variants and recomputed and in_place
