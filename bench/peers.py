"""memplan against what users already have: peak memory and step time, measured side by side in one run.

    .venv/bin/python bench/peers.py [--workloads gpt2 llama resnet50 mobilenet_v2] [--solvers ...] [--rounds 6]
                                    [--threads 1] [--compile-budgets 1.0 0.7 0.5 0.3]
                                    [--fractions 0.5 0.26] [--variants all] [--device cpu]
                                    [--compile-backend aot_eager_decomp_partition|inductor|inductor-cudagraphs ...]
                                    [--cuda-graph]

Per workload (random weights, on `--device`: cpu, or cuda with its times CUDA-synchronised): eager PyTorch
(for transformers models also with the key/value cache off); the PyTorch checkpointing a user writes by
hand (transformers' per-block `torch.utils.checkpoint`, `checkpoint_sequential` over torchvision's
top-level children; for transformers models also torchtitan-style selective checkpointing per layer,
saving matmul and attention outputs, `selective_policy_step`, and the same decisions as a memplan schedule
run by `runtime.load`, `torchtitan_schedule`, a row outside the verdict whose peak also joins each solver's
fractions); `torch.compile` with `torch._functorch.config.activation_memory_budget` at each of
`--compile-budgets`, by each `--compile-backend` (default: `aot_eager_decomp_partition` on CPU; inductor,
what a GPU user compiles with, on CUDA; `inductor-cudagraphs` is inductor with CUDA graphs, as
`mode="reduce-overhead"` compiles); memplan's solvers at 0.9 / 0.7 / 0.5 of the no-recomputation peak and at the
smallest fraction each solver reaches (or at `--fractions` only); a solver may carry options
(`hierarchical:inner=monet`). `--variants` is a plan's `variants` setting (docs/config.md): by default the
solvers are offered every implementation variant (runtime.variants.offered), as the pipeline offers them;
`bit-identical` or `none` keep the plans bit-identical to eager (some variants are within the validation
tolerance instead: the gradient column shows it).
Workloads: GPT-2 (6 layers, 256 wide, seq 256, batch 4; without dropout, and as `gpt2-dropout` with
transformers' default dropout of 0.1 on embeddings, attention and residuals), a Llama-style decoder of the
same size from a `transformers.LlamaConfig` (RMSNorm, rotary, SwiGLU), ResNet-50 and MobileNet-V2 (batch 8,
128 px).
Every memplan plan is solved on node costs profiled in the same run (`tasks.profile.stage.measure_graph`) and
run with `runtime.load` (gradients compared with eager; with `--cuda-graph` each replayed as one CUDA
graph, `runtime.load(..., cuda_graph=True)`). Peaks are the allocator's, kernels' own buffers
included: `runtime.measure.meter.PeakMeter(allocator=True)`, which on CPU reads torch.profiler's memory events
and so also sees the buffers inductor's kernels allocate outside the dispatcher, and on CUDA the caching
allocator. Peaks are of a step after the first (eager's first step also takes one-time buffers); with CUDA
graphs, whose replays allocate nothing, of the steps that warm up and record: the second and third steps
of inductor with CUDA graphs (after the compiling one), the first step of a memplan plan with `--cuda-graph`.
Step times are medians of interleaved rounds; a plan's predicted peak and time (the simulator's, on the
profiled costs) are divided by eager's measured peak and time, like the measured ones beside them;
"variants run" names the implementation variants a plan runs (docs/plan-format.md). The verdict lists
each PyTorch point and the memplan plans that dominate it (no more peak at no more time), and each
memplan plan a PyTorch point dominates.
"""

from __future__ import annotations

import argparse
import copy
import functools
import statistics
import time
from datetime import datetime, timezone

import torch
import torch.nn.functional as F
from rich.console import Console
from rich.table import Table
from torch._dynamo.backends.debugging import aot_eager_decomp_partition
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, checkpoint_sequential, create_selective_checkpoint_contexts

