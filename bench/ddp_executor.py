"""The executor under DistributedDataParallel vs DDP's own backward, on gloo ranks on this CPU, in one run.

    .venv/bin/python -m bench.ddp_executor [--config pipeline.toml] [--model resnet18] [--solver dtr]
                                           [--overhead 0.25] [--bucket-mb 25] [--ranks 2] [--rounds 10]

The model and batch are the pipeline's (`pipeline.toml`: resnet18, batch 8 per rank, each rank its own data).
The parent process captures the step, profiles its nodes, and plans it under DDP (`tasks.solve.core.ddp.under_ddp`
at `--bucket-mb`, DDP's `bucket_cap_mb`): `--solver`'s least-memory schedule within `--overhead` predicted
overhead. Each rank then runs, from the same weights and in interleaved rounds (the order reversed every other
round; round 0 warms up):
- plain DDP: `loss.backward()` through `DistributedDataParallel(model)`;
- DDP with per-block `torch.utils.checkpoint(use_reentrant=False)` on every child of an outermost
  `nn.Sequential` (the residual blocks, transformer layers);
- the executor: `runtime.load(plan, DistributedDataParallel(model), loss_fn)`.
Step times are rank 0's medians (wall clock; the ranks wait for each other in the all-reduces). Peaks are the
dispatch meter's (`PeakMeter("cpu")`, what the memory model counts) on a step after the first; the plan's
predicted peak is beside the executor's measured one.
"""

from __future__ import annotations

import argparse
import copy
import os
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.checkpoint import checkpoint

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from memplan import runtime  # noqa: E402
from bench.peers import profiled_costs  # noqa: E402
from memplan.runtime.measure.meter import PeakMeter  # noqa: E402
from memplan.runtime.format.plan import graph_provenance  # noqa: E402
from memplan.tasks.config import load_config  # noqa: E402
from memplan.tasks.models import build_batch, build_loss, build_model  # noqa: E402
from memplan.tasks.solve.core.ddp import under_ddp  # noqa: E402
from memplan.tasks.solve.core.problem import Problem  # noqa: E402
from memplan.tasks.solve.core.simulator import default_schedule, simulate  # noqa: E402
from memplan.tasks.solve_stage import least_memory_within  # noqa: E402

MiB = 2**20


def checkpoint_blocks(model: nn.Module) -> nn.Module:
    """Every child of an outermost `nn.Sequential` in `model` (not one inside a block already wrapped, such as
    a residual block's downsample) runs under `torch.utils.checkpoint`."""
    wrapped: list[str] = []
    for name, seq in model.named_modules():
        if isinstance(seq, nn.Sequential) and not any(name.startswith(w + ".") for w in wrapped):
            for child, block in seq.named_children():
                block.forward = (lambda f: lambda *a: checkpoint(f, *a, use_reentrant=False))(block.forward)
                wrapped.append(f"{name}.{child}" if name else child)
    return model


def setup(args):
    config = load_config(args.config)
    spec = next(m for m in config.models if m.name == args.model)
    return spec, config.seed, spec.batch_sizes[0]


def plan_under_ddp(args, path: Path) -> None:
    spec, seed, batch_size = setup(args)
    model, loss_fn = build_model(spec, seed), build_loss(spec)
    graph = runtime.capture(model, loss_fn, build_batch(spec, batch_size, seed, "cpu"))
    problem = under_ddp(Problem.from_graph(graph, profiled_costs(graph, args.model)), graph.gradient_updates(),
                        args.bucket_mb)
    solution = least_memory_within(problem, args.solver, args.overhead, simulate(problem, default_schedule(problem)))
    plan = solution.to_plan(problem) if solution.feasible else runtime.Plan(problem.fingerprint,
                                                                             default_schedule(problem))
    plan.provenance.update(graph_provenance(graph))
    plan.predicted["peak_bytes"] = simulate(problem, plan.schedule).peak_bytes
    plan.provenance["schedule_from"] = f"{args.solver} ovh{args.overhead:.0%}" if solution.feasible else "no recomputation"
    plan.save(path)


def worker(rank: int, args, port: int, plan_path: str) -> None:
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=args.ranks)
    spec, seed, batch_size = setup(args)
    base, loss_fn = build_model(spec, seed), build_loss(spec)
    batch = build_batch(spec, batch_size, seed + 1 + rank, "cpu")
    plan = runtime.Plan.load(plan_path)
    models = {"plain DDP": DDP(copy.deepcopy(base), bucket_cap_mb=args.bucket_mb),
              "DDP + per-block checkpoint": DDP(checkpoint_blocks(copy.deepcopy(base)), bucket_cap_mb=args.bucket_mb),
              "executor under DDP": DDP(copy.deepcopy(base), bucket_cap_mb=args.bucket_mb)}
    step = runtime.load(plan, models["executor under DDP"], loss_fn)
    runners = {name: (lambda m: lambda: loss_fn(m, *batch).backward())(m) for name, m in models.items()}
    runners["executor under DDP"] = lambda: step(*batch)
    peaks = {}
    for name, run in runners.items():
        run()                                            # compiles the plan
        models[name].zero_grad(set_to_none=True)
        with PeakMeter("cpu") as meter:
            run()
        peaks[name] = meter.peak_bytes
    times: dict[str, list[float]] = {name: [] for name in runners}
    names = list(runners)
    for r in range(args.rounds + 1):
        for name in names if r % 2 == 0 else names[::-1]:
            models[name].zero_grad(set_to_none=True)
            dist.barrier()
            start = time.perf_counter()
            runners[name]()
            if r:
                times[name].append(time.perf_counter() - start)
    if rank == 0:
        ms = {name: statistics.median(t) * 1e3 for name, t in times.items()}
        lines = [f"{args.model} batch {batch_size} per rank, {args.ranks} gloo ranks on the CPU (1 thread each), "
                 f"bucket_cap_mb {args.bucket_mb}, plan {plan.provenance.get('schedule_from')}, {args.rounds} rounds",
                 f"{'runner':28} {'ms':>8} {'/ plain':>8} {'/ ckpt':>8} {'measured MiB':>13} {'predicted MiB':>14}"]
        for name in runners:
            predicted = f"{plan.predicted['peak_bytes'] / MiB:14.2f}" if name.startswith("executor") else ""
            lines.append(f"{name:28} {ms[name]:8.1f} {ms[name] / ms['plain DDP']:8.3f} "
                         f"{ms[name] / ms['DDP + per-block checkpoint']:8.3f} {peaks[name] / MiB:13.2f} {predicted}")
        lines.append(f"executor measured / predicted peak: {peaks['executor under DDP'] / plan.predicted['peak_bytes']:.4f}")
        sys.stdout.write("\n".join(lines) + "\n")
        sys.stdout.flush()
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="pipeline.toml")
    ap.add_argument("--model", default="resnet18")
    ap.add_argument("--solver", default="dtr")
    ap.add_argument("--overhead", type=float, default=0.25)
    ap.add_argument("--bucket-mb", type=float, default=25.0)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=10)
    args = ap.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "plan.json"
        plan_under_ddp(args, path)
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        mp.spawn(worker, args=(args, port, str(path)), nprocs=args.ranks)


if __name__ == "__main__":
    main()
