"""A sweep of (model, budget, solver) cells through the `plan` flow with the default thread pool and with a
local Dask cluster (prefect-dask, `[run] task_runner = "dask"`), side by side in one run.

Both runners start from the same traced graph and the same profile run (a first, untimed run traces and
profiles; its solve and validate results are then dropped from a copy of its cache for each timed run), so
they must produce the same plans: the table compares each cell's schedule and predicted peak, then prints
the wall time of each runner and their ratio.

    PYTHONPATH=$PWD python bench/sweep_dask.py [--workers 2]

Measured 2026-11-25 on the team's shared 2-core machine (load average about 17 during the run): 8 cells
(gpt2-tiny, 1 layer: checkmate-approx x3, ap-greedy x2, acg x2, hierarchical x1), the same 8 plans
(identical plan ids) from both runners; threads 395 s, local Dask cluster of 2 worker processes 508 s,
ratio 0.78 (Dask slower). With no idle core to fan out to, the Dask workers only add their own start-up
(each imports torch and Prefect and re-loads the graph) and run the validations' timed steps side by
side; the runner pays off on a cluster with idle workers (`dask_address`).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

PIPELINE = """
device = "cpu"
store = "{store}"
cache_dir = "{cache}"

[[models]]
name = "gpt2-tiny"
transformers = "gpt2"
kwargs = {{ n_layer = 1, n_embd = 128, n_head = 4, n_positions = 128, vocab_size = 2048, bos_token_id = 0, eos_token_id = 0, resid_pdrop = 0.0, embd_pdrop = 0.0, attn_pdrop = 0.0 }}
loss = "causal_lm"
batch_sizes = [4]
inputs = [{{ shape = [128], dtype = "int64", high = 2048 }}]

[profile]
warmup = 1
repeats = 3

[[plans]]
solver = "checkmate-approx"
budgets = ["85%", "75%", "65%"]
time_limit_s = 60

[[plans]]
solver = "ap-greedy"
budgets = ["85%", "70%"]

[[plans]]
solver = "acg"
budgets = ["85%", "70%"]

[[plans]]
solver = "hierarchical"
budgets = ["75%"]

[validate]
steps = 2

[run]
task_runner = "{runner}"
dask_workers = {workers}
"""


def write_config(folder: Path, runner: str, cache: Path, store: Path, workers: int) -> Path:
    path = folder / f"pipeline-{runner}.toml"
    path.write_text(PIPELINE.format(store=store, cache=cache, runner=runner, workers=workers))
    return path


def fresh_cache(source: Path, target: Path) -> None:
    """`source` without its solve and validate results: traces and the profile run are re-used."""
    shutil.copytree(source, target)
    shutil.rmtree(target / "solutions", ignore_errors=True)
    for record in (target / "prefect").iterdir():
        if record.name.startswith(("solve-", "validate-")):
            record.unlink()


def plans(outcomes: list[dict]) -> dict[str, tuple]:
    """Per cell: status, predicted peak and the published plan's id (a hash of its content)."""
    return {o["alias"]: (o["status"], o["predicted_peak_bytes"], o.get("plan_id")) for o in outcomes}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=2, help="Dask worker processes (one thread each).")
    args = parser.parse_args()

    import os

    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")
    from memplan.flows.plan import PipelineFailed, run_plan
    from memplan.tasks.config import expand_matrix, load_config

    def run(config: Path) -> tuple[list[dict], float]:
        start = time.perf_counter()
        try:
            outcomes = run_plan(config)
        except PipelineFailed as failed:
            outcomes = failed.outcomes
        return outcomes, time.perf_counter() - start

    with tempfile.TemporaryDirectory(prefix="memplan-sweep-") as tmp:
        tmp = Path(tmp)
        store = tmp / "store"
        warm = write_config(tmp, "threads", tmp / "cache-warm", store, args.workers)
        print(f"cells: {len(expand_matrix(load_config(warm)))}; tracing and profiling once ...", flush=True)
        run(warm)
        results = {}
        for runner in ("threads", "dask"):
            fresh_cache(tmp / "cache-warm", tmp / f"cache-{runner}")
            config = write_config(tmp, runner, tmp / f"cache-{runner}", store, args.workers)
            outcomes, seconds = run(config)
            results[runner] = (plans(outcomes), seconds)

    (threads, t_threads), (dask, t_dask) = results["threads"], results["dask"]
    from rich.console import Console
    from rich.table import Column, Table

    table = Table(Column("cell", no_wrap=True), "status", "predicted peak (threads)", "predicted peak (dask)", "same plan",
                  title="plan flow: thread pool vs local Dask cluster")
    for alias in threads:
        same = threads[alias] == dask.get(alias)
        table.add_row(alias, threads[alias][0], f"{threads[alias][1]:,}", f"{dask[alias][1]:,}", str(same))
    Console().print(table)
    print(json.dumps({"cells": len(threads), "same_plans": threads == dask, "threads_s": round(t_threads, 1),
                      "dask_s": round(t_dask, 1), "dask_workers": args.workers,
                      "speedup_dask_over_threads": round(t_threads / t_dask, 2)}))


if __name__ == "__main__":
    main()
