"""memplan at real size on a GPU: GPT-2 124M and a Llama-style 1B decoder under bf16 autocast, at the largest
batch eager fits on the card and at twice that batch (the GPU issue, item 1).

    python3 -m bench.real_size --device cuda [--models gpt2-124m llama-1b] [--solvers dtr hierarchical]
                               [--fractions 0.9 0.5] [--compile-budgets 0.5] [--rounds 5] [--deadline 480]
                               [--batch N] [--batches first twice] [--json results.json]
                               [--scale real|tiny] [--capacity-mib N]

Models (random weights, built on the device from a config): GPT-2 124M (`transformers.GPT2Config()`'s
defaults: 12 layers, 768 wide, transformers' dropout of 0.1) and a Llama-style decoder of 1.24B parameters
(Llama 3.2 1B's shape: 16 layers, 2048 wide, SwiGLU 8192, 32 heads over 8 key/value heads, 128256-token
vocabulary, tied embeddings), both at sequence 1024, float32 parameters, the loss under
`torch.autocast(dtype=torch.bfloat16)`. `--scale tiny` builds 2-layer versions that run on a CPU (this
script's own check; `--capacity-mib` then stands for the card).

The batch: eager's step peak is measured at batch 1 and 2 and extrapolated (it is affine in the batch) to
the card's free memory less `--headroom-mib`; the step then runs at that batch, 8% smaller after each
out-of-memory, until it fits. That is the largest batch eager fits (`--batch` gives it instead); the second
batch is twice it, where eager does not fit (`--batches` picks either).

Per model and batch, every point runs on the same model (one copy of the weights; the PyTorch points switch
it as a user does) and each is measured on its own: a first step (compiles), a measured step (the caching
allocator's peak of the bytes allocated in it, parameters excluded), then `--rounds` CUDA-synchronised
steps (median). Gradients are compared with eager's at the first batch, with per-block checkpointing's at
the second (|max difference| and the relative L2 norm of the difference over all parameters). Points:
eager (the model's cache off, as in training); transformers' per-block checkpointing
(`gradient_checkpointing_enable`); torchtitan-style selective activation checkpointing per layer
(bench.peers.selective_policy_step's policy); torch.compile's inductor with
`activation_memory_budget` at each of `--compile-budgets`; memplan: the step captured once
(`runtime.capture`), every node profiled on the device (`bench.peers.profiled_problem`), each solver at each
fraction of eager's measured peak at the first batch (the memory the card gave eager; at twice the
batch, a plan at 0.9 is one that fits where eager did), run with `runtime.load`. Each section stops once
`--deadline` seconds have passed since the start, and says what it left out.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import gc
import json
import math
import statistics
import time
from dataclasses import asdict, dataclass, field

import torch
from rich.console import Console
from rich.table import Table

from memplan import runtime
from bench.peers import budget_backend, profiled_problem, sac_layer_forward, solver_options
from memplan.runtime.measure.meter import PeakMeter
from memplan.runtime.tracing.modules import marked_modules
from memplan.tasks.models import autocast_loss, causal_lm
from memplan.tasks.solve import solve
from memplan.tasks.solve.core.simulator import default_schedule, simulate

SEQ = {"real": 1024, "tiny": 64}
MIB = 2 ** 20


def build(name: str, scale: str, device: str) -> tuple[torch.nn.Module, int]:
    """The model `name` at `scale` on `device`, its key/value cache off, and its vocabulary size."""
    import transformers

    torch.manual_seed(0)
    real = scale == "real"
    if name == "gpt2-124m":
        config = transformers.GPT2Config(n_positions=SEQ[scale]) if real else \
            transformers.GPT2Config(n_layer=2, n_embd=64, n_head=2, n_positions=SEQ[scale], vocab_size=512,
                                    bos_token_id=0, eos_token_id=0)
        factory = transformers.GPT2LMHeadModel
    elif name == "llama-1b":
        shape = dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                     num_key_value_heads=8, vocab_size=128256) if real else \
            dict(hidden_size=64, intermediate_size=172, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=512)
        config = transformers.LlamaConfig(**shape, tie_word_embeddings=True, max_position_embeddings=SEQ[scale],
                                          rope_theta=500000.0, bos_token_id=0, eos_token_id=0, pad_token_id=0)
        factory = transformers.LlamaForCausalLM
    else:
        raise SystemExit(f"--models: unknown model {name!r}; choose gpt2-124m or llama-1b")
    with torch.device(device):
        model = factory(config)
    model.config.use_cache = False
    return model, config.vocab_size


def user_loss(model: torch.nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
    """The training loss as users write it: labels in the forward, bf16 autocast, no key/value cache."""
    with torch.autocast(input_ids.device.type, dtype=torch.bfloat16):
        return model(input_ids=input_ids, labels=input_ids).loss


PLANNED_LOSS = functools.partial(autocast_loss, causal_lm, torch.bfloat16)
"""The same loss as memplan captures it (`causal_lm`: with the cache on, whose copies capture drops)."""


@dataclass
class Point:
    label: str
    peak: int | None = None                     # bytes; None: out of memory
    ms: float | None = None
    max_abs: float | None = None
    rel_l2: float | None = None
    predicted_peak: int | None = None
    predicted_ms: float | None = None
    plan_s: float | None = None
    note: str = ""


@dataclass
class Section:
    model: str
    batch: int
    seq: int
    reference: str
    capture_s: float | None = None
    profile_s: float | None = None
    nodes: int | None = None
    full_predicted: int | None = None
    points: list[Point] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)


class Clock:
    """Seconds since the start, against the run's deadline."""

    def __init__(self, deadline_s: float):
        self.start, self.deadline_s = time.perf_counter(), deadline_s

    def left(self) -> float:
        return self.deadline_s - (time.perf_counter() - self.start)


