"""`memplan run` making policy-form plans beside executor plans, measured side by side in one run.

    .venv/bin/python bench/policy_pipeline.py [--activation gelu_new gelu_pytorch_tanh] [--fractions 0.7 0.5]
                                              [--optimizer none adamw] [--steps 10] [--keep FOLDER]

One pipeline.toml per activation, each with the GPT-2 of bench/peers.py (6 layers, 256 wide, seq 256, batch
4, transformers' default dropout, eager attention, the key/value cache off) and, at each fraction of eager
PyTorch's measured peak (`"70% eager"`: the same bytes for both forms, whose graphs' checkpoint-all peaks
differ where the executor's rewrites apply), a `selective-policy` plan (policy form: solved on
`capture_eager`'s graph, validated by `runtime.apply` and the model's own backward) and a `dtr` plan
(executor form, `runtime.load`), all of one cell validated in the same timing rounds against eager PyTorch.
Columns, as ratios: budget, predicted and measured peak over eager's measured peak; measured over predicted;
the step-time overhead over eager (median of per-round ratios); the status (a rejected plan's first reason). GPT-2's default `gelu_new` is several graph
ops whose backward keeps a value longer than the policy form predicts (runtime/policy/form.py).

With `--optimizer adamw` (or `sgd-momentum`, ...) each activation also runs a pipeline whose plans set
`optimizer_in_step = true` for that optimizer: the policy plan runs it in `runtime.apply(..., optimizer=opt)`, the
executor plan in `runtime.load(..., optimizer=opt)`, each compared on its parameters after the update and timed
against eager's step followed by `opt.step()`; "eager" is still the reference's backward (its gradients alive at
its end), without `opt.step()`'s temporaries.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

PIPELINE = '''
device = "cpu"
optimizer = "{optimizer}"

[[models]]
name = "gpt2"
transformers = "gpt2"
kwargs = {{ n_layer = 6, n_embd = 256, n_head = 4, n_positions = 256, vocab_size = 2048, bos_token_id = 0, eos_token_id = 0, use_cache = false, attn_implementation = "eager", activation_function = "{activation}" }}
loss = "causal_lm"
batch_sizes = [4]
inputs = [{{ shape = [256], dtype = "int64", high = 2048 }}]

[profile]
warmup = 1
repeats = 3

[[plans]]
solver = "selective-policy"
budgets = {budgets}
optimizer_in_step = {in_step}

[[plans]]
solver = "dtr"
budgets = {budgets}
optimizer_in_step = {in_step}

[validate]
steps = {steps}
max_steps = {steps}
'''


def run(folder: Path, activation: str, fractions: list[float], steps: int, optimizer: str) -> list[dict]:
    """The pipeline's outcomes; `optimizer` "none": the optimizer after the step, else that one inside it."""
    from memplan.flows.plan import PipelineFailed, run_plan

    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "pipeline.toml"
    budgets = "[" + ", ".join(f'"{f:.0%} eager"' for f in fractions) + "]"
    in_step = optimizer != "none"
    path.write_text(PIPELINE.format(activation=activation, budgets=budgets, steps=steps,
                                    optimizer=optimizer if in_step else "sgd", in_step=str(in_step).lower()))
    try:
        return run_plan(path)
    except PipelineFailed as failed:                    # rejected plans are rows of the table too
        return failed.outcomes


def row(activation: str, optimizer: str, o: dict) -> str:
    eager = o["eager_peak_bytes"]
    ratio = (lambda key: "" if o[key] is None or not eager else f"{o[key] / eager:.2f}")  # noqa: E731
    measured, predicted = o["measured_peak_bytes"], o["predicted_peak_bytes"]
    over = "" if measured is None or not predicted else f"{measured / predicted:.3f}"
    overhead = "" if o["overhead"] is None else f"{o['overhead']:+.1%}"
    reasons = o["message"].split(" failed validation on ", 1)[-1].split(": ", 1)[-1]
    status = o["status"] if o["status"] != "rejected" else "rejected: " + reasons.split("; ")[0].split(" (allowed")[0]
    return (f"| {activation} | {optimizer} | {o['solver']} | {o['form']} | {o['budget']} | {ratio('budget_bytes')} "
            f"| {ratio('predicted_peak_bytes')} | {ratio('measured_peak_bytes')} | {over} | {overhead} | {status} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--activation", nargs="*", default=["gelu_new", "gelu_pytorch_tanh"])
    parser.add_argument("--fractions", type=float, nargs="*", default=[0.7])
    parser.add_argument("--optimizer", nargs="*", default=["none"],
                        help="'none' (after the step) and/or optimizers run inside the step, e.g. adamw")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--keep", type=Path, help="run in this folder (kept) instead of a temporary one")
    args = parser.parse_args()
    from prefect.testing.utilities import prefect_test_harness

    lines = ["| activation | optimizer in step | solver | form | budget | budget / eager | predicted / eager "
             "| measured / eager | measured / predicted | overhead | status |",
             "|---|---|---|---|---|---:|---:|---:|---:|---:|---|"]
    with tempfile.TemporaryDirectory(prefix="policy-pipeline-") as tmp, \
            prefect_test_harness(server_startup_timeout=120):
        for activation in args.activation:
            for optimizer in args.optimizer:
                folder = (args.keep or Path(tmp)) / f"{activation}-{optimizer}"
                lines += [row(activation, optimizer, o)
                          for o in run(folder, activation, args.fractions, args.steps, optimizer)]
    print("\n".join(lines))


if __name__ == "__main__":
    main()
