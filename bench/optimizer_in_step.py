"""The optimizer inside the step vs after it: measured peak and step time, side by side in one run.

    .venv/bin/python -m bench.optimizer_in_step [--config pipeline.toml] [--model resnet18]
                                                [--optimizers sgd-momentum adamw] [--solvers dtr ap-greedy acg]
                                                [--overheads 0.05 0.25] [--target-solvers dtr hierarchical]
                                                [--variants all] [--rounds 12] [--threads 1]

The model, batch and solvers are the pipeline's (`pipeline.toml`: resnet18, batch 8). Node costs are profiled
once in the same run, every implementation variant of `--variants` (`tasks.problems.VARIANT_RULES`, the plan
setting `variants`; default "all", as the pipeline's plans) with them, so solvers that choose variants may run
them (the weight gradients by ATen's native kernel, rule `native`, on resnet18). Per optimizer (`--optimizers`: torch.optim.SGD with momentum 0.9, AdamW, ...), runners,
each a full training step with the optimizer, from the same weights, measured together:
- eager: `loss.backward(); opt.step(); opt.zero_grad()`;
- per solver and overhead limit (`max_overhead`, the pipeline's plans), the plan solved with the optimizer
  outside (`runtime.load(plan, ...)` then `opt.step()`) and the plan solved with it inside
  (`tasks.solve.core.optimizer.in_step`, run by `runtime.load(plan, ..., optimizer=opt)`), at the same limit;
- the no-recomputation plan, outside and inside; inside with "whole updates" (`update_slice_bytes=None`: no
  parameter updated in slices, runtime.format.schedule.UPDATE_SLICE_BYTES; its prediction is the unsliced problem's):
  its "time / outside" against the sliced row's is what slicing costs; and inside "via step()": each update
  through `Optimizer.step()` of the class (a subclass of it, updated whole) rather than its functional API
  (runtime.execute.optim_functional), the form before; its "time / outside" against the whole-updates row's is what the
  functional updates save;
- "at target": the in-step problem solved at budget = the outside no-recomputation step's measured peak (its
  optimizer's temporaries included) - 0.8 x the parameter-gradient bytes by each of `--target-solvers`, in the
  problem's order and in `update_order` (each convolution's input gradient before its weight gradient, so the
  weight is updated in the step that makes its gradient), the plan of least predicted cost.
Peaks are `PeakMeter(allocator=True)` on a step after the first (the optimizer state resident, as the plans
predict). Step times (wall clock, and process CPU time, less sensitive to other jobs on a shared host) are
medians over `--rounds` interleaved rounds (the order reversed every other round), beside the median minor
page faults of a step (fresh pages the allocator maps for the step's large tensors cost time too, and
differently for the two forms: glibc's adaptive mmap threshold; `MALLOC_MMAP_THRESHOLD_=1073741824
MALLOC_TRIM_THRESHOLD_=1073741824` in the environment keeps them in the heap, for all runners alike).
"drop / grads" is how much lower the peak is than the same solver's plan at the same limit with the optimizer
outside (for "at target": than the outside no-recomputation step), "eager drop / grads" than eager's, as a
fraction of the parameter-gradient bytes (target >= 0.8); "time / outside" the step time ratio to that plan
(target <= 1.03). The last tables repeat the target comparison per optimizer and say what is alive at the
in-step peaks (gradients, other values, and the rest of the peak: the step's scratch) beside the floor no
schedule goes below (`min_budget_lower_bound`: the leanest compute step, or the largest update alone) and
that update floor (the largest parameter's gradient and its update's temporaries).

Recorded (branch instepvar, torch 2.14.1, CPU, 1 thread, 20 rounds, target rows; a shared 2-core host at load
7-9 from other jobs, so wall times move 30% between runs: the same no-recomputation in-step plan measured
1.01x and 1.33x its outside step in two runs; "before" is b3a922a, run right after in the same session;
measured peak = predicted in every in-step row):
    sgd-momentum, glibc defaults   before: hierarchical, 0.80 at 1.179x wall, 1.257x CPU
                                   after:  dtr, 14 recomputations, 11 native weight gradients, 62 of 62
                                           parameters updated in the step making their gradient:
                                           0.80 at 0.880x wall, 0.888x CPU (2784 page faults, outside 16096)
    sgd-momentum, MALLOC_*_THRESHOLD_ as above (no fresh pages for anyone)
                                   before: 0.80 at 1.179x wall, 1.177x CPU (no recomputation inside: 1.039x CPU)
                                   after:  0.80 at 1.262x wall, 1.117x CPU (no recomputation inside: 1.122x CPU)
    adamw: no plan before or after: the budget (26.53 MiB) is below the update floor (27.00 MiB: layer4's
    9 MiB weight gradient and the single-tensor AdamW temporaries, 2x its bytes, while it is updated).
With page faults equalized the plan at target costs what the no-recomputation in-step step costs: what
remains above 1.03x is the per-update cost of the optimizer inside the step, not recomputation.

Recorded (branch adamslices: parameters over 1 MiB updated in 1 MiB slices, torch 2.14.1, CPU, 1 thread, 12
rounds, `--optimizers adamw --solvers dtr --overheads 0.05`, a shared 2-core host at load ~2; each run profiles
anew, so its plans may differ; measured peak = predicted in every in-step row, the update floor 11.00 MiB):
    adamw, glibc defaults          at target: dtr, 0 recomputations, 11 native weight gradients, 62 of 62
                                   parameters updated in the step making their gradient: 24.5 MiB,
                                   0.85 at 0.747x wall, 0.753x CPU (4576 page faults, outside 27552;
                                   an earlier run: 0.762x wall, 0.778x CPU);
                                   no recomputation inside: sliced 0.988x CPU, whole updates 1.053x CPU
    adamw, MALLOC_*_THRESHOLD_     at target: the same plan, 0.85 at 1.043x wall, 1.058x CPU; no recomputation
                                   inside: sliced 1.038x CPU, whole updates 1.052x, via step() 1.068x
                                   (a second run's profile offered no native kernel there: dtr, 21
                                   recomputations, 26.4 MiB, 0.80 at 1.264x wall, 1.054x CPU; sliced 1.012x
                                   CPU, whole 1.013x)
The AdamW target row is feasible now and meets the drop; its time stays above 1.03x with page faults equalized
by the optimizer's in-step cost, as for SGD; slicing does not add to it.
"""

