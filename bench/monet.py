"""MONeT against its peers and its own ablation (the paper's Fig. 3-4, Table 5), measured side by side in one run.

    .venv/bin/python bench/monet.py [--workloads resnet50 vgg16 mobilenet_v2 gpt2] [--fractions 0.7 0.5 0.4]
                                    [--image 128] [--batch 8] [--rounds 4] [--no-compile] [--curve 600] [--build]

Per workload (random weights, CPU, 1 thread, small inputs): eager PyTorch; `checkpoint_sequential` with
sqrt(n) segments over the model's sequential trunk (GPT-2: per-block `torch.utils.checkpoint`); torch.compile's
min-cut partitioner (`aot_eager_decomp_partition`) with `activation_memory_budget` = each fraction;
memplan `monet` and `checkmate` at each fraction of the eager peak and at the smallest fraction `monet`
reaches. Real models have hundreds of operator nodes, so both memplan solvers run as the inner solver of
`hierarchical` (`inner = "monet"` / `"checkmate"`): the whole-graph MILPs of either do not finish on this
machine (see `--curve`). Every memplan plan is solved on node costs (every implementation variant
included) profiled in the same run, run with `runtime.load` (gradients compared with eager) and measured
with `runtime.measure.meter.PeakMeter`, which also sees torch.compile's code (each budget is compiled by its own
backend: bench/peers.py `budget_backend`); step times are medians of interleaved rounds (bench/peers.py's
helpers). Then the ablation of the paper's Fig. 4: `monet` with no
variants (MONeT-NoOp), with each variant family of `runtime.variants.offered.RULES` alone, and with all.

`--curve SECONDS`: the solve-time curve (incumbent, bound, gap) of whole-graph `monet-noop` on the
ResNet-50 operator graph at `--curve-fraction` (0.7) of its peak, bounded by SECONDS (the issue's target: a 5% gap in 10 minutes).

`--build`: seconds to build MONeT's program (tasks/solve/monet/model.py; best of 3) and its size, `monet-noop` and
`monet` (every variant) on each workload's whole operator graph at 0.7 of its peak (unit costs).
"""

from __future__ import annotations

import argparse
import copy
import math
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from rich.console import Console
from rich.table import Table
from torch.utils.checkpoint import checkpoint_sequential

sys.path.insert(0, str(Path(__file__).resolve().parent))

from memplan import runtime  # noqa: E402
from peers import compiled_step, median_ms, peak_and_grads, profiled_costs, workload  # noqa: E402
from memplan.runtime.variants.offered import RULES, graph_variants  # noqa: E402
from memplan.tasks.solve import solve  # noqa: E402
from memplan.tasks.solve.core.problem import Problem  # noqa: E402
from memplan.tasks.solve.core.simulator import default_schedule, simulate  # noqa: E402
from memplan.tasks.solve.core.solution import SolveOptions, min_budget_lower_bound  # noqa: E402

FRACTIONS = (0.7, 0.5, 0.4)


def bench_workload(name: str, image: int, batch_size: int):
    """(model, loss_fn, batch, sqrt(n)-segment checkpointed step, its label)."""
    if name == "gpt2":
        model, loss_fn, batch, hand, label = workload("gpt2")
        return model, loss_fn, batch, hand, label
    import torchvision

    torch.manual_seed(0)
    model = getattr(torchvision.models, name)(num_classes=10)
    loss_fn = lambda m, x, y: F.cross_entropy(m(x), y)  # noqa: E731
    batch = (torch.randn(batch_size, 3, image, image), torch.randint(0, 10, (batch_size,)))
    hand = copy.deepcopy(model)
    for module in hand.modules():            # checkpointed segments must not modify their saved inputs in place
        if hasattr(module, "inplace"):
            module.inplace = False
    if hasattr(hand, "features"):            # vgg, mobilenet: features -> (avgpool) -> classifier
        trunk = hand.features
        head = lambda x: hand.classifier(torch.flatten(getattr(hand, "avgpool", lambda y: F.adaptive_avg_pool2d(y, 1))(x), 1))  # noqa: E731
    else:                                    # resnet: children up to the pooling, then fc
        trunk = torch.nn.Sequential(*[m for n, m in hand.named_children() if n not in ("avgpool", "fc")])
        head = lambda x: hand.fc(torch.flatten(hand.avgpool(x), 1))  # noqa: E731
    segments = max(1, round(math.sqrt(len(trunk))))

    def sequential_step():
        x = checkpoint_sequential(trunk, segments, batch[0], use_reentrant=False)
        F.cross_entropy(head(x), batch[1]).backward()

    return model, loss_fn, batch, (hand, sequential_step), f"checkpoint_sequential({segments})"