def sync(device: str) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def release(device: str) -> None:
    gc.collect()
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()


def run_point(point: Point, model, step, device: str, rounds: int, reference: list[torch.Tensor] | None,
              keep: bool = False) -> list[torch.Tensor] | None:
    """Fill `point`'s peak, time and gradient error against `reference` from a warm step, a measured step and
    `rounds` timed steps; with `keep`, return its gradients (on the CPU; None when it ran out of memory). The
    gradients are copied off the device only when compared or kept."""
    try:
        model.zero_grad(set_to_none=True)
        torch.manual_seed(1)
        step()                                              # compiles, allocates one-time buffers
        model.zero_grad(set_to_none=True)
        torch.manual_seed(1)
        with PeakMeter(device, allocator=True) as meter:
            step()
        grads = [p.grad.detach().float().cpu() for p in model.parameters()] if keep or reference is not None else None
        times = []
        for _ in range(rounds):
            model.zero_grad(set_to_none=True)
            sync(device)
            start = time.perf_counter()
            step()
            sync(device)
            times.append((time.perf_counter() - start) * 1e3)
    except torch.OutOfMemoryError:
        point.note = (point.note + " out of memory").strip()
        return None
    finally:
        model.zero_grad(set_to_none=True)
        release(device)
    point.peak, point.ms = meter.peak_bytes, statistics.median(times) if times else None
    if reference is not None:
        diff = sum(float((g - r).pow(2).sum(dtype=torch.float64)) for g, r in zip(grads, reference))
        norm = sum(float(r.pow(2).sum(dtype=torch.float64)) for r in reference)
        point.max_abs = max(float((g - r).abs().max()) for g, r in zip(grads, reference))
        point.rel_l2 = math.sqrt(diff / norm) if norm else 0.0
    return grads if keep else None


@contextlib.contextmanager
def per_block_checkpointing(model):
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    try:
        yield
    finally:
        model.gradient_checkpointing_disable()


@contextlib.contextmanager
def torchtitan_sac(model):
    layers = list(marked_modules(model).values())
    own = [layer.__dict__.get("forward") for layer in layers]
    for layer in layers:
        layer.forward = functools.partial(sac_layer_forward, layer.forward)
    try:
        yield
    finally:
        for layer, forward in zip(layers, own):
            if forward is None:
                del layer.forward                           # back to the class's forward
            else:
                layer.forward = forward


def switched(model, loss, batch, context):
    """A step of `loss(model, *batch)` run inside `context(model)`."""
    def step():
        with context(model):
            loss(model, *batch).backward()
    return step


def peak_at(model, vocab: int, seq: int, batch_size: int, device: str) -> int | None:
    """Eager's step peak at `batch_size` (the second step's), or None if it runs out of memory."""
    batch = (torch.randint(0, vocab, (batch_size, seq), device=device),)
    point = Point("eager")
    run_point(point, model, lambda: user_loss(model, *batch).backward(), device, 0, None)
    return point.peak