from __future__ import annotations

import argparse
import collections
import copy
import dataclasses
import itertools
import resource
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from memplan import runtime  # noqa: E402
from bench.peers import profiled_problem  # noqa: E402
from memplan.runtime.measure.meter import PeakMeter  # noqa: E402
from memplan.runtime.format.schedule import update_steps  # noqa: E402
from memplan.tasks.config import load_config  # noqa: E402
from memplan.tasks.models import build_batch, build_loss, build_model  # noqa: E402
from memplan.tasks.problems import VARIANT_RULES  # noqa: E402
from memplan.tasks.solve import solve  # noqa: E402
from memplan.tasks.solve.core.optimizer import OPTIMIZERS, in_step  # noqa: E402
from memplan.tasks.solve.core.orders import update_order  # noqa: E402
from memplan.tasks.solve.core.problem import Problem  # noqa: E402
from memplan.tasks.solve.core.simulator import default_schedule, normalize_schedule, simulate  # noqa: E402
from memplan.tasks.solve.core.solution import min_budget_lower_bound  # noqa: E402
from memplan.tasks.solve_stage import least_memory_within  # noqa: E402

MiB = 2**20
TARGET_DROP, TARGET_TIME = 0.8, 1.03
AT_TARGET = "at target"
VIA_STEP = "no recomputation, inside via step()"
WHOLE = "no recomputation, inside, whole updates"


def make_optimizer(name: str, model: torch.nn.Module, via_step: bool = False) -> torch.optim.Optimizer:
    """`name`'s torch.optim optimizer over the model's parameters; with `via_step`, of a subclass of its class,
    whose updates inside the step run through `Optimizer.step()` (runtime.execute.optim_functional takes only the
    classes themselves)."""
    spec = OPTIMIZERS[name]
    cls = getattr(torch.optim, spec.torch_class)
    if via_step:
        cls = type(f"{cls.__name__}ViaStep", (cls,), {})
    return cls(model.parameters(), lr=0.01, **dict(spec.torch_kwargs))


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