from memplan import runtime
from memplan.runtime.execute.executor import replayed_random_nodes
from memplan.runtime.measure.meter import PeakMeter
from memplan.runtime.tracing.modules import marked_modules
from memplan.runtime.policy.form import Regions
from memplan.runtime.variants.offered import graph_variants
from memplan.tasks.config import VariantChoice, parse_option_text
from memplan.tasks.problems import VARIANT_RULES
from memplan.tasks.profile.stage import ProfileSettings, measure_graph
from memplan.tasks.solve import SOLVERS as REGISTERED, parse_options, solve
from memplan.tasks.solve.core.problem import Problem
from memplan.tasks.solve.core.simulator import default_schedule, normalize_schedule, simulate
from memplan.tasks.solve.core.solution import Solution, SolveOptions, checked_solution
from memplan.tasks.store.query import CostTable, VariantCost

SOLVERS = ("hierarchical", "module-checkpoint", "ap-greedy", "acg", "linearized-greedy")
FRACTIONS = (0.9, 0.7, 0.5)
SMALLER = (0.4, 0.3, 0.26, 0.22, 0.2, 0.18, 0.15, 0.12, 0.1)
"""Fractions tried below FRACTIONS, in turn, for each solver's smallest feasible fraction."""
COMPILE_BUDGETS = (1.0, 0.7, 0.5, 0.3)


def workload(name: str, device: str = "cpu"):
    """(model, loss_fn, batch, hand-checkpointed step or None, its label), on `device`."""
    torch.manual_seed(0)
    if name in ("gpt2", "gpt2-dropout", "llama"):
        import transformers

        if name.startswith("gpt2"):
            p = 0.1 if name == "gpt2-dropout" else 0.0         # transformers' default dropout, or none
            config = transformers.GPT2Config(n_layer=6, n_embd=256, n_head=4, n_positions=256, vocab_size=2048,
                                             bos_token_id=0, eos_token_id=0, resid_pdrop=p, embd_pdrop=p, attn_pdrop=p)
            model = transformers.GPT2LMHeadModel(config)
        else:
            config = transformers.LlamaConfig(num_hidden_layers=6, hidden_size=256, intermediate_size=688,
                                              num_attention_heads=4, num_key_value_heads=4, vocab_size=2048,
                                              max_position_embeddings=256, bos_token_id=0, eos_token_id=0,
                                              pad_token_id=0)
            model = transformers.LlamaForCausalLM(config)
        model.to(device)
        loss_fn = lambda m, x: m(input_ids=x, labels=x).loss  # noqa: E731
        batch = (torch.randint(0, 2048, (4, 256)).to(device),)
        hand = copy.deepcopy(model)
        hand.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        return model, loss_fn, batch, (hand, lambda: loss_fn(hand, *batch).backward()), "checkpoint per block"
    import torchvision

    model = getattr(torchvision.models, name)(num_classes=10).to(device)
    loss_fn = lambda m, x, y: F.cross_entropy(m(x), y)  # noqa: E731
    batch = (torch.randn(8, 3, 128, 128).to(device), torch.randint(0, 10, (8,)).to(device))
    hand = copy.deepcopy(model)
    for module in hand.modules():            # checkpointed segments must not modify their saved inputs in place
        if hasattr(module, "inplace"):
            module.inplace = False
    features = hand.features if hasattr(hand, "features") else \
        torch.nn.Sequential(*[m for n, m in hand.named_children() if n != "fc"])
    head = hand.fc if hasattr(hand, "fc") else hand.classifier

    def sequential_step():
        x = checkpoint_sequential(features, 4, batch[0], use_reentrant=False)
        x = torch.flatten(F.adaptive_avg_pool2d(x, 1), 1)
        F.cross_entropy(head(x), batch[1]).backward()

    return model, loss_fn, batch, (hand, sequential_step), "checkpoint_sequential(4)"


