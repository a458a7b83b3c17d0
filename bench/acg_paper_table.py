"""ACG against Table 2 of Feng & Huang (2021): activation-memory cut-off and time overhead of the
memory-optimal gradient checkpoints, measured with the runtime's meter, side by side with the paper.

    .venv/bin/python bench/acg_paper_table.py                       # CPU, the paper's batches / 8
    .venv/bin/python bench/acg_paper_table.py --batch-divisor 1     # the paper's batches (slow on CPU)
    .venv/bin/python bench/acg_paper_table.py --models resnet50 densenet121 --steps 5

Per model, from the same random weights and batch: one eager training step and one step under the
`acg` plan (mode "memory": the checkpoints minimizing eq. 2), run by the runtime. Activation memory is
the meter's peak of the tensor bytes allocated during the step with the parameter gradients left out
(weights exist before the step and are never counted; the paper also excludes them). Cut-off =
1 - ACG / regular; overhead = median step time of the plan / eager - 1 over interleaved steps timed
without the meter. The step's loss and gradients are checked against eager PyTorch. Inception-v3 runs
without its auxiliary classifier (its output does not reach the loss, so it would get no gradient).

DenseNet-121 is torchvision's: each layer concatenates all earlier features. The capture chains these
concatenations (docs/graph-format.md), which gives the graph of the paper's code, where each layer
returns cat(its input, its new features).
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import torchvision  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from memplan import runtime  # noqa: E402
from memplan.runtime.measure.meter import PeakMeter  # noqa: E402
from memplan.tasks.solve import solve  # noqa: E402
from memplan.tasks.solve.acg.forward import forward_graph  # noqa: E402
from memplan.tasks.solve.core.problem import Problem  # noqa: E402
from memplan.tasks.solve.core.simulator import default_schedule, simulate  # noqa: E402
from memplan.tasks.solve.core.solution import SolveOptions  # noqa: E402

# model: (batch, input size, regular MB, ACG MB, cut-off, time overhead), Table 2 of the paper
PAPER = {
    "vgg16": (64, 224, 5136, 3565, 0.31, 0.32),
    "resnet18": (256, 224, 5635, 3677, 0.35, 0.30),
    "resnet50": (64, 224, 5323, 1973, 0.63, 0.31),
    "resnet101": (32, 224, 3934, 1024, 0.74, 0.35),
    "densenet121": (32, 224, 4027, 898, 0.78, 0.34),
    "inception_v3": (32, 300, 3074, 881, 0.71, 0.29),
}
MB = 2**20


def cross_entropy(model, images, labels):
    return F.cross_entropy(model(images), labels)


def build(name: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if name == "inception_v3":
        return torchvision.models.inception_v3(aux_logits=False, init_weights=False)
    return getattr(torchvision.models, name)()


def activation_peak(model, step) -> tuple[int, torch.Tensor, dict]:
    """One training step of `model` under the meter: its peak without the parameter gradients, the loss
    and the gradients."""
    model.zero_grad(set_to_none=True)
    torch.manual_seed(1)
    with PeakMeter("cpu") as meter:
        loss = step()
    grads = {k: p.grad for k, p in model.named_parameters()}
    return meter.peak_without([g for g in grads.values() if g is not None]), loss.detach(), grads


def median_ms(runs, warmup: int, steps: int) -> list[float]:
    """Median step time (ms) of each (model, step), the runs taking turns step by step."""
    times: list[list[float]] = [[] for _ in runs]
    for i in range(warmup + steps):
        for (model, step), measured in zip(runs, times):
            model.zero_grad(set_to_none=True)
            start = time.perf_counter()
            step()
            if i >= warmup:
                measured.append((time.perf_counter() - start) * 1000)
    return [statistics.median(t) for t in times]


def measure(name: str, divisor: int, warmup: int, steps: int) -> dict:
    paper_batch, size = PAPER[name][:2]
    batch_size = max(1, paper_batch // divisor)
    model = build(name)
    batch = (torch.randn(batch_size, 3, size, size), torch.randint(0, 1000, (batch_size,)))
    start = time.perf_counter()
    graph = runtime.capture(model, cross_entropy, batch)
    capture_s = time.perf_counter() - start
    problem = Problem.from_graph(graph)
    peak = simulate(problem, default_schedule(problem)).peak_bytes
    solution = solve(problem, "acg", peak, SolveOptions(params={"mode": "memory"}))
    plan = solution.to_plan(problem)

    eager_model, plan_model = copy.deepcopy(model), copy.deepcopy(model)
    step = runtime.load(plan, plan_model, cross_entropy, graph=graph)
    step.compile(*batch)

    def eager():
        loss = cross_entropy(eager_model, *batch)
        loss.backward()
        return loss

    def planned():
        return step(*batch)

    regular, eager_loss, eager_grads = activation_peak(eager_model, eager)
    acg, plan_loss, plan_grads = activation_peak(plan_model, planned)
    error = max([float((plan_loss - eager_loss).abs())] +
                [float((plan_grads[k] - g).abs().max()) for k, g in eager_grads.items()])
    eager_ms, plan_ms = median_ms([(eager_model, eager), (plan_model, planned)], warmup, steps)
    return dict(model=name, batch=batch_size, size=size, nodes=len(graph.nodes),
                vertices=forward_graph(problem).dag.n, capture_s=capture_s, solve_s=solution.solve_seconds,
                checkpoints=solution.message.split()[0], regular=regular, acg=acg, cutoff=1 - acg / regular,
                eager_ms=eager_ms, plan_ms=plan_ms, overhead=plan_ms / eager_ms - 1, error=error)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="*", default=list(PAPER), choices=list(PAPER))
    parser.add_argument("--batch-divisor", type=int, default=8, help="batch = the paper's batch / this (default 8)")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per runner (default 3)")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    console = Console(width=220)
    table = Table("model", "batch (paper)", "input", "graph nodes / ACG vertices", "ACG solve s", "checkpoints",
                  "regular MB (paper)", "ACG MB (paper)", "cut-off", "paper cut-off", "cut-off >= paper",
                  "overhead", "paper overhead", "max |plan - eager|",
                  title=f"ACG (memory-optimal checkpoints) vs Feng & Huang 2021 Table 2, CPU, torch {torch.__version__}, "
                        f"{torch.get_num_threads()} threads, {args.steps} timed steps")
    for name in args.models:
        r = measure(name, args.batch_divisor, args.warmup, args.steps)
        paper = PAPER[name]
        console.print(f"{name} batch {r['batch']}: capture {r['capture_s']:.1f} s, ACG {r['solve_s']:.2f} s, activations "
                      f"{r['regular'] / MB:.0f} -> {r['acg'] / MB:.0f} MB (cut-off {r['cutoff']:.0%}, paper {paper[4]:.0%}), "
                      f"step {r['eager_ms']:.0f} -> {r['plan_ms']:.0f} ms ({r['overhead']:+.0%})", style="dim")
        table.add_row(name, f"{r['batch']} ({paper[0]})", f"{r['size']}x{r['size']}", f"{r['nodes']} / {r['vertices']}",
                      f"{r['solve_s']:.2f}", r["checkpoints"], f"{r['regular'] / MB:.0f} ({paper[2]})",
                      f"{r['acg'] / MB:.0f} ({paper[3]})", f"{r['cutoff']:.0%}", f"{paper[4]:.0%}",
                      "yes" if r["cutoff"] >= paper[4] else "no", f"{r['overhead']:+.0%}", f"{paper[5]:+.0%}",
                      f"{r['error']:.1e}")
    console.print(table)


if __name__ == "__main__":
    main()
