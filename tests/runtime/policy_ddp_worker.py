"""Two gloo ranks on the CPU (run by tests/runtime/test_policy_ddp.py): a policy-form model wrapped in
DistributedDataParallel gets, on each rank, the gradients of the same model under DDP without
checkpointing. Prints `rank R max_abs_diff D recomputations N` per rank; exits non-zero on a difference.
`runtime.apply` with an optimizer inside the step is refused on each rank (`rank R optimizer refused: True`)."""

import copy
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from memplan import runtime
from gloo_ranks import join, report, spawn
from memplan.runtime.format.plan import graph_provenance
from memplan.runtime.policy.apply import capture_eager
from memplan.runtime.policy.form import PolicyFormError, Regions, policy_schedule
from memplan.tasks.solve import solve
from memplan.tasks.solve.core.problem import Problem
from memplan.tasks.solve.core.simulator import simulate


class Block(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.up, self.down = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        return x + self.down(F.gelu(self.up(x), approximate="tanh"))


def loss_fn(model, x, y):
    return F.cross_entropy(model(x), y)


def policy_plan(model, batch):
    """The cheapest selective-policy plan within the peak of checkpointing every block whole."""
    graph = capture_eager(model, loss_fn, batch)
    problem = Problem.from_graph(graph)
    regions = Regions.of_graph(graph)
    budget = simulate(problem, policy_schedule(regions, {r: frozenset() for r in regions.members})).peak_bytes
    plan = solve(problem, "selective-policy", budget).to_plan(problem)
    plan.provenance.update(graph_provenance(graph))
    return plan, graph


def grads(model, batch):
    loss_fn(model, *batch).backward()
    return {k: p.grad.clone() for k, p in model.module.named_parameters()}


def worker(rank: int, world: int, port: int) -> None:
    join(rank, world, port)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), *(Block(32) for _ in range(3)), nn.Linear(32, 8))
    torch.manual_seed(1 + rank)                              # each rank its own batch
    batch = (torch.randn(32, 16), torch.randint(0, 8, (32,)))
    plan, graph = policy_plan(model, batch)
    reference = grads(DDP(copy.deepcopy(model)), batch)
    checkpointed = grads(DDP(runtime.apply(plan, copy.deepcopy(model), loss_fn, batch, graph=graph)), batch)
    diff = max((reference[k] - checkpointed[k]).abs().max().item() for k in reference)
    report(f"rank {rank} max_abs_diff {diff:.3g} recomputations {len(plan.schedule) - len(graph.nodes)}")
    in_step = copy.deepcopy(model)
    try:            # each rank would update from its own gradient, before DDP's all-reduce
        runtime.apply(plan, in_step, loss_fn, batch, graph=graph, optimizer=torch.optim.SGD(in_step.parameters()))
    except PolicyFormError as exc:
        report(f"rank {rank} optimizer refused: {'before the all-reduce' in str(exc)}")
    dist.destroy_process_group()
    if diff > 1e-6:
        sys.exit(1)


if __name__ == "__main__":
    spawn(worker)
