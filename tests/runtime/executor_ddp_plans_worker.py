"""Two gloo ranks on the CPU (run by tests/runtime/test_executor_ddp.py), each loading another plan for the same
model under DistributedDataParallel: the first step refuses on every rank, naming each rank's plan digest, before
any gradient is all-reduced. Prints `rank R refused: MESSAGE` and `rank R gradients: none` per rank."""

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from memplan import runtime
from gloo_ranks import join, report, spawn
from memplan.runtime.format.plan import Plan, PlanError


def loss_fn(model, x, y):
    return F.cross_entropy(model(x), y)


def worker(rank: int, world: int, port: int) -> None:
    join(rank, world, port)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4))
    batch = (torch.randn(6, 8), torch.randint(0, 4, (6,)))
    graph = runtime.capture(model, loss_fn, batch)
    schedule = runtime.default_plan(graph).schedule
    if rank == 1:                                            # recomputes the first projection once more
        schedule = [schedule[0], *schedule]
    step = runtime.load(Plan(graph.fingerprint, schedule), DDP(model), loss_fn, graph=graph)
    try:
        step(*batch)
    except PlanError as exc:
        report(f"rank {rank} refused: {exc}")
    report(f"rank {rank} gradients: {'none' if all(p.grad is None for p in model.parameters()) else 'some'}")
    del step
    dist.destroy_process_group()


if __name__ == "__main__":
    spawn(worker)