def no_cache_step(model, loss_fn, batch) -> dict:
    """For a transformers model: eager with its key/value cache off (`config.use_cache = False`, one line a
    user may write to save the cache's copies of keys and values), labelled; else nothing."""
    if getattr(getattr(model, "config", None), "use_cache", None) is None:
        return {}
    off = copy.deepcopy(model)
    off.config.use_cache = False
    return {"eager, use_cache=False": (off, lambda: loss_fn(off, *batch).backward())}


SAC_SAVE = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default,
            torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
            torch.ops.aten._scaled_dot_product_flash_attention.default,
            torch.ops.aten._scaled_dot_product_efficient_attention.default,
            torch.ops.aten._scaled_dot_product_cudnn_attention.default}
"""What torchtitan's selective activation checkpointing ("op" mode) saves: matmul and attention outputs."""


def _save_matmuls(ctx, func, *args, **kwargs):
    return CheckpointPolicy.MUST_SAVE if func in SAC_SAVE else CheckpointPolicy.PREFER_RECOMPUTE


def sac_layer_forward(forward, *args, **kwargs):
    """`forward(*args, **kwargs)` under torchtitan-style selective activation checkpointing (`SAC_SAVE`)."""
    return checkpoint(forward, *args, use_reentrant=False, **kwargs,
                      context_fn=functools.partial(create_selective_checkpoint_contexts, _save_matmuls))


def selective_policy_step(model, loss_fn, batch) -> dict:
    """For a transformers model: torchtitan-style selective activation checkpointing, labelled. Each layer
    (the repeated modules `runtime.tracing.modules.marked_modules` finds) runs under `torch.utils.checkpoint(
    use_reentrant=False)` with a policy that saves the outputs of `SAC_SAVE` and recomputes every other op
    (torchtitan's "op" mode also recomputes every second matmul; that refinement is left out). The cache is
    off, as a checkpointed layer must not update it twice. Else nothing."""
    if getattr(getattr(model, "config", None), "use_cache", None) is None:
        return {}
    sac = copy.deepcopy(model)
    sac.config.use_cache = False
    for layer in marked_modules(sac).values():
        layer.forward = functools.partial(sac_layer_forward, layer.forward)
    return {"selective checkpoint (torchtitan)": (sac, lambda: loss_fn(sac, *batch).backward())}


TORCHTITAN_LABEL = "torchtitan decisions, memplan schedule"


def torchtitan_schedule(problem: Problem, graph) -> list[dict[str, int]] | None:
    """`selective_policy_step`'s decisions as a schedule of `graph` (`problem` is its problem; None when it
    records no repeated modules): every forward node once, and before the first backward node of each layer
    (a region of runtime/policy/form.py) its forward again from its first node through the last one its
    backward reads, skipping the nodes whose op is in `SAC_SAVE`, whose outputs the forward's copies supply (the
    query, key and output projections among them, read only by the recomputed ops after them). Unlike
    `runtime.policy.form.policy_schedule` it does not drop idle saves: it is what the policy asks of autograd."""
    regions = Regions.of_problem(problem)
    if not regions.members:
        return None
    saved_ops = {(str(op),) for op in SAC_SAVE}
    before: dict[int, list[int]] = {}
    for name, nodes in regions.members.items():
        rerun = regions.recomputed(name, {n for n in nodes if graph.nodes[n].targets[:1] in saved_ops})
        before.setdefault(regions.trigger(name), []).extend(rerun)
    return [{"compute": n} for node in regions.order for n in (*before.get(node, ()), node)]


def torchtitan_solution(problem: Problem, graph) -> Solution | None:
    """`torchtitan_schedule` as a checked solution (its simulated peak as the budget), or None."""
    schedule = torchtitan_schedule(problem, graph)
    if schedule is None:
        return None
    return checked_solution(problem, TORCHTITAN_LABEL, simulate(problem, schedule).peak_bytes, schedule)


def peak_and_grads(model, step, device: str = "cpu"):
    model.zero_grad(set_to_none=True)
    torch.manual_seed(1)
    with PeakMeter(device, allocator=True) as meter:
        step()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    return meter.peak_bytes, grads