def largest_eager_batch(model, vocab: int, seq: int, device: str, capacity: int) -> tuple[int, int]:
    """The largest batch whose eager step fits in `capacity` bytes beside the model (module docstring), and
    its peak."""
    p1, p2 = peak_at(model, vocab, seq, 1, device), peak_at(model, vocab, seq, 2, device)
    if p1 is None or p2 is None or p2 > capacity:
        raise SystemExit(f"eager does not fit batch 2 of sequence {seq} on this device")
    size = max(2, int((capacity - p1) // max(1, p2 - p1)) + 1)
    while size > 2:
        peak = peak_at(model, vocab, seq, size, device)
        if peak is not None and peak <= capacity:
            return size, peak
        size = int(size * 0.92)
    return 2, p2


def section(name: str, model, vocab: int, seq: int, batch_size: int, fit_bytes: int, args, clock: Clock,
            reference_label: str) -> Section:
    """Every point of one model at one batch (module docstring)."""
    device = args.device
    out = Section(name, batch_size, seq, reference_label)
    batch = (torch.randint(0, vocab, (batch_size, seq), device=device),)
    reference: list[torch.Tensor] | None = None

    def measure(point: Point, step) -> None:
        nonlocal reference
        out.points.append(point)
        grads = run_point(point, model, step, device, args.rounds, reference, keep=point.label == reference_label)
        if point.label == reference_label:
            reference = grads
        measured = "" if point.peak is None else f"peak {point.peak / MIB:.0f} MiB, {point.ms:.1f} ms "
        print(f"  {point.label}: {measured}{point.note}", flush=True)

    measure(Point("eager"), lambda: user_loss(model, *batch).backward())
    measure(Point("checkpoint per block"), switched(model, user_loss, batch, per_block_checkpointing))
    measure(Point("selective checkpoint (torchtitan)"), switched(model, user_loss, batch, torchtitan_sac))

    start = time.perf_counter()
    graph = runtime.capture(model, PLANNED_LOSS, batch)
    out.capture_s, out.nodes = time.perf_counter() - start, len(graph.nodes)
    start = time.perf_counter()
    problem = profiled_problem(graph, name, "none", device)
    out.profile_s = time.perf_counter() - start
    out.full_predicted = simulate(problem, default_schedule(problem)).peak_bytes
    print(f"  captured {out.nodes} nodes in {out.capture_s:.1f} s, profiled in {out.profile_s:.1f} s; "
          f"no recomputation predicted at {out.full_predicted / MIB:.0f} MiB", flush=True)
    def planned(solver: str) -> None:
        solver_name, options = solver_options(solver)
        for fraction in args.fractions:
            label = f"{solver} @ {fraction:.2f} of eager's fit"
            if clock.left() < args.reserve_s:
                out.skipped.append(f"{label} (deadline)")
                continue
            start = time.perf_counter()
            sol = solve(problem, solver_name, int(fraction * fit_bytes), options)
            plan_s = time.perf_counter() - start
            if not sol.feasible:
                out.points.append(Point(label, plan_s=plan_s, note="no plan at this budget"))
                print(f"  {label}: infeasible ({plan_s:.1f} s)", flush=True)
                continue
            step = runtime.load(sol.to_plan(problem), model, PLANNED_LOSS, graph=graph)
            measure(Point(label, predicted_peak=sol.predicted_peak_bytes, predicted_ms=sol.objective,
                          plan_s=plan_s), lambda: step(*batch))

    def compiled() -> None:
        for budget in args.compile_budgets:
            label = f"inductor, activation_memory_budget {budget:.2f}"
            if clock.left() < args.reserve_s + args.compile_s:
                out.skipped.append(f"{label} (deadline)")
                continue
            fn = torch.compile(model, backend=budget_backend(budget, "inductor"))
            start = time.perf_counter()
            measure(Point(label), lambda: user_loss(fn, *batch).backward())
            out.points[-1].plan_s = time.perf_counter() - start      # compiling, measuring and timing
            torch.compiler.reset()
            release(device)

    planned(args.solvers[0])              # the cheapest solver first, compiled peers next: a deadline cuts the rest
    compiled()
    for solver in args.solvers[1:]:
        planned(solver)
    return out


def table(sec: Section, eager_ms: float | None, eager_peak: int | None, where: str) -> Table:
    t = Table("point", "peak MiB", "peak / eager", "time / eager", "step ms", "predicted peak MiB",
              "predicted / measured", "plan s", "|max grad diff|", "rel L2 grad diff", "note",
              title=f"{sec.model}, batch {sec.batch} x {sec.seq}: {where}; "
                    f"gradients against {sec.reference}")
    for p in sec.points:
        t.add_row(p.label, f"{p.peak / MIB:.0f}" if p.peak else "",
                  f"{p.peak / eager_peak:.3f}" if p.peak and eager_peak else "",
                  f"{p.ms / eager_ms:.3f}" if p.ms and eager_ms else "", f"{p.ms:.1f}" if p.ms else "",
                  f"{p.predicted_peak / MIB:.0f}" if p.predicted_peak else "",
                  f"{p.predicted_peak / p.peak:.3f}" if p.predicted_peak and p.peak else "",
                  f"{p.plan_s:.1f}" if p.plan_s is not None else "",
                  f"{p.max_abs:.2g}" if p.max_abs is not None else "",
                  f"{p.rel_l2:.2g}" if p.rel_l2 is not None else "", p.note)
    return t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=["gpt2-124m", "llama-1b"])
    ap.add_argument("--solvers", nargs="+", default=["dtr", "hierarchical"])
    ap.add_argument("--fractions", nargs="+", type=float, default=[0.9, 0.5])
    ap.add_argument("--compile-budgets", nargs="*", type=float, default=[0.5])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--scale", choices=list(SEQ), default="real")
    ap.add_argument("--capacity-mib", type=int, help="the card's memory for the step (default: free memory)")
    ap.add_argument("--headroom-mib", type=int, default=2048)
    ap.add_argument("--deadline", type=float, default=480.0, help="seconds; later points are left out")
    ap.add_argument("--reserve-s", type=float, default=20.0)
    ap.add_argument("--compile-s", type=float, default=90.0, help="seconds a compiled point is assumed to take")
    ap.add_argument("--batch", type=int, help="eager's batch (default: the largest that fits, sought)")
    ap.add_argument("--batches", nargs="+", choices=["first", "twice"], default=["first", "twice"],
                    help="measure at eager's batch, at twice it, or both")
    ap.add_argument("--json")
    args = ap.parse_args()
    clock = Clock(args.deadline)
    console = Console(width=220)
    cuda = torch.device(args.device).type == "cuda"
    where = f"{torch.cuda.get_device_name(args.device)}, torch {torch.__version__}" if cuda else \
        f"CPU, torch {torch.__version__}"
    results, fits = [], {}
    for twice in (False, True):                       # both models at eager's batch first, then at twice it
        for name in args.models:
            label = f"{name}{' at twice the batch' if twice else ''}"
            if ("twice" if twice else "first") not in args.batches and (twice or name in fits):
                continue
            if clock.left() < args.reserve_s * 2 or (twice and name not in fits):
                print(f"{label}: left out (deadline)")
                continue
            model, vocab = build(name, args.scale, args.device)
            release(args.device)
            if not twice:
                fits[name] = eager_fit(model, vocab, args)
                print(f"{name} ({sum(p.numel() for p in model.parameters()) / 1e6:.0f}M parameters): eager fits "
                      f"batch {fits[name]['batch']} ({fits[name]['fit_bytes'] / MIB:.0f} MiB of "
                      f"{fits[name]['capacity'] / MIB:.0f})", flush=True)
            fit = fits[name]
            if ("twice" if twice else "first") in args.batches:
                sec = section(name, model, vocab, SEQ[args.scale], fit["batch"] * (2 if twice else 1),
                              fit["fit_bytes"], args, clock, "checkpoint per block" if twice else "eager")
                if not twice:
                    fit |= {"eager_ms": sec.points[0].ms, "eager_peak": sec.points[0].peak}
                console.print(table(sec, fit.get("eager_ms"), fit.get("eager_peak", fit["fit_bytes"]), where))
                if sec.skipped:
                    console.print("left out: " + "; ".join(sec.skipped))
                results.append({"where": where, **fit, **asdict(sec)})
                if args.json:
                    with open(args.json, "w") as f:
                        json.dump(results, f, indent=1)
            del model
            release(args.device)


def eager_fit(model, vocab: int, args) -> dict:
    """The batch eager fits (`--batch`, or the largest on the card: `largest_eager_batch`), its step peak and the
    capacity it was sought in."""
    capacity = args.capacity_mib * MIB if args.capacity_mib else \
        torch.cuda.mem_get_info(args.device)[0] - args.headroom_mib * MIB
    if args.batch is None:
        size, fit_bytes = largest_eager_batch(model, vocab, SEQ[args.scale], args.device, capacity)
    else:
        size, fit_bytes = args.batch, peak_at(model, vocab, SEQ[args.scale], args.batch, args.device)
        if fit_bytes is None:
            raise SystemExit(f"--batch {args.batch}: eager runs out of memory at that batch on {args.device}")
    return {"batch": size, "fit_bytes": fit_bytes, "capacity": capacity}

if __name__ == "__main__":
    main()
