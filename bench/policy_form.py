"""The policy form (runtime.apply) beside PyTorch's own checkpointing, measured side by side in one run.

    .venv/bin/python -m bench.policy_form [--model gpt2|llama] [--rounds 5] [--threads 1] [--fractions 0.7 0.5] [--probes 6] [--spread 6]
        [--peers 'selective checkpoint (torchtitan)' ...] [--no-least]

One model for every row: the GPT-2 of bench/peers.py with transformers' default dropout of 0.1 (6 layers,
256 wide, seq 256, batch 4), or its Llama-style decoder (`--model llama`: RMSNorm, rotary, SwiGLU, no dropout),
with eager attention and the key/value cache off (`runtime.policy.apply.capture_eager` traces it with the all-ones
attention mask; a checkpointed layer must not update a cache twice). Rows:
eager; eager under torch.compile (`aot_eager_decomp_partition`, bench/peers.py's CPU compile); transformers'
per-block `torch.utils.checkpoint` and torchtitan-style selective checkpointing (`bench.peers.selective_policy_step`),
each in eager and compiled; memplan `selective-policy` plans, solved on this run's profile of the eager
capture at each fraction of the no-recomputation peak, at the least it reaches (`least_fraction`) and at each
PyTorch row's measured peak, run by `runtime.apply` in eager and compiled (the compiled rows' plans solved
with `compiled = true`: torch.compile runs a policy without selective checkpointing's dispatch modes, whose
cost the eager rows' plans count; at a compiled PyTorch row's peak, the cheapest plan whose compiled peak,
measured, is within that row's: `tasks.compiled.policy_search`, up to `--probes` plans measured and `--spread` more
solved above them). Peaks are `PeakMeter(allocator=True)` of a step after the first, times (wall and process CPU)
medians of interleaved rounds (`bench.peers.step_times`, the order reversed every other round), all as ratios to
eager's; "predicted" is the simulator's peak for the plan over eager's measured peak, "predicted time" its cost
(dispatch included) over the profile's eager step (the eager PyTorch rows as memplan predicts them:
`pytorch_predictions`); "grad err" the largest gradient difference from eager (compiled dropout draws its masks
differently). The last lines name, for each PyTorch row, the memplan rows of its mode that dominate it (peak and
time at most its, one below), and for each memplan row of its mode at most at its peak, the median over rounds of
the two steps' time ratio in the same round, with its 95% interval.
"""

from __future__ import annotations

import argparse
import copy
import statistics

import torch
import transformers

from memplan import runtime
from bench.peers import (COMPILE_BACKENDS, peak_and_grads, profiled_problem, selective_policy_step,
                         smallest_fraction, step_samples, torchtitan_schedule)
from memplan.runtime.policy.compiled_peak import compiled_peak
from memplan.runtime.format.plan import graph_provenance
from memplan.runtime.policy.apply import capture_eager
from memplan.runtime.policy.form import Regions, dispatch_cost, policy_schedule
from memplan.tasks.compiled.policy_search import COMPILED, search
from memplan.tasks.solve import solve
from memplan.tasks.solve.policy_solver import PolicyOptions
from memplan.tasks.solve.core.simulator import default_schedule, simulate
from memplan.tasks.solve.core.solution import SolveOptions
from memplan.tasks.validate.step_timing import median_interval


def gpt2():
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=6, n_embd=256, n_head=4, n_positions=256, vocab_size=2048,
                                     bos_token_id=0, eos_token_id=0, use_cache=False)
    config._attn_implementation = "eager"
    model = transformers.GPT2LMHeadModel(config)
    loss_fn = lambda m, x: m(input_ids=x, attention_mask=torch.ones_like(x), labels=x).loss  # noqa: E731
    return model, loss_fn, (torch.randint(0, 2048, (4, 256)),)


def llama():
    torch.manual_seed(0)
    config = transformers.LlamaConfig(num_hidden_layers=6, hidden_size=256, intermediate_size=688, num_attention_heads=4,
                                      num_key_value_heads=4, vocab_size=2048, max_position_embeddings=256,
                                      bos_token_id=0, eos_token_id=0, pad_token_id=0, use_cache=False)
    config._attn_implementation = "eager"
    model = transformers.LlamaForCausalLM(config)
    loss_fn = lambda m, x: m(input_ids=x, attention_mask=torch.ones_like(x), labels=x).loss  # noqa: E731
    return model, loss_fn, (torch.randint(0, 2048, (4, 256)),)


MODELS = {"gpt2": gpt2, "llama": llama}


