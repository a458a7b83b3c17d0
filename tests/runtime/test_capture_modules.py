"""Module boundaries recorded at capture (runtime/tracing/modules.py): which modules, which nodes, the graph
unchanged by the markers, and a per-module checkpointing plan that trains like eager."""

import torch
from torch import nn

from memplan import runtime
from memplan.runtime.tracing.modules import marked_modules
from memplan.tasks.solve import solve
from memplan.tasks.solve.baselines import module_instances
from memplan.tasks.solve.core.problem import Problem
from memplan.tasks.solve.core.simulator import default_schedule, simulate
from memplan.tasks.solve.core.solution import SolveOptions


class Residual(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.lin = nn.Linear(d, d)

    def forward(self, x):
        return x + torch.tanh(self.lin(x))


def test_outermost_children_of_containers_are_marked():
    model = nn.Sequential(nn.Linear(4, 8), nn.Sequential(Residual(8), Residual(8)), nn.Linear(8, 2))
    assert list(marked_modules(model)) == ["0", "1", "2"]
    holder = nn.Module()
    holder.stem, holder.layers = nn.Linear(4, 8), nn.ModuleList([Residual(8), Residual(8)])
    assert list(marked_modules(holder)) == ["layers.0", "layers.1"]


def test_boundaries_tag_each_layers_forward_nodes_and_leave_the_graph_unchanged():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), Residual(8), Residual(8), nn.Linear(8, 2))
    loss_fn = lambda m, x: m(x).square().mean()  # noqa: E731
    batch = (torch.randn(3, 4),)
    graph = runtime.capture(model, loss_fn, batch)
    bare = runtime.capture(model, loss_fn, batch, record_modules=False)
    assert graph.fingerprint == bare.fingerprint and "node_modules" not in bare.meta
    modules = graph.meta["node_modules"]
    forward = [n for n in graph.nodes if n.phase == "forward"]
    names = [modules[n.id] for n in forward]
    assert list(dict.fromkeys(names)) == ["0", "1", "2", "3"]
    assert names == sorted(names)                                       # each module's nodes contiguous
    assert all(modules[n.id] is None for n in graph.nodes if n.phase == "backward")
    tanh = [n.id for n in forward if "aten.tanh.default" in n.targets]
    assert [modules[i] for i in tanh] == ["1", "2"]


def test_gpt2_layers_are_recorded_and_checkpointing_them_trains_like_eager(captured, helpers):
    model, loss_fn, batch, graph = captured("gpt2")
    problem = Problem.from_graph(graph)
    runs = module_instances(problem)
    assert [problem.node_modules[r[0]] for r in runs] == ["transformer.h.0", "transformer.h.1"]
    eager = simulate(problem, default_schedule(problem))
    sol = solve(problem, "module-checkpoint", eager.peak_bytes, SolveOptions(params={"every": 1}))
    forward_cost = problem.cost[problem.is_recomputable].sum()
    assert problem.cost.sum() < sol.objective <= problem.cost.sum() + forward_cost
    assert sol.predicted_peak_bytes < eager.peak_bytes
    plan = sol.to_plan(problem)
    result = helpers.train_plan(model, loss_fn, batch, plan, graph=graph)
    helpers.assert_same_step(helpers.train_eager(model, loss_fn, batch), result)
    helpers.assert_peak_matches(result.peak, sol.predicted_peak_bytes)


class ConvBlock(nn.Module):
    def __init__(self, c: int):
        super().__init__()
        self.conv, self.bn = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)

    def forward(self, x):
        return torch.relu(self.bn(self.conv(x)))


def test_batchnorm_running_statistics_do_not_cut_a_checkpointed_block():
    """BatchNorm's running statistics are graph outputs made inside each block: the blocks' outputs alone are
    kept, each block is recomputed once, and the peak drops below checkpoint-all's (it did not on ResNet-50
    while the statistics counted as checkpoints), at eager's gradients."""
    from memplan.tasks.solve.baselines import module_checkpoints

    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), *(ConvBlock(8) for _ in range(4)), nn.Flatten(),
                          nn.Linear(8 * 16 * 16, 2))
    loss_fn = lambda m, x: m(x).square().mean()  # noqa: E731
    batch = (torch.randn(16, 3, 16, 16),)
    problem = Problem.from_graph(runtime.capture(model, loss_fn, batch))
    runs = module_instances(problem)
    assert len(runs) == 6
    inside = {node for run in runs[1:5] for node in run}
    kept_inside = {v for v in module_checkpoints(problem, 1) if problem.value_producer[v] in inside}
    block_outputs = {v for run in runs[1:5] for v in problem.node_outputs[run[-1]]}
    assert kept_inside == block_outputs
    eager = simulate(problem, default_schedule(problem))
    sol = solve(problem, "module-checkpoint", eager.peak_bytes, SolveOptions(params={"every": 1}))
    computed = [s[1] for s in sol.schedule if s[0] == "compute"]
    assert max(computed.count(n) for n in inside) == 2 and sol.predicted_peak_bytes < 0.8 * eager.peak_bytes


class TwiceCalled(nn.Module):
    """A layer whose activation module runs twice in one forward (as ResNet's BasicBlock does with its ReLU)."""

    def __init__(self, d: int):
        super().__init__()
        self.first, self.second, self.act = nn.Linear(d, d), nn.Linear(d, d), nn.Tanh()

    def forward(self, x):
        return x + self.act(self.second(self.act(self.first(x))))


def test_each_layers_children_are_recorded_as_its_parts_unless_called_twice():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), TwiceCalled(8), TwiceCalled(8))
    loss_fn, batch = (lambda m, x: m(x).square().mean()), (torch.randn(3, 4),)
    graph = runtime.capture(model, loss_fn, batch, record_parts=True)
    assert "node_parts" not in runtime.capture(model, loss_fn, batch).meta          # only where asked
    assert graph.fingerprint == runtime.capture(model, loss_fn, batch, record_modules=False).fingerprint
    modules, parts = graph.meta["node_modules"], graph.meta["node_parts"]
    forward = [n for n in graph.nodes if n.phase == "forward" and modules[n.id] is not None]
    assert {parts[n.id] for n in forward} == {None, "1.first", "1.second", "2.first", "2.second"}
    assert all(parts[n.id].startswith(modules[n.id] + ".") for n in forward if parts[n.id])
    assert all(parts[n.id] is None for n in forward if "aten.tanh.default" in n.targets)   # act runs twice
    assert all(parts[n.id] is None for n in graph.nodes if n.phase == "backward")
    linears = [parts[n.id] for n in forward if any(t.startswith("aten.addmm") for t in n.targets)]
    assert linears == [None, "1.first", "1.second", "2.first", "2.second"]          # "0" is a Linear: no parts
