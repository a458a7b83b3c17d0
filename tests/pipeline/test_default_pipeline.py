"""The default pipeline.toml declares what the README says (12 plans: models, solvers, budgets)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_default_file_declares_what_the_readme_says():
    from tasks.config import expand_matrix, load_config

    cases = expand_matrix(load_config(ROOT / "pipeline.toml"))
    cells = {(c.model.name, c.batch_size, c.plan.solver, c.budget.label) for c in cases}
    expected = {("resnet18", 8, s, b) for s in ("checkmate-approx", "ap-greedy", "acg") for b in ("95pct", "93pct")}
    expected |= {("gpt2-tiny", 4, s, b) for s in ("checkmate-approx", "ap-greedy", "acg") for b in ("80pct", "60pct")}
    assert cells == expected and len(cases) == 12
    readme = (ROOT / "README.md").read_text()
    assert "each at two budgets (12 plans)" in readme
    assert re.search(r"\| `checkmate-approx`, `ap-greedy`, `acg` \| 80%, 60% \|", readme)


def test_the_default_pipeline_runs_end_to_end(tmp_path, harness):
    """The README's main job, `memplan run` on the default pipeline.toml (a copy, so its caches, store and
    plans land in tmp_path; timed for `steps` rounds only): all 12 cells are solved, validated against eager PyTorch and published, and on
    the CPU each plan's measured peak (the CPU allocator's, kernels' scratch included, which the profile
    prices as workspace) is its predicted peak to the byte, within the budget. (Neither model draws random
    numbers: a plan recomputing a random node would also hold a saved generator state, 5056 bytes on CPU,
    that the prediction does not count; docs/plan-format.md.)"""
    import torch

    from flows.plan import run_plan
    from tasks.publish import read_index

    # the file as it is, but timing stops at `steps` rounds: the rounds past it (up to max_steps) only narrow
    # the overhead's interval, which tests/pipeline/test_validate.py checks on a fake clock
    text = (ROOT / "pipeline.toml").read_text()
    assert re.search(r"^max_steps = 12 ", text, re.M)
    (tmp_path / "pipeline.toml").write_text(re.sub(r"^max_steps = 12 ", "max_steps = 6 ", text, flags=re.M))
    outcomes = run_plan(tmp_path / "pipeline.toml")
    assert len(outcomes) == 12 and all(o["status"] == "published" for o in outcomes), outcomes
    assert {r["alias"] for r in read_index(tmp_path / "plans")} == {o["alias"] for o in outcomes}
    on_cpu = not torch.cuda.is_available()                 # device = "auto" in the default file
    for o in outcomes:
        assert o["predicted_peak_bytes"] <= o["budget_bytes"], o
        assert o["measured_peak_bytes"] == o["predicted_peak_bytes"] or not on_cpu, o
    assert sum(o["arena_peak_bytes"] is not None for o in outcomes) == 2      # acg's resnet18 plans
