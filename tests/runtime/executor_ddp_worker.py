"""Two gloo ranks on the CPU (run by tests/runtime/test_executor_ddp.py): a model under DistributedDataParallel
run by the executor with a recomputation plan (several buckets, one parameter DDP ignores) gets, on each rank,
the gradients and buffers of the same model under plain DDP (no checkpointing), and the step's measured peak
is the plan's prediction. Prints `rank R max_abs_diff D recomputations N buckets B unreduced_diff U measured M predicted P`
(U: how far this rank's own, unreduced gradients are from them)
per rank (one write per line); exits non-zero on a difference."""

import copy
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from memplan import runtime
from gloo_ranks import join, report, spawn
from memplan.runtime.measure.meter import PeakMeter
from memplan.tasks.solve import solve
from memplan.tasks.solve.core.ddp import under_ddp
from memplan.tasks.solve.core.problem import Problem
from memplan.tasks.solve.core.simulator import default_schedule, simulate

BUCKET_MB = 0.02                                             # 20 KiB: several buckets on this model
IGNORED = "1.up.bias"


class Block(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.up, self.down = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)
        self.norm = nn.BatchNorm1d(d)

    def forward(self, x):
        return x + self.down(F.gelu(self.up(self.norm(x)), approximate="tanh"))


def loss_fn(model, x, y):
    return F.cross_entropy(model(x), y)


def wrap(model):
    model = copy.deepcopy(model)
    DDP._set_params_and_buffers_to_ignore_for_model(model, [IGNORED])
    return DDP(model, bucket_cap_mb=BUCKET_MB)


def worker(rank: int, world: int, port: int) -> None:
    join(rank, world, port)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), *(Block(32) for _ in range(3)), nn.Linear(32, 8))
    torch.manual_seed(1 + rank)                              # each rank its own batches
    batches = [(torch.randn(256, 16), torch.randint(0, 8, (256,))) for _ in range(2)]
    graph = runtime.capture(model, loss_fn, batches[0])
    problem = under_ddp(Problem.from_graph(graph), graph.gradient_updates(), BUCKET_MB)
    plan = solve(problem, "ap-greedy", int(0.7 * simulate(problem, default_schedule(problem)).peak_bytes)).to_plan(problem)

    reference = wrap(model)
    step = runtime.load(plan, wrap(model), loss_fn, graph=graph)
    ours = step.model
    diff = 0.0
    local = copy.deepcopy(model)                             # this rank's own gradients, not all-reduced
    loss_fn(local, *batches[0]).backward()
    unreduced = None
    for batch in batches:                                    # the second step starts from rank 0's buffers
        reference.zero_grad(set_to_none=True)
        loss_fn(reference, *batch).backward()
        ours.zero_grad(set_to_none=True)
        step.compile(*batch)
        with PeakMeter("cpu") as meter:
            step(*batch)
        for (name, a), b in zip(reference.module.state_dict().items(), ours.state_dict().values()):
            diff = max(diff, (a.float() - b.float()).abs().max().item())
        for (name, a), b in zip(reference.module.named_parameters(), ours.parameters()):
            diff = max(diff, (a.grad - b.grad).abs().max().item())
        if unreduced is None:
            unreduced = max((p.grad - b.grad).abs().max().item() for p, b in zip(local.parameters(), ours.parameters()))
    buckets = sum(map(len, step.gradient_sync.reduce_points(graph, plan, plan.validate(graph),
                                                             graph.program.grad_params).values()))
    report(f"rank {rank} max_abs_diff {diff:.3g} recomputations {len(plan.schedule) - len(graph.nodes)} "
           f"buckets {buckets} unreduced_diff {unreduced:.3g} measured {meter.peak_bytes} "
           f"predicted {plan.predicted['peak_bytes']}")
    dist.destroy_process_group()
    if diff > 1e-5:
        sys.exit(1)


if __name__ == "__main__":
    spawn(worker)