def step_times(runs: dict, rounds: int, device: str = "cpu", alternate: bool = False
               ) -> tuple[dict[str, float], dict[str, float]]:
    """Median wall and process CPU milliseconds of each `(model, step)` run over `rounds` interleaved rounds
    (`step_samples`). CPU time moves less with other jobs on a shared host."""
    samples = step_samples(runs, rounds, device, alternate)
    return ({k: statistics.median(w for w, _ in v) for k, v in samples.items()},
            {k: statistics.median(c for _, c in v) for k, v in samples.items()})


def step_samples(runs: dict, rounds: int, device: str = "cpu", alternate: bool = False
                 ) -> dict[str, list[tuple[float, float]]]:
    """Wall and process CPU milliseconds of each `(model, step)` run in each of `rounds` interleaved rounds (the
    first round warms up and is not kept), from zero gradients; with `alternate`, the order reversed every other
    round."""
    sync = torch.cuda.synchronize if torch.device(device).type == "cuda" else lambda: None
    samples: dict[str, list[tuple[float, float]]] = {k: [] for k in runs}
    labels = list(runs)
    for i in range(rounds + 1):
        for k in labels[::-1] if alternate and i % 2 else labels:
            model, step = runs[k]
            model.zero_grad(set_to_none=True)
            sync()
            wall, cpu = time.perf_counter(), time.process_time()
            step()
            sync()
            if i:
                samples[k].append(((time.perf_counter() - wall) * 1e3, (time.process_time() - cpu) * 1e3))
    return samples


def median_ms(runs: dict, rounds: int, device: str = "cpu") -> dict[str, float]:
    """Median wall milliseconds of each run (`step_times`, one order every round)."""
    return step_times(runs, rounds, device)[0]


def profiled_costs(graph, name: str, device: str = "cpu") -> CostTable:
    """One profile of every node and every implementation variant of the graph on `device`."""
    rows = measure_graph(graph, device, ProfileSettings(rounds=1), model=name, progress=False)
    measured: dict[int, dict[str, VariantCost]] = {}
    for r in rows:
        measured.setdefault(r["node_id"], {})[r["impl"]] = VariantCost(r["time_ms"], r["workspace_bytes"],
                                                                       r["output_bytes"])
    policy = (rows[0]["policy_forward_ms"], rows[0]["policy_recompute_ms"])
    return CostTable(graph.fingerprint, rows[0]["device"], name, "bench", datetime.now(timezone.utc), measured,
                     None if None in policy else policy)


def profiled_problem(graph, name: str, variants: VariantChoice = "none", device: str = "cpu") -> Problem:
    """The graph's problem priced by `profiled_costs`, with the implementation variants of `variants`
    (`tasks.problems.VARIANT_RULES`) the graph offers, priced by the same profile."""
    offered = None if variants == "none" else graph_variants(graph, VARIANT_RULES[variants])
    return Problem.from_graph(graph, profiled_costs(graph, name, device), offered)


def inductor(gm, example_inputs, cudagraphs: bool = False, **kwargs):
    """torch.compile's default backend, as a callable `budget_backend` can wrap; with `cudagraphs`, with CUDA
    graphs (cudagraph trees), what `torch.compile(mode="reduce-overhead")` compiles."""
    from torch._inductor.compile_fx import compile_fx
    return compile_fx(gm, example_inputs, config_patches={"triton.cudagraphs": True} if cudagraphs else None)


COMPILE_BACKENDS = {"aot_eager_decomp_partition": aot_eager_decomp_partition, "inductor": inductor,
                    "inductor-cudagraphs": functools.partial(inductor, cudagraphs=True)}
BACKEND_LABELS = {"aot_eager_decomp_partition": "compile", "inductor": "inductor",
                  "inductor-cudagraphs": "inductor+cudagraphs"}