def hierarchical_options(inner: str, limit: float) -> SolveOptions:
    return SolveOptions(time_limit=limit, params={"inner": inner, "inner_time_limit": 5.0})


def bench(name: str, args) -> list[dict]:
    model, loss_fn, batch, (hand, hand_step), hand_label = bench_workload(name, args.image, args.batch)
    graph = runtime.capture(model, loss_fn, batch)
    costs = profiled_costs(graph, name)
    problem = Problem.from_graph(graph, costs, graph_variants(graph))
    full = simulate(problem, default_schedule(problem)).peak_bytes
    runs = {"eager": (model, lambda: loss_fn(model, *batch).backward()), hand_label: (hand, hand_step)}
    points = {"eager": {"kind": "pytorch"}, hand_label: {"kind": "pytorch"}}

    def plan(label: str, solver: str, prob: Problem, budget: int, options: SolveOptions, kind: str) -> bool:
        start = time.perf_counter()
        sol = solve(prob, solver, budget, options)
        if not sol.feasible:
            lower = min_budget_lower_bound(prob) / full
            print(f"{name}: {label}: no plan ({sol.status}; no schedule fits below {lower:.3f} of the peak, "
                  f"a bound): {sol.message}"[:400])
            return False
        planned = copy.deepcopy(model)
        step = runtime.load(sol.to_plan(prob), planned, loss_fn, graph=graph)
        runs[label] = (planned, lambda step=step: step(*batch))
        points[label] = {"kind": kind, "solve_s": time.perf_counter() - start, "source": sol.source or solver,
                         "variants": sum(1 for s in sol.schedule if len(s) > 2)}
        return True

    smallest = None
    for fraction in (0.4, 0.3, 0.25, 0.2):
        sol = solve(problem, "hierarchical", int(fraction * full), hierarchical_options("monet", args.limit))
        if sol.feasible:
            smallest = sol.predicted_peak_bytes / full
    fractions = [*args.fractions, *([smallest] if smallest and smallest < min(args.fractions) - 1e-3 else [])]
    for f in fractions:
        for solver, inner in (("monet", "monet"), ("checkmate", "checkmate")):
            plan(f"{solver} @ {f:.2f}", "hierarchical", problem, int(f * full), hierarchical_options(inner, args.limit),
                 "memplan")
        if args.compile:
            try:
                compiled, step = compiled_step(model, loss_fn, batch, f)
                runs[f"torch.compile budget {f:.2f}"] = (compiled, step)
                points[f"torch.compile budget {f:.2f}"] = {"kind": "pytorch"}
            except Exception as exc:  # noqa: BLE001 - a peer that cannot compile is reported, not fatal
                print(f"{name}: torch.compile at {f:.2f} failed: {type(exc).__name__}: {exc}"[:300])
    # ablation (Fig. 4): no variants, each family alone, all, at the middle fraction
    ab = args.fractions[len(args.fractions) // 2]
    families = {"none": ()} | {rule: (rule,) for rule in RULES} | {"all": tuple(RULES)}
    for family, rules in families.items():
        variants = graph_variants(graph, rules) if rules else None
        prob = Problem.from_graph(graph, costs, variants)
        plan(f"ablation {family} @ {ab:.2f}", "hierarchical", prob, int(ab * full), hierarchical_options("monet", args.limit),
             "ablation")
    eager_peak, eager_grads = peak_and_grads(model, runs["eager"][1])
    for label, (m, step) in runs.items():
        peak, grads = peak_and_grads(m, step)
        points[label] |= {"peak": peak / eager_peak,
                          "err": max(float((a - b).abs().max()) for a, b in zip(eager_grads, grads))}
    for label, ms in median_ms(runs, args.rounds).items():
        points[label]["ms"] = ms
    eager_ms = points["eager"]["ms"]
    return [{"label": k, **v, "time": v["ms"] / eager_ms} for k, v in points.items()]


def solve_curve(seconds: float, fraction: float, image: int, batch_size: int, console: Console) -> None:
    """Whole-graph monet-noop on the ResNet-50 operator graph at `fraction` of its peak (unit costs), bounded."""
    model, loss_fn, batch, _, _ = bench_workload("resnet50", image, batch_size)
    graph = runtime.capture(model, loss_fn, batch)
    problem = Problem.from_graph(graph)
    full = simulate(problem, default_schedule(problem)).peak_bytes
    start = time.perf_counter()
    sol = solve(problem, "monet-noop", int(fraction * full), SolveOptions(time_limit=seconds, portfolio=False, threads=1))
    table = Table("seconds", "incumbent", "bound", "gap",
                  title=f"monet-noop on ResNet-50 ({problem.num_nodes} operator nodes) at {fraction}x peak: "
                        f"{sol.num_variables} variables, {sol.num_constraints} rows, {sol.backend}, status {sol.status}, "
                        f"{time.perf_counter() - start:.0f} s")
    for p in sol.progress:
        table.add_row(f"{p.seconds:.1f}", f"{p.incumbent:.6g}" if p.incumbent is not None else "-",
                      f"{p.bound:.6g}" if p.bound is not None else "-", f"{p.gap:.3%}" if p.gap is not None else "-")
    console.print(table)
    five = next((p.seconds for p in sol.progress if p.gap is not None and p.gap <= 0.05), None)
    console.print(f"5% gap reached: {'at %.0f s' % five if five is not None else 'no'}; final objective "
                  f"{sol.objective} (no recomputation: {problem.cost.sum():.0f}), gap {sol.gap}")


def build_table(workloads: list[str], image: int, batch_size: int, console: Console) -> None:
    """Build time and size of MONeT's whole-graph program per workload, without and with variants."""
    from memplan.tasks.solve.monet.model import build_model

    table = Table("workload", "solver", "nodes", "rows", "columns (integer)", "nonzeros", "build s",
                  title="MONeT's program on the whole operator graph at 0.7x peak (best of 3 builds)")
    for name in workloads:
        model, loss_fn, batch, _, _ = bench_workload(name, image, batch_size)
        graph = runtime.capture(model, loss_fn, batch)
        for solver, problem in (("monet-noop", Problem.from_graph(graph)),
                                ("monet", Problem.from_graph(graph, variants=graph_variants(graph)))):
            budget = int(0.7 * simulate(problem, default_schedule(problem)).peak_bytes)
            seconds = []
            for _ in range(3):
                start = time.perf_counter()
                milp, layout = build_model(problem, budget)
                seconds.append(time.perf_counter() - start)
            table.add_row(name, solver, str(problem.num_nodes), str(milp.num_constraints),
                          f"{milp.num_variables} ({layout.num_vars})", str(milp.num_nonzeros), f"{min(seconds):.3f}")
    console.print(table)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workloads", nargs="+", default=["resnet50", "vgg16", "mobilenet_v2", "gpt2"])
    ap.add_argument("--fractions", nargs="+", type=float, default=list(FRACTIONS))
    ap.add_argument("--image", type=int, default=128)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--limit", type=float, default=300.0, help="seconds per memplan solve")
    ap.add_argument("--no-compile", dest="compile", action="store_false")
    ap.add_argument("--curve", type=float, default=0.0, help="seconds for the monet-noop solve-time curve (0: skip)")
    ap.add_argument("--curve-fraction", type=float, default=0.7, help="budget of the curve, as a fraction of the peak")
    ap.add_argument("--build", action="store_true", help="only time building MONeT's program on each workload's graph")
    args = ap.parse_args()
    torch.set_num_threads(1)
    console = Console(width=200)
    if args.curve:
        solve_curve(args.curve, args.curve_fraction, args.image, args.batch, console)
        return
    if args.build:
        build_table(args.workloads, args.image, args.batch, console)
        return
    for name in args.workloads:
        rows = bench(name, args)
        table = Table("point", "peak / eager", "time / eager", "step ms", "max |grad diff|", "solve s", "variant steps",
                      "schedule from",
                      title=f"{name}: CPU, 1 thread, batch {args.batch if name != 'gpt2' else 4}, median of {args.rounds} interleaved rounds")
        for r in sorted(rows, key=lambda r: (r["kind"] == "ablation", r["peak"])):
            table.add_row(r["label"], f"{r['peak']:.3f}", f"{r['time']:.3f}", f"{r['ms']:.0f}", f"{r['err']:.2g}",
                          f"{r['solve_s']:.1f}" if "solve_s" in r else "", str(r.get("variants", "")), r.get("source", ""))
        console.print(table)
        monet = {r["label"].split("@ ")[1]: r for r in rows if r["label"].startswith("monet @")}
        for f, r in monet.items():
            peers = [p for p in rows if p["kind"] in ("pytorch", "memplan") and p["label"] != "eager"
                     and not p["label"].startswith("monet") and p["time"] <= r["time"] + 1e-9 and p["peak"] < r["peak"]]
            console.print(f"monet @ {f}: {r['peak']:.3f}x peak at {r['time']:.3f}x time; peers with less memory at no "
                          f"more time: " + (", ".join(p["label"] for p in peers) or "none"))


if __name__ == "__main__":
    main()
