"""MONeT's operator variants per family, measured side by side in one run per model.

    .venv/bin/python bench/variant_rules.py [--models resnet18 mobilenet_v2 vgg11 gpt2] [--batch 4] [--size 64]

For each model (random weights, CPU, 1 thread), the default plan (eager order; convolution backward
already split into weight- and input-gradient nodes at capture) and, per variant rule of
`runtime.variants.offered` and for all rules together, the plan that takes a variant wherever it helps: variant
groups (a forward node and the backward nodes reading what it allocates, or a lone backward node) are
switched on one at a time, in graph order, and kept when the simulated peak does not rise and the
simulated bytes x steps fall. Each plan is run: measured peak (`runtime.measure.meter.PeakMeter`) next to the
simulated one, ratio to the default plan's measured peak, step time (median of interleaved rounds) and
max |grad - eager grad|. GPT-2 runs without dropout (attention is then one SDPA node).

Recorded (memplan 753b285, torch 2.14.1, CPU, 1 thread, shared host under load so times are noisy;
batch 4, 64px; GPT-2 4 layers x 256, seq 128); measured peak / default plan, measured == simulated in
every row:
    resnet18      compact 0.991 (1 group), mask 1.000, output 1.000, all 0.991 (22 groups), grads <= 2.2e-6
    mobilenet_v2  mask 0.820, output 0.985 (52 groups), all 0.805 (87 groups), grads <= 2.2e-5
    vgg11         compact 0.999, mask 1.000, all 0.999, grads bit-identical
    gpt2          output 0.908 (9 LayerNorms), math never helps at seq 128 (0 groups), grads <= 4.8e-8
In eager order the peak of these CNNs at this size is the end of the backward (parameter gradients), so
most variants only pay off under a memory budget, where the solver trades them against recomputation.

Rule `bitmask` (memplan bitmask branch, same settings, measured == simulated in every row, grads
bit-identical; times noisy, the host shared with test runs):
    mobilenet_v2 batch 4   bitmask 0.769 vs mask 0.820 (35 groups each), all rules 0.754 (was 0.805)
    mobilenet_v2 batch 16  bitmask 0.711 vs mask 0.774, all rules 0.694
    resnet18 batch 4 / 16  bitmask 1.000 = mask 1.000 in eager order (its peak is the parameter gradients)
Step time: bitmask 1.7-2.4x the default plan on mobilenet_v2 against 0.5-2.4x for mask in the same runs;
per call (1 thread, loaded host) packing takes 0.9-2.3 ms, 17-80x a hardtanh (8 strided passes of ~4
small ops each: per-op overhead dominates small tensors), and unpacking 0.7-1.8 ms, 5-64x a
hardtanh_backward (shapes 4x96x32x32 down to 4x960x2x2); the `masked_fill` both mask rules run is
itself ~13x slower than hardtanh_backward at 4x96x32x32. The profile carries these times, so the solver picks
`bitmask` where its bytes matter.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch
import torch.nn.functional as F
from rich.console import Console
from rich.table import Table

from memplan import runtime
from memplan.runtime.variants.offered import graph_variants
from memplan.tasks.solve.core.problem import Problem
from memplan.tasks.solve.core.simulator import InvalidSchedule, simulate
from variants_arena import measure  # bench/ is the script folder: the same eager/plan step meter


def build(name: str, batch: int, size: int):
    torch.manual_seed(0)
    if name == "gpt2":
        import transformers

        config = transformers.GPT2Config(n_layer=4, n_embd=256, n_head=4, n_positions=128, vocab_size=2048,
                                         bos_token_id=0, eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0,
                                         attn_pdrop=0.0, activation_function="gelu_pytorch_tanh")
        ids = torch.randint(0, 2048, (batch, 128))
        return transformers.GPT2LMHeadModel(config), (lambda m, x: m(input_ids=x, labels=x).loss), (ids,)
    import torchvision

    model = getattr(torchvision.models, name)(num_classes=10)
    return model, (lambda m, x, y: F.cross_entropy(m(x), y)), (torch.randn(batch, 3, size, size),
                                                                 torch.randint(0, 10, (batch,)))


def variant_groups(graph, variants, rules: set[str]) -> list[dict[int, str]]:
    """Nodes that switch together: a variant value's producer with its readers; a lone variant otherwise."""
    groups: dict[int, dict[int, str]] = {}
    lone = []
    for node, specs in variants.specs.items():
        for name, spec in specs.items():
            if spec.rule not in rules:
                continue
            made = [v for v in spec.outputs if v >= variants.num_graph_values]
            read = [v for v in spec.inputs if v >= variants.num_graph_values]
            for v in made + read:
                groups.setdefault(v, {})[node] = name
            if not made and not read:
                lone.append({node: name})
    return sorted([*groups.values(), *lone], key=min)