def budget_backend(budget: float, backend_name: str = "aot_eager_decomp_partition"):
    """torch.compile's `backend_name` backend (`COMPILE_BACKENDS`) partitioning with
    `activation_memory_budget` = budget. One backend callable per budget: Dynamo guards compiled code on
    its backend (BACKEND_MATCH), so every compiled copy keeps running the graphs partitioned at its own
    budget. (Resetting Dynamo between budgets, as this bench did before, dropped the earlier copies'
    graphs, and since the guards do not tell deep copies apart, every copy then ran the last budget's
    graphs: one peak for all.)"""
    compiler = COMPILE_BACKENDS[backend_name]

    def backend(gm, example_inputs, **kwargs):
        with torch._functorch.config.patch(activation_memory_budget=budget):
            return compiler(gm, example_inputs, **kwargs)

    return backend


def compiled_step(model, loss_fn, batch, budget: float, backend_name: str = "aot_eager_decomp_partition"):
    """A copy of `model` under torch.compile (`backend_name`) with `activation_memory_budget` = budget,
    compiled by its first step, and that step."""
    compiled = copy.deepcopy(model)
    fn = torch.compile(compiled, backend=budget_backend(budget, backend_name))
    step = lambda: loss_fn(fn, *batch).backward()  # noqa: E731
    step()
    compiled.zero_grad(set_to_none=True)
    return compiled, step


def planned_step(plan, model, loss_fn, graph, cuda_graph: bool):
    """`runtime.load`'s step for `plan` and a label suffix: with `cuda_graph`, replayed as a CUDA graph
    (" cuda graph"), unless the plan recomputes a random node, which a graph cannot replay: then as usual,
    and the suffix says why."""
    if cuda_graph and not replayed_random_nodes(plan, graph.program):
        return runtime.load(plan, model, loss_fn, graph=graph, cuda_graph=True), " cuda graph"
    return runtime.load(plan, model, loss_fn, graph=graph), " (recomputes dropout: no graph)" if cuda_graph else ""


def solver_options(spec: str) -> tuple[str, SolveOptions]:
    """`name` or `name:key=value,...` (e.g. `hierarchical:inner=monet`) as a solver and its typed options,
    each value read as `memplan solve --option` reads it."""
    name, _, rest = spec.partition(":")
    params = dict(parse_option_text(item) for item in filter(None, rest.split(",")))
    return name, SolveOptions(time_limit=120, params=parse_options(REGISTERED[name], params, f"--solvers {spec}"))


def smallest_fraction(problem: Problem, solver: str, options: SolveOptions, full: int) -> float | None:
    """The least predicted peak (fraction of `full`) `solver` reaches, trying FRACTIONS then SMALLER
    until it finds nothing."""
    best = None
    for f in (*FRACTIONS, *SMALLER):
        sol = solve(problem, solver, int(f * full), options)
        if not sol.feasible:
            break
        best = sol.predicted_peak_bytes / full
    return best


