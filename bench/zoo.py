"""The model zoo through `memplan run` (issue #53): one small model per family a user trains, each declared in a
`pipeline.toml` as a user writes it, planned by `dtr` at `max_overhead = 0.10` and published; or every registered
solver on a transformers GPT-2 the pipeline builds, with and without dropout.

    .venv/bin/python -m bench.zoo [--families bert-mlm t5-seq2seq ...] [--keep FOLDER]
    .venv/bin/python -m bench.zoo --all-solvers [--keep FOLDER]

The families (`FAMILIES` of tests/pipeline/zoo_models.py, which the suite's zoo test, tests/pipeline/test_zoo.py,
trains three steps beside eager) are encoder MLM, encoder-decoder, decoder LMs with grouped-query, sliding-window and rotary
attention, CNNs with SiLU, squeeze-excite, hardswish and stochastic depth, a ViT, bfloat16 parameters and
autocast; `resnet18-ill` is torchvision's ResNet-18 at batch 2 on 32x32 images, whose BatchNorm over two samples
makes eager's own float32 gradients far from a float64 step's (validation judges a plan against that rounding).
Prints one row per plan: the cell, its status, measured peak over eager's measured peak, the measured overhead.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import textwrap
from pathlib import Path
from typing import Any

from tests.pipeline.zoo_models import BATCH, CLASSES, FACTORIES, FAMILIES, IMAGE

FULL_SIZE = {"efficientnet-b0": dict(torchvision="efficientnet_b0", loss="cross_entropy", kwargs=dict(num_classes=10),
                                    inputs=[{"shape": [3, 64, 64]}, CLASSES])}
"""Families at the size the issue tried them (slower: minutes a stage on 2 cores)."""

ILL_CONDITIONED = {"resnet18-ill": dict(torchvision="resnet18", loss="cross_entropy", kwargs=dict(num_classes=4),
                                        inputs=[IMAGE, {"shape": [], "dtype": "int64", "high": 4}])}

GPT2_BUILT = dict(transformers="gpt2", loss="causal_lm", inputs=[{"shape": [64], "dtype": "int64", "high": 512}],
                  kwargs=dict(n_layer=2, n_embd=64, n_head=2, vocab_size=512, n_positions=64, bos_token_id=0,
                              eos_token_id=0))
"""A GPT-2 the pipeline builds with transformers' defaults (SDPA attention; dropout 0.1 unless turned off)."""
NO_DROPOUT = dict(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)


def toml_value(value: Any) -> str:
    """`value` as a TOML value (inline tables and arrays; strings in JSON's escapes, which TOML shares)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, dict):
        return "{ " + ", ".join(f"{k} = {toml_value(v)}" for k, v in value.items()) + " }"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    if isinstance(value, str):
        return json.dumps(value)
    return repr(value)


def pipeline_text(models: dict[str, dict[str, Any]], plans: list[dict[str, Any]]) -> str:
    """A pipeline file: CPU, the given models at batch `BATCH`, the given `[[plans]]` tables."""
    lines = ['device = "cpu"', "seed = 0", ""]          # store, cache and plans: beside the file
    for name, entry in models.items():
        lines += ["[[models]]", f"name = {toml_value(name)}", f"batch_sizes = [{BATCH}]"]
        lines += [f"{key} = {toml_value(value)}" for key, value in entry.items()] + [""]
    for table in plans:
        lines += ["[[plans]]"] + [f"{key} = {toml_value(value)}" for key, value in table.items()] + [""]
    return "\n".join(lines)


def all_solver_plans() -> list[dict[str, Any]]:
    """Every registered solver at one budget, 80% of its graph's checkpoint-all peak (a fixed budget: one solve
    each, where `max_overhead` would search; the exact solvers take minutes a solve)."""
    from memplan.tasks.solve import SOLVERS

    return [{"solver": name, "budgets": ["80%"]} for name in SOLVERS]


def run(folder: Path, models: dict[str, dict[str, Any]], plans: list[dict[str, Any]]) -> list[dict]:
    """`memplan run` on a pipeline file of `models` x `plans` in `folder`; its outcomes, failures included."""
    from memplan.flows.plan import PipelineFailed, run_plan

    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")   # as `memplan run` (a busy host)

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "zoo_factories.py").write_text(textwrap.dedent(FACTORIES))
    path = folder / "pipeline.toml"
    path.write_text(pipeline_text(models, plans))
    try:
        return run_plan(path)
    except PipelineFailed as failed:
        return failed.outcomes


def row(o: dict) -> str:
    eager, measured = o["eager_peak_bytes"], o["measured_peak_bytes"]
    peak = "" if measured is None or not eager else f"{measured / eager:.3f}"
    overhead = "" if o["overhead"] is None else f"{o['overhead']:+.1%}"
    limited = o.get("overhead_vs_no_recompute")
    overhead += "" if limited is None else f" ({limited:+.1%} vs no recomputation)"
    status = o["status"] if o["status"] == "published" else f"{o['status']}: {o['message'][:160]}"
    return f"| {o['model']} | {o['solver']} | {o['form']} | {o['budget']} | {peak} | {overhead} | {status} |"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--families", nargs="*", default=[*FAMILIES, *ILL_CONDITIONED])
    parser.add_argument("--all-solvers", action="store_true",
                        help="every registered solver on a pipeline-built GPT-2, with and without dropout")
    parser.add_argument("--keep", type=Path, help="run in this folder (kept) instead of a temporary one")
    args = parser.parse_args()
    if args.all_solvers:
        models = {"gpt2-dropout": GPT2_BUILT,
                  "gpt2-no-dropout": dict(GPT2_BUILT, kwargs={**GPT2_BUILT["kwargs"], **NO_DROPOUT})}
        plans = all_solver_plans()
    else:
        known = {**FAMILIES, **ILL_CONDITIONED, **FULL_SIZE}
        unknown = sorted(set(args.families) - set(known))
        if unknown:
            parser.error(f"unknown families {unknown}; known: {', '.join(known)}")
        models, plans = {name: known[name] for name in args.families}, [{"solver": "dtr", "max_overhead": [0.10]}]
    with tempfile.TemporaryDirectory() as scratch:
        outcomes = run(args.keep or Path(scratch), models, plans)
    print("| model | solver | form | budget | measured peak / eager | overhead | status |\n|---|---|---|---|---|---|---|")
    for o in outcomes:
        print(row(o))


if __name__ == "__main__":
    main()
