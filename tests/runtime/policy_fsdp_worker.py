"""Two gloo ranks on the CPU (run by tests/runtime/test_policy_fsdp.py): a tiny GPT-2 with a policy plan
applied, then sharded with FSDP2 (`fully_shard` per transformer block, then the root), trains for a few
AdamW steps to the same parameter shards on each rank as the same model under FSDP2 without
checkpointing. Prints `rank R max_abs_diff D recomputations N peak P predicted Q reference_peak E
reference_predicted F` per rank: the measured peaks of one step (forward and backward, bytes) with and
without the plan, and the simulator's peaks of the plan and of no recomputation; exits non-zero on a
difference."""

import copy
import sys

import torch
import torch.distributed as dist
import transformers
from torch.distributed.fsdp import fully_shard

from memplan import runtime
from gloo_ranks import join, report, spawn
from memplan.runtime.measure.meter import PeakMeter
from memplan.runtime.format.plan import graph_provenance
from memplan.runtime.policy.apply import capture_eager
from memplan.runtime.policy.form import Regions, policy_schedule
from memplan.tasks.solve import solve
from memplan.tasks.solve.core.problem import Problem
from memplan.tasks.solve.core.simulator import default_schedule, simulate

STEPS = 3


def loss_fn(model, ids):
    return model(input_ids=ids, attention_mask=torch.ones_like(ids), labels=ids).loss


def gpt2() -> transformers.GPT2LMHeadModel:
    config = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=128, n_positions=32, bos_token_id=0,
                                     eos_token_id=0, use_cache=False, activation_function="gelu_pytorch_tanh")
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(config).train()      # dropout on: checkpoint must redraw the same masks


def policy_plan(model, batch):
    """The cheapest selective-policy plan within the peak of checkpointing every block whole, its graph, and
    the predicted peak of no recomputation."""
    graph = capture_eager(model, loss_fn, batch)
    problem = Problem.from_graph(graph)
    regions = Regions.of_graph(graph)
    budget = simulate(problem, policy_schedule(regions, {r: frozenset() for r in regions.members})).peak_bytes
    plan = solve(problem, "selective-policy", budget).to_plan(problem)
    plan.provenance.update(graph_provenance(graph))
    return plan, graph, simulate(problem, default_schedule(problem)).peak_bytes


def sharded(model):
    for block in model.transformer.h:
        fully_shard(block)
    return fully_shard(model)


def train(model, batch, rank):
    """Parameter shards after STEPS AdamW steps, and the peak of the first step's forward and backward."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    peak = 0
    for step in range(STEPS):
        optimizer.zero_grad()
        torch.manual_seed(100 * step + rank)                     # the same dropout draws in both runs
        with PeakMeter("cpu") as meter:
            loss_fn(model, *batch).backward()
        peak = peak or meter.peak_bytes
        optimizer.step()
    return {k: p.to_local().detach().clone() for k, p in model.named_parameters()}, peak


def worker(rank: int, world: int, port: int) -> None:
    join(rank, world, port)
    model = gpt2()
    torch.manual_seed(1 + rank)                                  # each rank its own batch
    batch = (torch.randint(0, 128, (8, 32)),)
    plan, graph, reference_predicted = policy_plan(model, batch)
    reference, reference_peak = train(sharded(copy.deepcopy(model)), batch, rank)
    # The order that works: runtime.apply on the whole model, then fully_shard.
    applied = runtime.apply(plan, copy.deepcopy(model), loss_fn, batch, graph=graph)
    checkpointed, peak = train(sharded(applied), batch, rank)
    diff = max((reference[k] - checkpointed[k]).abs().max().item() for k in reference)
    report(f"rank {rank} max_abs_diff {diff:.3g} recomputations {len(plan.schedule) - len(graph.nodes)} "
           f"peak {peak} predicted {plan.predicted['peak_bytes']} reference_peak {reference_peak} "
           f"reference_predicted {reference_predicted}")
    dist.destroy_process_group()
    if diff > 1e-6:
        sys.exit(1)


if __name__ == "__main__":
    spawn(worker)