def compiled(model, loss_fn, batch):
    """`model` under torch.compile (bench/peers.py's CPU backend), compiled by one step, and its step."""
    fn = torch.compile(model, backend=COMPILE_BACKENDS["aot_eager_decomp_partition"])
    step = lambda: loss_fn(fn, *batch).backward()  # noqa: E731
    step()
    model.zero_grad(set_to_none=True)
    return model, step


def least_fraction(problem, full: int, steps: int = 12) -> float | None:
    """The least predicted peak (fraction of `full`) `selective-policy` reaches: below the grid point of
    `smallest_fraction`, the budget bisected `steps` times (the grid alone stops at the first fraction that
    fails, above the least peak, where the solver returns a cheaper plan)."""
    coarse = smallest_fraction(problem, "selective-policy", SolveOptions(), full)
    if coarse is None:
        return None
    low, high = 0, round(coarse * full)
    for _ in range(steps):
        solution = solve(problem, "selective-policy", (low + high) // 2)
        if solution.feasible:
            high = solution.predicted_peak_bytes
        else:
            low = (low + high) // 2
    return high / full


def pytorch_predictions(problem, graph) -> dict[str, tuple[int, float, str]]:
    """memplan's predictions (peak, time, what it counts) of the eager PyTorch rows: per-block checkpointing is
    every region recomputed whole; torchtitan's policy `bench.peers.torchtitan_schedule`, with the dispatch of a
    policy in every region."""
    regions = Regions.of_problem(problem)
    whole = simulate(problem, policy_schedule(regions, {name: frozenset() for name in regions.members}))
    titan = simulate(problem, torchtitan_schedule(problem, graph))
    dispatch = dispatch_cost(problem.policy_dispatch, regions, {name: True for name in regions.members})
    return {"checkpoint per block": (whole.peak_bytes, whole.compute_cost, "every layer whole"),
            "selective checkpoint (torchtitan)": (titan.peak_bytes, titan.compute_cost + dispatch,
                                                  f"its decisions, with the dispatch of {len(regions.members)} policies")}


def dominated_by(rows: dict, times: dict, label: str, plans: list[str]) -> list[str]:
    """The memplan rows among `plans` whose measured peak and time are both at most row `label`'s, one below."""
    peak, spent = rows[label]["peak"], times[label]
    return [p for p in plans if rows[p]["peak"] <= peak and times[p] <= spent and (rows[p]["peak"], times[p]) != (peak, spent)]


def paired_ratio(samples: dict, plan: str, label: str, clock: int) -> tuple[float, tuple[float, float] | None]:
    """The median over rounds of `plan`'s step time over row `label`'s in the same round (`clock` 0: wall, 1: process
    CPU), and that median's distribution-free 95% interval (`tasks.validate.step_timing.median_interval`): a round that the
    host slows slows both."""
    ratios = [a[clock] / b[clock] for a, b in zip(samples[plan], samples[label])]
    return statistics.median(ratios), median_interval(ratios)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=sorted(MODELS), default="gpt2")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--fractions", type=float, nargs="*", default=[0.7])
    parser.add_argument("--probes", type=int, default=6)
    parser.add_argument("--spread", type=int, default=6)
    parser.add_argument("--peers", nargs="*", default=None, help="the PyTorch rows to plan at and time (e.g. "
                        "'selective checkpoint (torchtitan)'), with eager; default: all four. Fewer rows time more "
                        "rounds in the same time.")
    parser.add_argument("--no-least", action="store_true", help="skip the plan at the least peak memplan reaches")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model, loss_fn, batch = MODELS[args.model]()
    graph = capture_eager(model, loss_fn, batch)
    problem = profiled_problem(graph, f"{args.model}-policy-form")
    full = simulate(problem, default_schedule(problem)).peak_bytes
    hand = copy.deepcopy(model)
    hand.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    runs = {"eager": (model, lambda: loss_fn(model, *batch).backward()),
            "eager, compiled": compiled(copy.deepcopy(model), loss_fn, batch),
            "checkpoint per block": (hand, lambda: loss_fn(hand, *batch).backward()),
            "checkpoint per block, compiled": compiled(copy.deepcopy(hand), loss_fn, batch)}
    for label, (sac, step) in selective_policy_step(model, loss_fn, batch).items():
        runs[label] = (sac, step)
        runs[label + ", compiled"] = compiled(sac, loss_fn, batch)
    if args.peers is not None:
        unknown = set(args.peers) - set(runs) - {"eager", "eager, compiled"}
        if unknown:
            parser.error(f"--peers: unknown rows {sorted(unknown)}; rows: {sorted(set(runs) - {'eager'})}")
        runs = {k: v for k, v in runs.items() if k == "eager" or k in args.peers}
    peak_and_grads(model, runs["eager"][1])                      # eager's first step takes one-time buffers
    eager_peak, eager_grads = peak_and_grads(model, runs["eager"][1])
    rows = {}
    for label, (m, step) in runs.items():
        peak, grads = peak_and_grads(m, step)
        rows[label] = {"peak": peak / eager_peak, "err": max(float((a - b).abs().max()) for a, b in zip(eager_grads, grads))}
    peers = [label for label in runs if not label.startswith("eager")]
    least = None if args.no_least else least_fraction(problem, full)
    grid = {f"@ {f:.3f}": round(f * full) for f in [*args.fractions, *([least] if least else [])]}
    budgets = [(name, budget, under_compile) for under_compile in (False, True) for name, budget in grid.items()]
    budgets += [(f"at {label.removesuffix(', compiled')}'s peak", round(rows[label]["peak"] * eager_peak),
                 label.endswith(", compiled")) for label in peers]
    predicted = pytorch_predictions(problem, graph)

    def measure_compiled(solution):
        plan = solution.to_plan(problem)
        plan.provenance.update(graph_provenance(graph))
        return compiled_peak(plan, model, loss_fn, batch, graph=graph,
                             backend=COMPILE_BACKENDS["aot_eager_decomp_partition"])

    for name, budget, under_compile in budgets:
        if under_compile and name.startswith("at "):
            found = search(problem, budget, measure_compiled, probes=args.probes, spread=args.spread).best
            solution = found.solution if found else solve(problem, "selective-policy", budget, COMPILED)
            found_by = f"; measured search, solved at {found.solve_budget / eager_peak:.4f}" if found else \
                "; the measured search found no plan within"
        else:
            solution = solve(problem, "selective-policy", budget,
                             SolveOptions(params=PolicyOptions(compiled=under_compile)))
            found_by = ""
        if solution.feasible:
            plan = solution.to_plan(problem)
            plan.provenance.update(graph_provenance(graph))
            label = f"memplan policy {name}" + (", compiled" if under_compile else "")
            applied = runtime.apply(plan, copy.deepcopy(model), loss_fn, batch, graph=graph)
            runs[label] = compiled(applied, loss_fn, batch) if under_compile else \
                (applied, lambda m=applied: loss_fn(m, *batch).backward())
            predicted[label] = (solution.predicted_peak_bytes, solution.objective, solution.message + found_by)
            peak, grads = peak_and_grads(*runs[label])
            rows[label] = {"peak": peak / eager_peak,
                           "err": max(float((a - b).abs().max()) for a, b in zip(eager_grads, grads))}
    samples = step_samples(runs, args.rounds, alternate=True)
    times = {k: statistics.median(w for w, _ in v) for k, v in samples.items()}
    cpu_times = {k: statistics.median(c for _, c in v) for k, v in samples.items()}
    print(f"eager: {eager_peak / 2**20:.1f} MiB, {times['eager']:.0f} ms a step; no-recomputation peak predicted "
          f"{full / 2**20:.1f} MiB; {torch.get_num_threads()} thread(s), torch {torch.__version__}")
    print("| run | peak / eager | time / eager | CPU time / eager | predicted peak / eager | predicted time | grad err "
          "| plan |")
    print("|---|---|---|---|---|---|---|---|")
    for label, row in rows.items():
        pred, cost, message = predicted.get(label, (None, None, ""))
        print(f"| {label} | {row['peak']:.4f} | {times[label] / times['eager']:.3f} | "
              f"{cpu_times[label] / cpu_times['eager']:.3f} | "
              f"{'' if pred is None else f'{pred / eager_peak:.4f}'} | "
              f"{'' if cost is None else f'{cost / problem.cost.sum():.3f}'} | {row['err']:.1e} | {message} |")
    for label in peers:
        same_mode = [p for p in rows if p.startswith("memplan") and p.endswith(", compiled") == label.endswith(", compiled")]
        for clock, spent in (("wall", times), ("CPU", cpu_times)):
            found = dominated_by(rows, spent, label, same_mode)
            print(f"{label}, {clock} time: dominated by {', '.join(found) or 'no memplan plan'}")
        for plan in (p for p in same_mode if rows[p]["peak"] <= rows[label]["peak"]):
            paired = [paired_ratio(samples, plan, label, clock) for clock in (0, 1)]
            print(f"  {plan}: peak {rows[plan]['peak'] / rows[label]['peak']:.4f}x, time per round "
                  + ", ".join(f"{clock} {m:.3f}x" + ("" if span is None else f" [{span[0]:.3f}, {span[1]:.3f}]")
                              for clock, (m, span) in zip(("wall", "CPU"), paired))
                  + f" of {label}'s (95% interval of the median)")


if __name__ == "__main__":
    main()
