"""The optimizer inside the step vs after it: measured peak and step time, side by side in one run.

    .venv/bin/python bench/optimizer_in_step.py [--config pipeline.toml] [--model resnet18]
                                                [--optimizer sgd-momentum] [--solvers dtr ap-greedy acg]
                                                [--overheads 0.05 0.25] [--rounds 12] [--threads 1]

The model, batch and solvers are the pipeline's (`pipeline.toml`: resnet18, batch 8). Node costs are profiled
in the same run. Runners, each a full training step with the optimizer (`--optimizer`: torch.optim.SGD with
momentum 0.9, or AdamW), from the same weights:
- eager: `loss.backward(); opt.step(); opt.zero_grad()`;
- per solver and overhead limit (`max_overhead`, the pipeline's plans), the plan solved with the optimizer
  outside (`runtime.load(plan, ...)` then `opt.step()`) and the plan solved with it inside
  (`tasks.solve.core.optimizer.in_step`, run by `runtime.load(plan, ..., optimizer=opt)`), at the same limit;
- the no-recomputation plan, outside and inside.
Peaks are `PeakMeter(allocator=True)` on a step after the first (the optimizer state resident, as the plans
predict). Step times (wall clock, and process CPU time, less sensitive to other jobs on a shared host) are
medians over `--rounds` interleaved rounds (the order reversed every other round).
"drop / grads" is how much lower the peak is than the same solver's plan at the same limit with the optimizer
outside, "eager drop / grads" than eager's, as a fraction of the parameter-gradient bytes (target >= 0.8);
"time / outside" the step time ratio to that plan (target <= 1.03).
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import runtime  # noqa: E402
from bench.peers import profiled_costs  # noqa: E402
from runtime.meter import PeakMeter  # noqa: E402
from tasks.config import load_config  # noqa: E402
from tasks.models import build_batch, build_loss, build_model  # noqa: E402
from tasks.solve.core.optimizer import OPTIMIZERS, in_step  # noqa: E402
from tasks.solve.core.problem import Problem  # noqa: E402
from tasks.solve.core.simulator import default_schedule, simulate  # noqa: E402
from tasks.solve_stage import least_memory_within  # noqa: E402

MiB = 2**20


def make_optimizer(name: str, model: torch.nn.Module) -> torch.optim.Optimizer:
    spec = OPTIMIZERS[name]
    return getattr(torch.optim, spec.torch_class)(model.parameters(), lr=0.01, **dict(spec.torch_kwargs))


def plans(problem: Problem, solvers: list[str], overheads: list[float]) -> dict[str, runtime.Plan]:
    """The no-recomputation plan and each solver's least-memory plan within each overhead limit."""
    eager = simulate(problem, default_schedule(problem))
    found = {"no recomputation": runtime.Plan(problem.fingerprint, default_schedule(problem))}
    for solver in solvers:
        for overhead in overheads:
            solution = least_memory_within(problem, solver, overhead, eager)
            if solution.feasible:
                found[f"{solver} ovh{overhead:.0%}"] = solution.to_plan(problem)
    for plan in found.values():
        plan.predicted["peak_bytes"] = simulate(problem, plan.schedule).peak_bytes
    return found


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="pipeline.toml")
    ap.add_argument("--model", default="resnet18")
    ap.add_argument("--optimizer", default="sgd-momentum", choices=sorted(OPTIMIZERS))
    ap.add_argument("--solvers", nargs="+", default=["dtr", "ap-greedy", "acg"])
    ap.add_argument("--overheads", nargs="+", type=float, default=[0.05, 0.25])
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    config = load_config(args.config)
    spec = next(m for m in config.models if m.name == args.model)
    batch_size = spec.batch_sizes[0]
    base, loss_fn = build_model(spec, config.seed), build_loss(spec)
    batch = build_batch(spec, batch_size, config.seed, "cpu")
    graph = runtime.capture(base, loss_fn, batch)
    outside = Problem.from_graph(graph, profiled_costs(graph, args.model))
    inside = in_step(outside, graph.gradient_updates(), args.optimizer)
    grad_bytes = sum(p.numel() * p.element_size() for p in base.parameters())

    runners: dict[str, tuple] = {}             # label -> (model, step, predicted peak, plan label, inside?)
    eager_model = copy.deepcopy(base)
    eager_opt = make_optimizer(args.optimizer, eager_model)

    def eager_step() -> None:
        loss_fn(eager_model, *batch).backward()
        eager_opt.step()
        eager_opt.zero_grad(set_to_none=True)

    runners["eager"] = (eager_step, None, None, False)
    for where, problem in (("outside", outside), ("inside", inside)):
        for label, plan in plans(problem, args.solvers, args.overheads).items():
            model = copy.deepcopy(base)
            opt = make_optimizer(args.optimizer, model)
            if where == "inside":
                step = runtime.load(plan, model, loss_fn, graph=graph, optimizer=opt)
                run = (lambda s: lambda: s(*batch))(step)
            else:
                step = runtime.load(plan, model, loss_fn, graph=graph)
                run = (lambda s, o: lambda: (s(*batch), o.step(), o.zero_grad(set_to_none=True)))(step, opt)
            runners[f"{label}, {where}"] = (run, plan.predicted["peak_bytes"], label, where == "inside")

    peaks = {}
    for name, (run, *_) in runners.items():
        run()                                  # compiles the plan, makes the optimizer state
        with PeakMeter("cpu", allocator=True) as meter:
            run()
        peaks[name] = meter.peak_bytes
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in runners}
    names = list(runners)
    for r in range(args.rounds + 1):
        for name in names if r % 2 == 0 else names[::-1]:
            start, cpu = time.perf_counter(), time.process_time()
            runners[name][0]()
            if r:                               # round 0 warms up
                times[name].append((time.perf_counter() - start, time.process_time() - cpu))

    ms = {name: statistics.median(w for w, _ in t) * 1e3 for name, t in times.items()}
    cpu_ms = {name: statistics.median(c for _, c in t) * 1e3 for name, t in times.items()}
    table = Table(title=f"{args.model} batch {batch_size} ({args.config}), optimizer {args.optimizer} "
                        f"({OPTIMIZERS[args.optimizer].torch_class}), CPU, {torch.get_num_threads()} thread(s), "
                        f"{args.rounds} interleaved rounds; parameter gradients {grad_bytes / MiB:.1f} MiB")
    for column in ("runner", "predicted MiB", "measured MiB", "peak / eager", "drop / grads", "eager drop / grads",
                   "ms", "time / eager", "time / outside", "cpu ms", "cpu / outside"):
        table.add_column(column, justify="left" if column == "runner" else "right")
    for name, (_, predicted, label, is_inside) in runners.items():
        outside_name = f"{label}, outside"
        drop = time_ratio = cpu_ratio = ""
        if is_inside and outside_name in runners:
            drop = f"{(peaks[outside_name] - peaks[name]) / grad_bytes:.2f}"
            time_ratio = f"{ms[name] / ms[outside_name]:.3f}"
            cpu_ratio = f"{cpu_ms[name] / cpu_ms[outside_name]:.3f}"
        eager_drop = f"{(peaks['eager'] - peaks[name]) / grad_bytes:.2f}" if is_inside else ""
        table.add_row(name, "" if predicted is None else f"{predicted / MiB:.1f}", f"{peaks[name] / MiB:.1f}",
                      f"{peaks[name] / peaks['eager']:.3f}", drop, eager_drop, f"{ms[name]:.1f}",
                      f"{ms[name] / ms['eager']:.3f}", time_ratio, f"{cpu_ms[name]:.1f}", cpu_ratio)
    Console(width=230).print(table)


if __name__ == "__main__":
    main()
