"""The compiled form's measured plans beside PyTorch's compiled checkpointing, on the issue's real-size decoders
(CPU, inductor's C++ backend), measured side by side in one run.

    .venv/bin/python -m bench.compiled_real [--models gpt2-12x512 llama-gqa] [--layers N] [--rounds 11]
        [--threads 1] [--budgets 0.5 0.3 0.1] [--probes 5] [--below 0.97] [--solver dtr] [--markdown PATH]

Models, in plain PyTorch so that torch.compile captures the step whole (the compiled form refuses graph breaks):
`gpt2-12x512`: GPT-2 with 12 layers, 512 wide, 8 heads, its 50,257-token vocabulary (head tied to the token
embedding), sequence 256, batch 2, dropout 0.1 on the embeddings, attention (SDPA's `dropout_p`) and residuals,
tanh-GELU; `llama-gqa`: a grouped-query Llama-style decoder, 6 layers, 512 wide, 8 query heads and 2 key/value
heads, RMSNorm, rotary embeddings, SwiGLU (1,376 hidden), untied head, vocabulary 32,000, sequence 256, batch 2, no
dropout. `--layers` overrides the depth (for a quick run). All rows share one set of parameters.

Rows: eager; inductor (torch.compile's default); inductor with `torch._functorch.config.activation_memory_budget`
at each `--budgets` value (PyTorch's default knapsack solver and FLOP estimator); per-block
`torch.utils.checkpoint(use_reentrant=False)` under inductor; torchtitan-style selective activation checkpointing
per block under inductor (`create_selective_checkpoint_contexts` with a policy that saves the outputs of matmuls and
attention, torchtitan's `_save_list`, and recomputes every other op); and memplan's compiled plans:
`memplan.tasks.compiled.plans.CompiledModel.search(peak, probes=--probes)` at each compiled PyTorch row's measured
peak (and at `--below` times it), deduplicated, each rebuilt as `CompiledStep(fn, PlannedDecide((region,)))`.
Plans are solved by `--solver` on the joint graph (tasks/compiled/form.py) and measured compiled; where none of those
fits, the search measures its segment candidates (`memplan segments stride/tail`: checkpointing between the joint
graph's cuts, `tasks.compiled.form.segment_decision`).

Peaks: `PeakMeter("cpu", allocator=True)` of a step after the compiling one, over eager's. Times: every row takes a
turn in each of `--rounds` interleaved rounds (the order reversed every other round; one warm-up round), reported as
the median over rounds of the row's time over eager's in the same round, with its distribution-free 95% interval.
A PyTorch row is dominated by a memplan row whose peak is at most its and whose paired time ratio to it has a 95%
interval wholly below 1; where the search's answer at a PyTorch row's peak is inductor's own partition (no
recomputation: the plan memplan's pipeline would write), that plan is the inductor row and is compared as memplan's.
"grad err" is the largest gradient difference from eager (with dropout, inductor draws
other masks than eager, so it is large there by construction).
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time
from unittest import mock

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from bench.peers import step_samples
from memplan.runtime.compiled.step import CompiledStep, PlannedDecide, own_code
from memplan.runtime.measure.meter import PeakMeter
from memplan.tasks.compiled.plans import CompiledModel
from memplan.tasks.validate.step_timing import median_interval


# --- models -------------------------------------------------------------------------------------------------------

class GPT2Block(nn.Module):
    def __init__(self, width: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.heads, self.p = heads, dropout
        self.ln1, self.ln2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.fc, self.out = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2)
                   for z in self.qkv(self.ln1(x)).split(d, dim=-1))
        a = F.scaled_dot_product_attention(q, k, v, dropout_p=self.p if self.training else 0.0, is_causal=True)
        x = x + F.dropout(self.proj(a.transpose(1, 2).reshape(b, t, d)), self.p, self.training)
        return x + F.dropout(self.out(F.gelu(self.fc(self.ln2(x)), approximate="tanh")), self.p, self.training)


class GPT2(nn.Module):
    """GPT-2 (pre-norm, learned positions, head tied to the token embedding, dropout `p`)."""

    def __init__(self, vocab: int, width: int, layers: int, heads: int, seq: int, p: float) -> None:
        super().__init__()
        self.p = p
        self.tok, self.pos = nn.Embedding(vocab, width), nn.Embedding(seq, width)
        self.blocks = nn.ModuleList(GPT2Block(width, heads, p) for _ in range(layers))
        self.ln = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.tok.weight
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=0.02)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.tok(ids) + self.pos(torch.arange(ids.shape[1], device=ids.device))
        return F.dropout(x, self.p, self.training)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.ln(x))


class RMSNorm(nn.Module):
    def __init__(self, width: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps, self.weight = eps, nn.Parameter(torch.ones(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


class LlamaBlock(nn.Module):
    def __init__(self, width: int, heads: int, kv_heads: int, hidden: int) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.dim = heads, kv_heads, width // heads
        self.norm1, self.norm2 = RMSNorm(width), RMSNorm(width)
        self.q = nn.Linear(width, heads * self.dim, bias=False)
        self.k = nn.Linear(width, kv_heads * self.dim, bias=False)
        self.v = nn.Linear(width, kv_heads * self.dim, bias=False)
        self.o = nn.Linear(heads * self.dim, width, bias=False)
        self.gate, self.up = nn.Linear(width, hidden, bias=False), nn.Linear(width, hidden, bias=False)
        self.down = nn.Linear(hidden, width, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        h = self.norm1(x)
        q = self.q(h).view(b, t, self.heads, self.dim).transpose(1, 2)
        k = self.k(h).view(b, t, self.kv_heads, self.dim).transpose(1, 2)
        v = self.v(h).view(b, t, self.kv_heads, self.dim).transpose(1, 2)
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        group = self.heads // self.kv_heads
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o(a.transpose(1, 2).reshape(b, t, d))
        h = self.norm2(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


class Llama(nn.Module):
    """A grouped-query Llama-style decoder (RMSNorm, rotary, SwiGLU, untied head, no dropout)."""

    def __init__(self, vocab: int, width: int, layers: int, heads: int, kv_heads: int, hidden: int, seq: int) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, width)
        self.blocks = nn.ModuleList(LlamaBlock(width, heads, kv_heads, hidden) for _ in range(layers))
        self.norm = RMSNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)
        dim = width // heads
        inv = 1.0 / (10000 ** (torch.arange(0, dim, 2).float() / dim))
        angles = torch.outer(torch.arange(seq).float(), inv)
        angles = torch.cat((angles, angles), dim=-1)
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=0.02)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.tok(ids)

    def block_args(self, ids: torch.Tensor) -> tuple:
        t = ids.shape[1]
        return self.cos[:t], self.sin[:t]

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(x))


# --- checkpointing modes ------------------------------------------------------------------------------------------

SAC_SAVE = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default,
            torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
            torch.ops.aten._scaled_dot_product_flash_attention.default,
            torch.ops.aten._scaled_dot_product_efficient_attention.default,
            torch.ops.aten._scaled_dot_product_cudnn_attention.default}
"""The ops whose outputs torchtitan-style selective checkpointing saves (their `_save_list`: matmuls, attention)."""


def _save_list_policy(ctx, func, *args, **kwargs):
    return CheckpointPolicy.MUST_SAVE if func in SAC_SAVE else CheckpointPolicy.PREFER_RECOMPUTE


def run_model(model: nn.Module, ids: torch.Tensor, mode: str = "none") -> torch.Tensor:
    """The decoder's logits, each block plain (`none`), under `torch.utils.checkpoint` (`block`), or under
    selective checkpointing with `_save_list_policy` (`selective`)."""
    x = model.embed(ids)
    extra = model.block_args(ids) if hasattr(model, "block_args") else ()
    for block in model.blocks:
        if mode == "block":
            x = checkpoint(block, x, *extra, use_reentrant=False)
        elif mode == "selective":
            x = checkpoint(block, x, *extra, use_reentrant=False,
                           context_fn=functools.partial(create_selective_checkpoint_contexts, _save_list_policy))
        else:
            x = block(x, *extra)
    return model.logits(x)


def causal_lm_loss(model: nn.Module, ids: torch.Tensor, mode: str = "none") -> torch.Tensor:
    logits = run_model(model, ids, mode)
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))


MODELS = {
    "gpt2-12x512": dict(kind="gpt2", vocab=50257, width=512, layers=12, heads=8, seq=256, batch=2, dropout=0.1),
    "llama-gqa": dict(kind="llama", vocab=32000, width=512, layers=6, heads=8, kv_heads=2, hidden=1376, seq=256,
                      batch=2, dropout=0.0),
}


def build(name: str, layers: int | None) -> tuple[nn.Module, torch.Tensor, dict]:
    spec = dict(MODELS[name])
    if layers:
        spec["layers"] = layers
    torch.manual_seed(0)
    if spec["kind"] == "gpt2":
        model = GPT2(spec["vocab"], spec["width"], spec["layers"], spec["heads"], spec["seq"], spec["dropout"])
    else:
        model = Llama(spec["vocab"], spec["width"], spec["layers"], spec["heads"], spec["kv_heads"], spec["hidden"],
                      spec["seq"])
    ids = torch.randint(0, spec["vocab"], (spec["batch"], spec["seq"]))
    return model.train(), ids, spec


# --- rows ---------------------------------------------------------------------------------------------------------

def inductor(fn, **functorch_config):
    """`fn` under torch.compile (inductor, whole graph), `functorch_config` patched while it compiles."""
    compiled = torch.compile(own_code(fn), backend="inductor", fullgraph=True)

    def step(*args):
        with torch._functorch.config.patch(enable_autograd_cache=False, **functorch_config), \
                torch._inductor.config.patch(fx_graph_cache=False):
            return compiled(*args)
    return step


def measure_peak(model: nn.Module, step) -> tuple[int, list[torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    torch.manual_seed(1)
    with PeakMeter("cpu", allocator=True) as meter:
        step()
    grads = [p.grad.clone() if p.grad is not None else torch.zeros_like(p) for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    return meter.peak_bytes, grads


def pareto(points: dict[str, tuple[int, float]]) -> list[str]:
    """Labels of the points no other point beats on both peak and time (one at least strictly), by peak."""
    keep = [k for k, (p, t) in points.items()
            if not any(p2 <= p and t2 <= t and (p2 < p or t2 < t) for k2, (p2, t2) in points.items() if k2 != k)]
    return sorted(keep, key=lambda k: points[k][0])


def bench_model(name: str, args, out: list[str]) -> None:
    model, ids, spec = build(name, args.layers)
    step_fn = {mode: (lambda x, mode=mode: causal_lm_loss(model, x, mode)) for mode in ("none", "block", "selective")}
    steps: dict[str, object] = {}
    compile_s: dict[str, float] = {}
    peaks: dict[str, int] = {}
    errors: dict[str, float] = {}
    reference = None

    def add(label: str, loss_step) -> None:
        nonlocal reference
        run = lambda: loss_step(ids).backward()  # noqa: E731
        start = time.perf_counter()
        run()                                                # compiles
        model.zero_grad(set_to_none=True)
        compile_s[label] = time.perf_counter() - start
        peaks[label], grads = measure_peak(model, run)
        reference = reference if reference is not None else grads
        errors[label] = max((g - r).abs().max().item() for g, r in zip(grads, reference))
        steps[label] = run
        print(f"  {label}: peak {peaks[label]:,} B, first step {compile_s[label]:.0f} s", flush=True)

    print(f"{name}: {spec}", flush=True)
    add("eager", step_fn["none"])
    add("inductor", inductor(step_fn["none"]))
    for b in args.budgets:
        add(f"inductor, budget {b}", inductor(step_fn["none"], activation_memory_budget=b))
    add("per-block checkpoint, inductor", inductor(step_fn["block"]))
    add("selective checkpoint (torchtitan), inductor", inductor(step_fn["selective"]))
    peers = [k for k in steps if k != "eager"]

    # The measured search. CompiledModel resets Dynamo after each plan it measures; the rows above keep their
    # compiled graphs (each has its own code object), so the reset is skipped here.
    start = time.perf_counter()
    with mock.patch("torch.compiler.reset", lambda: None):
        search = CompiledModel(name, model, causal_lm_loss, (ids,), "cpu", args.solver)
        found: dict[str, object] = {}
        own: set[str] = set()            # peers whose search answered inductor's own partition (the inductor row)
        for peer in peers:
            for scale in (1.0, *args.below):
                budget = int(peaks[peer] * scale)
                probe = search.search(budget, args.probes)
                tag = peer if scale == 1.0 else f"{scale:g} x {peer}"
                print(f"  search at {tag} ({budget:,} B): "
                      + ("none" if probe is None else
                         f"{probe.label}, measured {probe.measured_peak_bytes:,} B"), flush=True)
                if probe is not None and probe.segments is not None:
                    found.setdefault(f"memplan {probe.label}", probe)
                elif probe is not None and probe.fraction is not None:
                    found.setdefault(f"memplan {args.solver} @ {probe.fraction:.4g}", probe)
                elif probe is not None and scale == 1.0 and peer != "inductor":
                    own.add(peer)
    search_s = time.perf_counter() - start
    probes = [(p.label, p.measured_peak_bytes, round(p.recompute_cost, 1), round(p.compile_seconds))
              for p in search.probes]
    print(f"  search: {len(search.probes)} plans measured in {search_s:.0f} s: {probes}", flush=True)
    ours = []
    for label, probe in sorted(found.items(), key=lambda kv: kv[1].recompute_cost):
        decide = PlannedDecide((probe.region,), unplanned="error")
        add(label, CompiledStep(step_fn["none"], decide))
        ours.append(label)

    samples = step_samples({k: (model, s) for k, s in steps.items()}, args.rounds, alternate=True)
    wall = {k: [w for w, _ in v] for k, v in samples.items()}
    eager_ms = statistics.median(wall["eager"])

    def ratio(a: str, b: str) -> tuple[float, tuple[float, float] | None]:
        r = [x / y for x, y in zip(wall[a], wall[b])]
        return statistics.median(r), median_interval(r)

    def shown(value: float, interval) -> str:
        return f"{value:.3f} [{interval[0]:.3f}, {interval[1]:.3f}]" if interval else f"{value:.3f}"

    dominated: dict[str, list[str]] = {}
    for peer in peers:
        wins = []
        for label in ours + (["inductor"] if peer in own else []):
            if peaks[label] > peaks[peer]:
                continue
            middle, interval = ratio(label, peer)
            if interval and interval[1] < 1:
                name_ = label if label != "inductor" else "memplan's plan = inductor's own partition"
                wins.append(f"{name_} ({shown(middle, interval)}, peak {peaks[label] / peaks[peer]:.3f}x)")
        dominated[peer] = wins
    layers = spec["layers"]
    lines = [f"### {name}: {layers} layers x {spec['width']}, vocabulary {spec['vocab']:,}, sequence {spec['seq']}, "
             f"batch {spec['batch']}, dropout {spec['dropout']}",
             "",
             f"Eager step {eager_ms:.0f} ms (median of {args.rounds} rounds), peak {peaks['eager'] / 2**20:.1f} MiB. "
             f"Search: {len(search.probes)} compiled plans measured ({search_s / 60:.1f} min).",
             "",
             "| row | peak / eager | time / eager [95%] | first step (s) | grad err | dominated by (paired time ratio [95%], peak ratio) |",
             "|---|---|---|---|---|---|"]
    for label in steps:
        middle, interval = ratio(label, "eager") if label != "eager" else (1.0, None)
        dom = "; ".join(dominated[label]) if dominated.get(label) else ("no" if label in peers else "")
        lines.append(f"| {label} | {peaks[label] / peaks['eager']:.3f} | {shown(middle, interval)} | "
                     f"{compile_s[label]:.0f} | {errors[label]:.1e} | {dom} |")
    points = {k: (peaks[k], ratio(k, "eager")[0] if k != "eager" else 1.0) for k in steps}
    theirs = pareto({k: v for k, v in points.items() if k not in ours})
    mine = pareto({k: points[k] for k in ours}) if ours else []
    fmt = lambda ks: ", ".join(f"{k} ({points[k][0] / peaks['eager']:.3f}, {points[k][1]:.3f})" for k in ks)  # noqa: E731
    lines += ["", f"Frontier (peak, time over eager's), PyTorch: {fmt(theirs)}.", "",
              f"Frontier, memplan: {fmt(mine) or 'none'}.", "",
              f"PyTorch rows dominated with 95% confidence: {sum(bool(dominated[p]) for p in peers)} of {len(peers)}.",
              "", "Plans measured by the search (plan: peak / eager, estimated recompute ms): " + ", ".join(
                  f"{p.label}: {p.measured_peak_bytes / peaks['eager']:.3f}, {p.recompute_cost:.0f}"
                  for p in search.probes) + ".", ""]
    print("\n".join(lines), flush=True)
    out.extend(lines)
    steps.clear()
    found.clear()
    torch._dynamo.reset()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--layers", type=int, default=None)
    parser.add_argument("--rounds", type=int, default=11)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--budgets", type=float, nargs="*", default=[0.5, 0.3, 0.1])
    parser.add_argument("--probes", type=int, default=5)
    parser.add_argument("--below", type=float, nargs="*", default=[],
                        help="also search at these multiples of each peer's peak (e.g. 0.97)")
    parser.add_argument("--solver", default="dtr")
    parser.add_argument("--markdown", default=None, help="write the tables here too")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch._inductor.config.fx_graph_cache = False
    torch._functorch.config.enable_autograd_cache = False
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
    out: list[str] = []
    for name in args.models:
        bench_model(name, args, out)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write("\n".join(out) + "\n")


if __name__ == "__main__":
    main()