def plan_at_target(problem: Problem, budget: int, solvers: list[str]) -> tuple[str, runtime.Plan | None]:
    """The in-step plan of least predicted cost among `solvers`' schedules within `budget`, each solver run on
    the problem's order and on `update_order`, and a note of what each found (its predicted cost, or its
    status)."""
    found, notes = [], []
    orders = {"": problem, " (update order)": dataclasses.replace(problem, order=update_order(problem))}
    for solver, (label, ordered) in itertools.product(solvers, orders.items()):
        solution = solve(ordered, solver, budget)
        name = f"{solver}{label}"
        notes.append(f"{name}: {solution.objective:.1f}" if solution.feasible else f"{name}: {solution.status}")
        if solution.feasible:
            found.append((solution.objective, name, solution.to_plan(problem)))
    within = f"budget {budget / MiB:.2f} MiB, predicted cost {'; '.join(notes)}"
    if not found:
        return within, None
    _, solver, plan = min(found, key=lambda f: f[0])
    plan.predicted["peak_bytes"] = simulate(problem, plan.schedule).peak_bytes
    return f"{solver}: {plan_contents(problem, plan)} ({within})", plan


def plan_contents(problem: Problem, plan: runtime.Plan) -> str:
    """How many nodes a plan recomputes and runs as each implementation variant, and how many parameters it
    updates in the step that makes their gradient (`update_order`'s point)."""
    steps = normalize_schedule(plan.schedule)
    computes = [s for s in steps if "compute" in s]
    impls = collections.Counter(s["impl"] for s in computes if s.get("impl", "default") != "default")
    io = [problem.variant(s["compute"], s.get("impl")) if "compute" in s else None for s in steps]
    pairs = [(u.grads, u.params) for u in problem.updates]
    prompt = sum(at == max(i for i, x in enumerate(io) if x is not None and set(x.outputs) & set(grads))
                 for (grads, _), at in zip(pairs, update_steps(io, pairs)) if at is not None)
    variants = ", ".join(f"{n} {impl}" for impl, n in sorted(impls.items()))
    return (f"{len(computes) - problem.num_nodes} recomputations, {variants or 'no variants'}, {prompt} of "
            f"{len(problem.updates)} parameters updated in the step making their gradient")


def alive_at_peak(problem: Problem, schedule: list) -> tuple[str, int, int, int]:
    """The node of the schedule's peak step, and at that step the bytes of live parameter gradients, of the other
    live values and of the scratch (the node's workspace, or the temporaries of the updates after it)."""
    sim = simulate(problem, schedule)
    grads = {g for u in problem.updates for g in u.grads}
    s = sim.peak_step
    live = (sim.copy_start <= s) & (sim.copy_end >= s)
    is_grad = np.isin(sim.copy_value, list(grads))
    grad_bytes = int(sim.copy_bytes[live & is_grad].sum())
    other = int(sim.copy_bytes[live & ~is_grad].sum())
    node = normalize_schedule(schedule)[s]["compute"]
    return problem.node_label(node), grad_bytes, other, sim.peak_bytes - grad_bytes - other


def peak_of(run) -> int:
    """The measured peak of `run()` after a first call (which compiles the plan and makes the optimizer state)."""
    run()
    with PeakMeter("cpu", allocator=True) as meter:
        run()
    return meter.peak_bytes


def measure(runners: dict[str, tuple], rounds: int) -> tuple[dict, dict, dict, dict]:
    """Peak bytes, median wall ms, median CPU ms and median minor page faults per runner, in interleaved
    rounds."""
    peaks = {name: peak_of(run) for name, (run, *_) in runners.items()}
    times: dict[str, list[tuple[float, float, int]]] = {name: [] for name in runners}
    names = list(runners)
    for r in range(rounds + 1):
        for name in names if r % 2 == 0 else names[::-1]:
            start, cpu = time.perf_counter(), time.process_time()
            faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            runners[name][0]()
            if r:                               # round 0 warms up
                times[name].append((time.perf_counter() - start, time.process_time() - cpu,
                                    resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults))
    ms = {name: statistics.median(w for w, _, _ in t) * 1e3 for name, t in times.items()}
    cpu_ms = {name: statistics.median(c for _, c, _ in t) * 1e3 for name, t in times.items()}
    faults = {name: statistics.median(f for _, _, f in t) for name, t in times.items()}
    return peaks, ms, cpu_ms, faults