def where_it_helps(graph, problem, groups) -> tuple[list[dict], int]:
    """The default order with each group's variants kept when they do not raise the simulated peak and
    lower the simulated bytes x steps (a group making the schedule invalid is skipped); returns the schedule
    and the number of groups kept."""
    chosen: dict[int, str] = {}

    def schedule(choice):
        return [{"compute": n.id, "impl": choice[n.id]} if n.id in choice else {"compute": n.id} for n in graph.nodes]

    best = simulate(problem, schedule(chosen))
    kept = 0
    for group in groups:
        try:
            trial = simulate(problem, schedule({**chosen, **group}))
        except InvalidSchedule:     # an in-place ReLU whose input a chosen variant (the `output` BatchNorm) reads
            continue
        if trial.peak_bytes <= best.peak_bytes and trial.timeline.sum() < best.timeline.sum():
            chosen.update(group)
            best, kept = trial, kept + 1
    return schedule(chosen), kept


def bench(name: str, batch: int, size: int, rounds: int) -> list[tuple]:
    model, loss_fn, data = build(name, batch, size)
    graph = runtime.capture(model, loss_fn, data)
    variants = graph_variants(graph)
    problem = Problem.from_graph(graph, None, variants)
    offered = sorted({s.rule for specs in variants.specs.values() for s in specs.values()})
    plans = {"default": (runtime.default_plan(graph).schedule, 0)}
    for rules in [*({r} for r in offered), set(offered)]:
        label = "+".join(sorted(rules)) if len(rules) == 1 else "all rules"
        plans[label] = where_it_helps(graph, problem, variant_groups(graph, variants, rules))
    models = {k: copy.deepcopy(model) for k in plans}
    steps = {k: runtime.load(runtime.Plan(graph.fingerprint, s), models[k], loss_fn, graph=graph)
             for k, (s, _) in plans.items()}
    for k in steps:
        steps[k].compile(*data)
    _, eager_grads = measure(model, loss_fn, data)
    measured = {k: measure(models[k], loss_fn, data, steps[k]) for k in steps}
    times = {k: [] for k in steps}
    for _ in range(rounds):
        for k in steps:
            start = time.perf_counter()
            measure(models[k], loss_fn, data, steps[k])
            times[k].append((time.perf_counter() - start) * 1e3)
    base_peak, base_ms = measured["default"][0], statistics.median(times["default"])
    rows = []
    for k, (schedule, kept) in plans.items():
        peak, grads = measured[k]
        err = max(float((a - b).abs().max()) for a, b in zip(eager_grads, grads))
        ms = statistics.median(times[k])
        rows.append((name, k, kept, peak / 2 ** 20, simulate(problem, schedule).peak_bytes / 2 ** 20,
                     peak / base_peak, ms / base_ms, err))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=["resnet18", "mobilenet_v2", "vgg11", "gpt2"])
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--size", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(1)
    table = Table("model", "variants taken", "groups", "measured peak MiB", "simulated MiB", "peak / default",
                  "time / default", "max |grad diff|",
                  title=f"operator variants where they help (CPU, batch {args.batch}, {args.size}px / seq 128)")
    for name in args.models:
        for model, label, kept, peak, sim, ratio, tratio, err in bench(name, args.batch, args.size, args.rounds):
            table.add_row(model, label, str(kept), f"{peak:.2f}", f"{sim:.2f}", f"{ratio:.3f}", f"{tratio:.2f}",
                          f"{err:.2g}")
    Console().print(table)


if __name__ == "__main__":
    main()