def bench(name: str, rounds: int, solvers: list[str], compile_budgets: list[float],
          variants: VariantChoice = "all", fractions: list[float] | None = None, device: str = "cpu",
          compile_backends: tuple[str, ...] = ("aot_eager_decomp_partition",),
          cuda_graph: bool = False) -> tuple[list[dict], str]:
    model, loss_fn, batch, (hand, hand_step), hand_label = workload(name, device)
    graph = runtime.capture(model, loss_fn, batch)
    problem = profiled_problem(graph, name, variants, device)
    full = simulate(problem, default_schedule(problem)).peak_bytes
    runs = {"eager": (model, lambda: loss_fn(model, *batch).backward()), hand_label: (hand, hand_step),
            **no_cache_step(model, loss_fn, batch), **selective_policy_step(model, loss_fn, batch)}
    points = {label: {"kind": "pytorch"} for label in runs}
    for backend in compile_backends:
        for budget in compile_budgets:
            label = f"{BACKEND_LABELS[backend]} budget {budget:.1f}"
            start = time.perf_counter()
            runs[label] = compiled_step(model, loss_fn, batch, budget, backend)
            points[label] = {"kind": "pytorch", "solve_s": time.perf_counter() - start}
            if backend == "inductor-cudagraphs":       # its second and third steps record and replay
                with PeakMeter(device, allocator=True) as recording:
                    for _ in range(2):
                        runs[label][1]()
                        runs[label][0].zero_grad(set_to_none=True)
                points[label]["recording_peak"] = recording.peak_bytes
    titan = torchtitan_solution(problem, graph) if "selective checkpoint (torchtitan)" in runs else None
    titan_fraction = [] if titan is None else [titan.predicted_peak_bytes / full]
    if titan is not None:
        planned = copy.deepcopy(model)
        titan_step = runtime.load(titan.to_plan(problem), planned, loss_fn, graph=graph)
        runs[TORCHTITAN_LABEL] = (planned, lambda: titan_step(*batch))
        points[TORCHTITAN_LABEL] = {"kind": "schedule", "source": "bench.peers.torchtitan_schedule",
                                    "predicted_bytes": titan.predicted_peak_bytes, "predicted_ms": titan.objective}
    for solver in solvers:
        solver_name, options = solver_options(solver)
        start = time.perf_counter()
        least = None if fractions else smallest_fraction(problem, solver_name, options, full)
        search_s = time.perf_counter() - start
        tried = [*(fractions or ([] if least is None else [*FRACTIONS, least])), *titan_fraction]
        for fraction in sorted(set(tried), reverse=True):
            start = time.perf_counter()
            sol = solve(problem, solver_name, int(fraction * full), options)
            if not sol.feasible:
                continue
            planned = copy.deepcopy(model)
            step, suffix = planned_step(sol.to_plan(problem), planned, loss_fn, graph, cuda_graph)
            label = f"{solver} @ {fraction:.{3 if fraction in titan_fraction else 2}f}{suffix}"
            runs[label] = (planned, lambda step=step: step(*batch))
            points[label] = {"kind": "memplan", "solve_s": time.perf_counter() - start, "search_s": search_s,
                             "source": sol.source or solver, "predicted_bytes": sol.predicted_peak_bytes,
                             "predicted_ms": sol.objective,
                             "variants": " ".join(sorted({step["impl"] for step in normalize_schedule(sol.schedule)
                                                          if step.get("impl", "default") != "default"}))}
    if cuda_graph:       # the capture stream's cuBLAS workspace, once per process as eager's stream has its own
        runtime.load(runtime.default_plan(graph), copy.deepcopy(model), loss_fn, graph=graph, cuda_graph=True)(*batch)
    peak_and_grads(model, runs["eager"][1], device)           # eager's first step also takes one-time buffers
    eager_peak, eager_grads = peak_and_grads(model, runs["eager"][1], device)
    for label, (m, step) in runs.items():
        peak, grads = peak_and_grads(m, step, device)
        peak = max(peak, points[label].get("recording_peak", 0))
        points[label] |= {"peak": peak / eager_peak,
                          "err": max(float((a - b).abs().max()) for a, b in zip(eager_grads, grads))}
    for label, ms in median_ms(runs, rounds, device).items():
        points[label]["ms"] = ms
    eager_ms = points["eager"]["ms"]
    for point in points.values():                            # predictions in the measured columns' units
        if "predicted_bytes" in point:
            point |= {"predicted": point["predicted_bytes"] / eager_peak,
                      "predicted_time": point["predicted_ms"] / eager_ms}
    rows = [{"label": k, **v, "time": v["ms"] / eager_ms} for k, v in points.items()]
    return rows, verdict(rows)


def dominates(a: dict, b: dict) -> bool:
    return a["peak"] <= b["peak"] and a["time"] <= b["time"] and (a["peak"], a["time"]) != (b["peak"], b["time"])