def runners_for(name: str, base: torch.nn.Module, loss_fn, batch: tuple, graph, outside: Problem,
                args: argparse.Namespace, grad_bytes: int) -> tuple[dict[str, tuple], Problem, str]:
    """Label -> (run, plan, plan label, inside?) for optimizer `name`, the in-step problem and the
    note on the plan at target."""
    inside = in_step(outside, graph.gradient_updates(), name)
    eager_model = copy.deepcopy(base)
    eager_opt = make_optimizer(name, eager_model)

    def eager_step() -> None:
        loss_fn(eager_model, *batch).backward()
        eager_opt.step()
        eager_opt.zero_grad(set_to_none=True)

    runners: dict[str, tuple] = {"eager": (eager_step, None, None, False)}
    for where, problem in (("outside", outside), ("inside", inside)):
        found = plans(problem, args.solvers, args.overheads)
        if where == "inside":
            baseline = runners["no recomputation, outside"][0]
            note, target_plan = plan_at_target(inside, int(peak_of(baseline) - TARGET_DROP * grad_bytes),
                                               args.target_solvers)
            if target_plan is not None:
                found[AT_TARGET] = target_plan
        for label, plan in found.items():
            model = copy.deepcopy(base)
            opt = make_optimizer(name, model)
            if where == "inside":
                step = runtime.load(plan, model, loss_fn, graph=graph, optimizer=opt)
                run = (lambda s: lambda: s(*batch))(step)
            else:
                step = runtime.load(plan, model, loss_fn, graph=graph)
                run = (lambda s, o: lambda: (s(*batch), o.step(), o.zero_grad(set_to_none=True)))(step, opt)
            runners[f"{label}, {where}"] = (run, plan, label, where == "inside")
    plan = runners["no recomputation, inside"][1]
    unsliced = in_step(outside, graph.gradient_updates(), name, slice_bytes=None)
    whole = runtime.Plan(plan.fingerprint, plan.schedule,
                         predicted={"peak_bytes": simulate(unsliced, plan.schedule).peak_bytes})
    model = copy.deepcopy(base)
    step = runtime.load(plan, model, loss_fn, graph=graph, optimizer=make_optimizer(name, model),
                        update_slice_bytes=None)
    runners[WHOLE] = ((lambda s: lambda: s(*batch))(step), whole, "no recomputation", True)
    model = copy.deepcopy(base)
    step = runtime.load(plan, model, loss_fn, graph=graph, optimizer=make_optimizer(name, model, via_step=True))
    runners[VIA_STEP] = ((lambda s: lambda: s(*batch))(step), whole, "no recomputation", True)
    return runners, inside, note


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="pipeline.toml")
    ap.add_argument("--model", default="resnet18")
    ap.add_argument("--optimizers", nargs="+", default=["sgd-momentum", "adamw"], choices=sorted(OPTIMIZERS))
    ap.add_argument("--solvers", nargs="+", default=["dtr", "ap-greedy", "acg"])
    ap.add_argument("--overheads", nargs="+", type=float, default=[0.05, 0.25])
    ap.add_argument("--target-solvers", nargs="+", default=["dtr", "hierarchical"])
    ap.add_argument("--variants", default="all", choices=sorted(VARIANT_RULES))
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
    outside = profiled_problem(graph, args.model, args.variants)
    grad_bytes = sum(p.numel() * p.element_size() for p in base.parameters())
    console = Console(width=230)
    title = (f"{args.model} batch {batch_size} ({args.config}), CPU, {torch.get_num_threads()} thread(s), "
             f"variants {args.variants}, {args.rounds} interleaved rounds; parameter gradients "
             f"{grad_bytes / MiB:.1f} MiB")
    target = Table(title=f"The target: the in-step plan at (outside no-recomputation peak - {TARGET_DROP} x gradients) "
                         f"vs the outside no-recomputation step, {title}")
    for column in ("optimizer", "in-step plan at target", "outside MiB", "in-step predicted MiB", "in-step MiB",
                   "drop / grads", f">= {TARGET_DROP}", "time / outside", "cpu / outside", f"<= {TARGET_TIME}"):
        target.add_column(column, justify="left" if column in ("optimizer", "in-step plan at target") else "right")
    alive = Table(title="What is alive at the in-step peaks (simulated; measured = predicted above)")
    for column in ("optimizer", "plan", "peak MiB", "peak step", "gradients MiB", "other values MiB", "scratch MiB",
                   "lower bound MiB", "update floor MiB"):
        alive.add_column(column, justify="left" if column in ("optimizer", "plan", "peak step") else "right")
    for name in args.optimizers:
        runners, inside, note = runners_for(name, base, loss_fn, batch, graph, outside, args, grad_bytes)
        peaks, ms, cpu_ms, faults = measure(runners, args.rounds)
        console.print(results_table(f"optimizer {name} ({OPTIMIZERS[name].torch_class}), {title}", runners, peaks,
                                    ms, cpu_ms, faults, grad_bytes))
        baseline, at = "no recomputation, outside", f"{AT_TARGET}, inside"
        if at in runners:
            drop = (peaks[baseline] - peaks[at]) / grad_bytes
            time_ratio, cpu_ratio = ms[at] / ms[baseline], cpu_ms[at] / cpu_ms[baseline]
            predicted = runners[at][1].predicted["peak_bytes"]
            target.add_row(name, note, f"{peaks[baseline] / MiB:.1f}", f"{predicted / MiB:.1f}",
                           f"{peaks[at] / MiB:.1f}", f"{drop:.2f}", "yes" if drop >= TARGET_DROP else "no",
                           f"{time_ratio:.3f}", f"{cpu_ratio:.3f}", "yes" if time_ratio <= TARGET_TIME else "no")
        else:
            target.add_row(name, note, f"{peaks[baseline] / MiB:.1f}", *[""] * 7)
        lower = min_budget_lower_bound(inside)
        update_floor = max(int(inside.value_bytes[list(u.grads)].sum()) + u.largest_workspace for u in inside.updates)
        for label in ("no recomputation", AT_TARGET):
            if f"{label}, inside" in runners:
                step_label, grads, other, scratch = alive_at_peak(inside, runners[f"{label}, inside"][1].schedule)
                alive.add_row(name, label, f"{(grads + other + scratch) / MiB:.2f}", step_label, f"{grads / MiB:.2f}",
                              f"{other / MiB:.2f}", f"{scratch / MiB:.2f}", f"{lower / MiB:.2f}",
                              f"{update_floor / MiB:.2f}")
    console.print(target)
    console.print(alive)


