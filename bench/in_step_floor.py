"""What bounds the peak of the optimizer inside the step on the CPU, and what would lift that bound (issue 34).

    .venv/bin/python -m bench.in_step_floor [--config pipeline.toml] [--model resnet18] [--optimizer sgd-momentum]
                                            [--solvers dtr hierarchical] [--drop 0.8] [--threads 1]

Two measurements side by side in one run, then simulations:
1. every convolution's weight gradient (`convolution_backward`, output mask [False, True, False], the split the
   graph runs) with oneDNN and with ATen's native kernel (`torch.backends.mkldnn.flags(enabled=False)`):
   summed median CPU time, and the largest scratch beside the gradient (`PeakMeter(allocator=True)`);
2. the in-step problem (`tasks.solve.core.optimizer.in_step`, profiled costs, rule `native` offered) as it is and
   with the two things that lift the bound, each solved by `--solvers` at budget = the outside no-recomputation
   peak - `--drop` x gradient bytes: "input gradient first" is `tasks.solve.core.orders.update_order` (each
   convolution's input-gradient node before its weight-gradient node, so the weight is updated right after its
   gradient, not after the input gradient that reads it); "native weight gradient" fixes rule `native` (ATen's
   native kernel) on the nodes where the profile measured it needing less workspace than oneDNN
   (`tasks.solve.core.fixed_variants.lean_choice`), at its profiled time.
The simulated rows are predictions; `bench/optimizer_in_step.py` runs such plans and measures them.

Recorded (branch instepvar, resnet18 batch 8, sgd-momentum, 1 thread, shared host under load, one profile):
oneDNN 57.6 ms and at most 9.00 MiB of scratch over the 20 weight gradients, the native kernel 67.7 ms and
4.59 MiB (its im2col buffer on the first stage; 0.56 MiB on the last). Cost / outside no-recomputation at
19.72 MiB (dtr, hierarchical): as it is 1.233, 1.150; input gradient first 1.233, 1.151; native weight
gradient 1.127, 1.127; both 1.127, 1.127. The lower bound falls from 18.12 to 9.69 MiB with the native
variant, the no-recomputation peak from 31.63 to 23.13 MiB with both.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from memplan import runtime  # noqa: E402
from bench.peers import profiled_costs  # noqa: E402
from memplan.runtime.measure.meter import PeakMeter  # noqa: E402
from memplan.tasks.config import load_config  # noqa: E402
from memplan.tasks.models import build_batch, build_loss, build_model  # noqa: E402
from memplan.tasks.solve import solve  # noqa: E402
from memplan.runtime.variants.offered import graph_variants  # noqa: E402
from memplan.tasks.solve.core.fixed_variants import fixed_problem, lean_choice  # noqa: E402
from memplan.tasks.solve.core.optimizer import OPTIMIZERS, in_step  # noqa: E402
from memplan.tasks.solve.core.orders import update_order  # noqa: E402
from memplan.tasks.solve.core.problem import Problem  # noqa: E402
from memplan.tasks.solve.core.simulator import default_schedule, simulate  # noqa: E402
from memplan.tasks.solve.core.solution import min_budget_lower_bound  # noqa: E402

MiB = 2**20


def weight_gradient_kernels(model: torch.nn.Module, images: torch.Tensor, repeats: int = 15) -> Table:
    """Measurement 1 (module docstring)."""
    shapes = []
    hooks = [m.register_forward_hook(lambda m, i, o: shapes.append((m, i[0].shape, o.shape)))
             for m in model.modules() if isinstance(m, torch.nn.Conv2d)]
    with torch.no_grad():
        model(images)
    for hook in hooks:
        hook.remove()
    seconds, scratch = {True: 0.0, False: 0.0}, {True: 0, False: 0}
    for conv, in_shape, out_shape in shapes:
        x, grad = torch.randn(in_shape), torch.randn(out_shape)
        weight = conv.weight.detach()

        def weight_gradient():
            return torch.ops.aten.convolution_backward(grad, x, weight, None, conv.stride, conv.padding, conv.dilation,
                                                       False, [0, 0], conv.groups, [False, True, False])

        for onednn in (True, False):
            with torch.backends.mkldnn.flags(enabled=onednn):
                weight_gradient()
                times = []
                for _ in range(repeats):
                    start = time.process_time()
                    weight_gradient()
                    times.append(time.process_time() - start)
                with PeakMeter("cpu", allocator=True) as meter:
                    weight_gradient()
            seconds[onednn] += statistics.median(times)
            scratch[onednn] = max(scratch[onednn], meter.peak_bytes - weight.numel() * weight.element_size())
    table = Table(title=f"The weight gradients of all {len(shapes)} convolutions, measured side by side "
                        f"({repeats} repeats, medians of CPU time)")
    for column in ("kernel", "cpu ms", "largest scratch beside the gradient MiB"):
        table.add_column(column, justify="left" if column == "kernel" else "right")
    for onednn, label in ((True, "oneDNN (the default)"), (False, "ATen native (mkldnn disabled)")):
        table.add_row(label, f"{seconds[onednn] * 1e3:.1f}", f"{scratch[onednn] / MiB:.2f}")
    return table


def what_ifs(problem: Problem) -> dict[str, Problem]:
    """The in-step problem (variants offered) as it is and with the changes of the module docstring."""
    plain, lean = problem.without_variants(), fixed_problem(problem, lean_choice(problem))
    return {"as it is": plain, "input gradient first": dataclasses.replace(plain, order=update_order(plain)),
            "native weight gradient": lean, "both": dataclasses.replace(lean, order=update_order(lean))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="pipeline.toml")
    ap.add_argument("--model", default="resnet18")
    ap.add_argument("--optimizer", default="sgd-momentum", choices=sorted(OPTIMIZERS))
    ap.add_argument("--solvers", nargs="+", default=["dtr", "hierarchical"])
    ap.add_argument("--drop", type=float, default=0.8)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    config = load_config(args.config)
    spec = next(m for m in config.models if m.name == args.model)
    model, loss_fn = build_model(spec, config.seed), build_loss(spec)
    batch = build_batch(spec, spec.batch_sizes[0], config.seed, "cpu")
    console = Console(width=200)
    console.print(weight_gradient_kernels(model, batch[0]))

    graph = runtime.capture(model, loss_fn, batch)
    outside = Problem.from_graph(graph, profiled_costs(graph, args.model), graph_variants(graph, ("native",)))
    base = simulate(outside, default_schedule(outside))
    grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    budget = int(base.peak_bytes - args.drop * grad_bytes)
    table = Table(title=f"{args.model}, optimizer {args.optimizer} inside the step (simulated, profiled costs): "
                        f"budget {budget / MiB:.2f} MiB = outside no-recomputation peak {base.peak_bytes / MiB:.2f} "
                        f"- {args.drop} x gradients {grad_bytes / MiB:.1f} MiB")
    for column in ("problem", "no-recomputation peak MiB", "lower bound MiB",
                   *(f"{s}: cost / outside no-recomputation" for s in args.solvers)):
        table.add_column(column, justify="left" if column == "problem" else "right")
    inside = in_step(outside, graph.gradient_updates(), args.optimizer)
    for label, problem in what_ifs(inside).items():
        cells = []
        for solver in args.solvers:
            solution = solve(problem, solver, budget)
            cells.append(f"{solution.objective / base.compute_cost:.3f}" if solution.feasible else solution.status)
        table.add_row(label, f"{simulate(problem, default_schedule(problem)).peak_bytes / MiB:.2f}",
                      f"{min_budget_lower_bound(problem) / MiB:.2f}", *cells)
    console.print(table)


if __name__ == "__main__":
    main()
