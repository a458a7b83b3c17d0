"""The compiled form beside torch.compile's own memory budget, measured side by side in one run (CPU, inductor).

    .venv/bin/python -m bench.compiled_form [--layers 4] [--width 256] [--vocab 8192] [--seq 128] [--batch 4]
        [--rounds 11] [--threads 1] [--budgets 0.5 0.3 0.1] [--fractions 0.8 0.6 0.4 0.3] [--solver dtr]

One GPT-2-style decoder in plain PyTorch (pre-norm blocks, SDPA attention, tanh-GELU MLP, untied head and
cross-entropy), so torch.compile captures the step as one graph. Rows: eager; inductor; inductor with
`activation_memory_budget` at each `--budgets` value (PyTorch's knapsack solver and FLOP estimator); per-block
`torch.utils.checkpoint` under inductor; memplan's compiled form (`memplan.runtime.compiled.CompiledStep`), the
joint graph solved by `--solver` at each `--fractions` share of the simulator's no-recomputation peak, inductor
fusing what memplan keeps. Peaks: `PeakMeter(allocator=True)` of a step after the compiling one, over eager's;
times: medians of interleaved rounds (the order reversed every other round), over eager's; "grad err": the largest
gradient difference from eager; "predicted": the simulator's peak for memplan's decision (the joint graph as
inductor fuses it: tasks/compiled/form.py) over eager's measured peak. The last lines name, for each PyTorch row, the memplan rows that dominate it (peak
at most its, median paired time ratio below 1 with its 95% interval).
"""

from __future__ import annotations

import argparse
import copy
import statistics

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from bench.peers import peak_and_grads, step_samples
from memplan.runtime.compiled.step import CompiledStep, own_code
from memplan.tasks.compiled.form import FractionDecision
from memplan.tasks.validate.step_timing import median_interval


class Block(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.fc, self.out = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2)
                   for z in self.qkv(self.ln1(x)).split(d, dim=-1))
        x = x + self.proj(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, d))
        return x + self.out(F.gelu(self.fc(self.ln2(x)), approximate="tanh"))


class Decoder(nn.Module):
    """A GPT-2-style decoder; `per_block` checkpoints each block as users write it by hand."""

    def __init__(self, vocab: int, width: int, layers: int, seq: int, per_block: bool = False) -> None:
        super().__init__()
        self.per_block = per_block
        self.tok, self.pos = nn.Embedding(vocab, width), nn.Embedding(seq, width)
        self.blocks = nn.ModuleList(Block(width, max(1, width // 64)) for _ in range(layers))
        self.ln, self.head = nn.LayerNorm(width), nn.Linear(width, vocab, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.tok(ids) + self.pos(torch.arange(ids.shape[1], device=ids.device))
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=False) if self.per_block else block(x)
        return self.head(self.ln(x))


def causal_lm_loss(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    logits = model(ids)
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))


def inductor(fn, **functorch_config):
    """`fn` under torch.compile with inductor and `functorch_config` patched while it compiles."""
    compiled = torch.compile(own_code(fn), backend="inductor")

    def step(*args):
        with torch._functorch.config.patch(**functorch_config):
            return compiled(*args)
    return step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=11)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--budgets", type=float, nargs="*", default=[0.5, 0.3, 0.1])
    parser.add_argument("--fractions", type=float, nargs="*", default=[0.8, 0.6, 0.4, 0.3])
    parser.add_argument("--solver", default="dtr")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch._inductor.config.fx_graph_cache = False
    torch._functorch.config.enable_autograd_cache = False
    torch.manual_seed(0)
    base = Decoder(args.vocab, args.width, args.layers, args.seq)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq))

    runs: dict[str, tuple[nn.Module, object]] = {}

    def add(label: str, model: nn.Module, make) -> None:
        step = make(lambda x, m=model: causal_lm_loss(m, x))
        runs[label] = (model, lambda step=step: step(ids).backward())

    add("eager", copy.deepcopy(base), lambda fn: fn)
    add("inductor", copy.deepcopy(base), inductor)
    for b in args.budgets:
        add(f"inductor, budget {b}", copy.deepcopy(base), lambda fn, b=b: inductor(fn, activation_memory_budget=b))
    blocked = Decoder(args.vocab, args.width, args.layers, args.seq, per_block=True)
    blocked.load_state_dict(base.state_dict())
    add("per-block checkpoint, inductor", blocked, inductor)
    decisions = {f"memplan {args.solver} @ {f}": FractionDecision(args.solver, f) for f in args.fractions}
    for label, decision in decisions.items():
        add(label, copy.deepcopy(base), lambda fn, decision=decision: CompiledStep(fn, decision))

    peaks, errors, predicted, reference = {}, {}, {}, None
    for label, (model, step) in runs.items():
        step()                                    # compiles
        peaks[label], grads = peak_and_grads(model, step)
        reference = reference or grads
        errors[label] = max((g - r).abs().max().item() for g, r in zip(grads, reference))
    for label, decision in decisions.items():
        predicted[label] = sum(s.predicted_peak_bytes or 0 for s in decision.solutions)
    samples = step_samples(runs, args.rounds, alternate=True)
    eager = statistics.median(w for w, _ in samples["eager"])
    print(f"decoder {args.layers} x {args.width}, vocab {args.vocab}, seq {args.seq}, batch {args.batch}; "
          f"{args.threads} thread(s), {args.rounds} rounds; eager step {eager:.1f} ms, peak {peaks['eager']:,} B")
    print(f"{'row':40s} {'peak':>7s} {'predicted':>9s} {'time':>7s} {'grad err':>9s}")
    for label in runs:
        wall = statistics.median(w for w, _ in samples[label])
        guess = f"{predicted[label] / peaks['eager']:9.3f}" if label in predicted else f"{'':9s}"
        print(f"{label:40s} {peaks[label] / peaks['eager']:7.3f} {guess} {wall / eager:7.3f} {errors[label]:9.1e}")
    ours = [k for k in runs if k.startswith("memplan")]
    for peer in (k for k in runs if k != "eager" and k not in ours):
        wins = []
        for label in ours:
            if peaks[label] > peaks[peer]:
                continue
            ratios = [a / b for (a, _), (b, _) in zip(samples[label], samples[peer])]
            interval = median_interval(ratios)
            shown = f"[{interval[0]:.3f}, {interval[1]:.3f}]" if interval else "(too few rounds)"
            wins.append(f"{label} {statistics.median(ratios):.3f} {shown}")
        print(f"{peer}: " + ("; ".join(wins) if wins else "no memplan row at or below its peak"))


if __name__ == "__main__":
    main()
