"""The chunked language-model loss (runtime/chunked_loss.py) against eager's, with and without per-block checkpointing.

    .venv/bin/python -m bench.chunked_loss [--layers 4] [--width 256] [--vocab 50257] [--sequence 512] [--batch 2]
                                           [--chunk-tokens 1024] [--rounds 9] [--warmup 1] [--threads 1]

A transformers GPT2LMHeadModel built from its config (no dropout, tied head), one training step (forward and
backward, no optimizer) per row:
- eager: `model(ids, labels=ids).loss.backward()`;
- eager + chunked loss: `chunked_causal_lm_loss(model, ids, chunk_tokens=...)`;
- per-block checkpointing: transformers' `gradient_checkpointing_enable(use_reentrant=False)`, its own loss;
- per-block + chunked loss;
- memplan's executor, the captured order (`runtime.default_plan`, no recomputation), of the graph whose loss is
  fused (`fuse_cross_entropy`: one logits-sized tensor) and of the graph whose head and loss are chunked
  (`chunk_cross_entropy`, 16 chunks, the default at this size: no logits-sized tensor), the model's own loss.
Peaks are `PeakMeter("cpu", allocator=True)` on a step after the first; each row's peak is its fraction of
eager's. Times are interleaved rounds (`tasks.validate.step_timing.paired_step_times`: the rows take turns, reversed every
other round), reported as the median per-round ratio to eager's step with its distribution-free 95% interval
(`median_interval`). The rows' losses and gradients are checked against eager's first.
"""

from __future__ import annotations

import argparse
import copy
import statistics

import torch

from memplan import runtime
from memplan.runtime.chunked_loss import chunked_causal_lm_loss
from memplan.runtime.measure.meter import PeakMeter
from memplan.tasks.models import causal_lm
from memplan.tasks.validate.step_timing import median_interval, paired_step_times


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=50257)
    parser.add_argument("--sequence", type=int, default=512)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--chunk-tokens", type=int, default=1024)
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    import transformers

    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=args.vocab, n_positions=args.sequence, n_embd=args.width,
                                     n_layer=args.layers, n_head=max(1, args.width // 64), resid_pdrop=0.0,
                                     embd_pdrop=0.0, attn_pdrop=0.0)
    eager = transformers.GPT2LMHeadModel(config).train()
    checkpointed = copy.deepcopy(eager)
    checkpointed.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    checkpointed.config.use_cache = False
    ids = torch.randint(0, args.vocab, (args.batch, args.sequence))

    def hf(model):
        return lambda: model(ids, labels=ids, use_cache=False).loss.backward()

    def chunked(model):
        return lambda: chunked_causal_lm_loss(model, ids, chunk_tokens=args.chunk_tokens).backward()

    def planned(chunk: bool):
        """A copy of the model run by memplan's executor in the captured order, the loss chunked or fused."""
        model = copy.deepcopy(eager)
        graph = runtime.capture(model, causal_lm, (ids,))
        if chunk != bool(graph.meta["rewrites"]["applied"]["chunk_cross_entropy"]):
            selection = {**graph.meta["rewrites"]["applied"], "chunk_cross_entropy": [0] if chunk else [],
                         "fuse_cross_entropy": [] if chunk else [0]}
            graph = runtime.capture(model, causal_lm, (ids,), rewrites=selection)
        step = runtime.load(runtime.default_plan(graph), model, causal_lm, graph=graph)
        step.compile(ids)
        return model, lambda: step(ids)

    rows = [("eager", eager, hf(eager)), ("eager + chunked loss", eager, chunked(eager)),
            ("per-block checkpointing", checkpointed, hf(checkpointed)),
            ("per-block + chunked loss", checkpointed, chunked(checkpointed)),
            ("memplan executor, fused loss", *planned(False)), ("memplan executor, chunked loss", *planned(True))]

    reference = None
    for name, model, step in rows:                   # same losses and gradients as eager's (float rounding)
        model.zero_grad(set_to_none=True)
        step()
        grads = [p.grad.clone() for p in model.parameters()]
        if reference is None:
            reference = grads
        worst = max(((g - r).abs().max() / r.abs().max().clamp_min(1e-12)).item() for g, r in zip(grads, reference))
        print(f"{name}: largest gradient difference to eager's {worst:.1e} of the gradient's largest entry")
        model.zero_grad(set_to_none=True)

    peaks = []
    for name, model, step in rows:
        step()                                        # a step after the first
        model.zero_grad(set_to_none=True)
        with PeakMeter("cpu", allocator=True) as meter:
            step()
        model.zero_grad(set_to_none=True)
        peaks.append(meter.peak_bytes)

    times = paired_step_times([(model, step) for _, model, step in rows], "cpu", args.warmup, args.rounds,
                              args.rounds, 0.0)
    tokens = args.batch * args.sequence
    print(f"\nGPT-2 {args.layers} layers x {args.width} wide, vocab {args.vocab}, sequence {args.sequence}, batch "
          f"{args.batch} ({tokens} tokens: full fp32 logits {tokens * args.vocab * 4 / 2**20:.0f} MiB), chunk "
          f"{args.chunk_tokens} tokens, {args.threads} thread(s), {len(times[0])} timed rounds\n")
    print("| row | peak MiB | peak / eager | step ms (median) | time / eager, median [95%] |")
    print("|---|---|---|---|---|")
    for (name, _, _), peak, measured in zip(rows, peaks, times):
        ratios = [t / e for t, e in zip(measured, times[0])]
        interval = median_interval(ratios)
        low, high = interval if interval else (float("nan"), float("nan"))
        print(f"| {name} | {peak / 2**20:.0f} | {peak / peaks[0]:.3f}x | {statistics.median(measured):.0f} | "
              f"{statistics.median(ratios):.3f} [{low:.3f}, {high:.3f}] |")


if __name__ == "__main__":
    main()