def results_table(title: str, runners: dict[str, tuple], peaks: dict, ms: dict, cpu_ms: dict, faults: dict,
                  grad_bytes: int) -> Table:
    table = Table(title=title)
    for column in ("runner", "predicted MiB", "measured MiB", "peak / eager", "drop / grads", "eager drop / grads",
                   "ms", "time / eager", "time / outside", "cpu ms", "cpu / outside", "page faults"):
        table.add_column(column, justify="left" if column == "runner" else "right")
    for name, (_, plan, label, is_inside) in runners.items():
        outside_name = "no recomputation, outside" if label == AT_TARGET else f"{label}, outside"
        drop = time_ratio = cpu_ratio = ""
        if is_inside and outside_name in runners:
            drop = f"{(peaks[outside_name] - peaks[name]) / grad_bytes:.2f}"
            time_ratio = f"{ms[name] / ms[outside_name]:.3f}"
            cpu_ratio = f"{cpu_ms[name] / cpu_ms[outside_name]:.3f}"
        eager_drop = f"{(peaks['eager'] - peaks[name]) / grad_bytes:.2f}" if is_inside else ""
        predicted = "" if plan is None else f"{plan.predicted['peak_bytes'] / MiB:.1f}"
        table.add_row(name, predicted, f"{peaks[name] / MiB:.1f}", f"{peaks[name] / peaks['eager']:.3f}", drop,
                      eager_drop, f"{ms[name]:.1f}", f"{ms[name] / ms['eager']:.3f}", time_ratio,
                      f"{cpu_ms[name]:.1f}", cpu_ratio, f"{faults[name]:.0f}")
    return table


if __name__ == "__main__":
    main()