def verdict(rows: list[dict]) -> str:
    """Which points of each side are dominated, and by what. Eager is the reference, and so is a PyTorch
    point that saves nothing (eager's very peak: Llama with its cache off, whose cache copies die with
    their sources): it is listed as such, not weighed."""
    peers = [r for r in rows if r["kind"] == "pytorch" and r["label"] != "eager"]
    same = [r for r in peers if r["peak"] == 1.0]
    torch_points = [r for r in peers if r["peak"] != 1.0]
    ours = [r for r in rows if r["kind"] == "memplan"]
    lines = [f"{r['label']} ({r['time']:.3f}x time) peaks at eager's peak: a reference like eager" for r in same]
    for p in torch_points:
        winners = [r["label"] for r in ours if dominates(r, p)]
        lines.append(f"{p['label']} ({p['peak']:.3f}x peak, {p['time']:.3f}x time) is dominated by: "
                     + (", ".join(winners) or "no memplan plan"))
    for r in ours:
        by = [p["label"] for p in torch_points if dominates(p, r)]
        if by:
            lines.append(f"memplan {r['label']} ({r['peak']:.3f}x, {r['time']:.3f}x) is dominated by: {', '.join(by)}")
    beaten = sum(any(dominates(r, p) for r in ours) for p in torch_points)
    lost = sum(any(dominates(p, r) for p in torch_points) for r in ours)
    lines.append(f"verdict: {beaten} of {len(torch_points)} PyTorch points dominated by memplan; "
                 f"{lost} of {len(ours)} memplan plans dominated by PyTorch")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workloads", nargs="+", default=["gpt2", "llama", "resnet50", "mobilenet_v2"])
    ap.add_argument("--solvers", nargs="+", default=list(SOLVERS))
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--compile-budgets", nargs="*", type=float, default=list(COMPILE_BUDGETS))
    ap.add_argument("--fractions", nargs="+", type=float,
                    help="plan at these fractions only (default: 0.9 / 0.7 / 0.5 and each solver's smallest)")
    ap.add_argument("--variants", choices=list(VARIANT_RULES), default="all",
                    help="implementation variants the solvers may choose, as a plan's `variants` setting: all (the "
                         "pipeline's default), bit-identical or none")
    ap.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (default cpu)")
    ap.add_argument("--compile-backend", nargs="+", choices=list(COMPILE_BACKENDS),
                    help="torch.compile's backends for the budget points (default: aot_eager_decomp_partition on "
                         "CPU, inductor on CUDA)")
    ap.add_argument("--cuda-graph", action="store_true",
                    help="run every memplan plan replayed as one CUDA graph (runtime.load(..., cuda_graph=True))")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    console = Console(width=200)
    on_cpu = torch.device(args.device).type == "cpu"
    backends = tuple(args.compile_backend or ["aot_eager_decomp_partition" if on_cpu else "inductor"])
    where = (f"CPU, {args.threads} thread(s)" if on_cpu else
             f"{torch.cuda.get_device_name(args.device)}, torch {torch.__version__}")
    for name in args.workloads:
        rows, text = bench(name, args.rounds, args.solvers, args.compile_budgets, args.variants, args.fractions,
                           args.device, backends, args.cuda_graph)
        table = Table("point", "peak / eager", "time / eager", "step ms", "max |grad diff|", "predicted peak / eager",
                      "predicted time / eager", "solve s", "smallest search s", "schedule from", "variants run",
                      title=f"{name}: {where}, median of {args.rounds} interleaved rounds")
        for r in sorted(rows, key=lambda r: r["peak"]):
            table.add_row(r["label"], f"{r['peak']:.3f}", f"{r['time']:.3f}", f"{r['ms']:.{1 if r['ms'] < 100 else 0}f}", f"{r['err']:.2g}",
                          *(f"{r[k]:.3f}" if k in r else "" for k in ("predicted", "predicted_time")),
                          *(f"{r[k]:.1f}" if k in r else "" for k in ("solve_s", "search_s")), r.get("source", ""),
                          r.get("variants", ""))
        console.print(table)
        console.print(text)


if __name__ == "__main__":
    main()
