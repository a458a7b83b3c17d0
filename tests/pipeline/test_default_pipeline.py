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
    expected |= {("gpt2-tiny", 4, s, b) for s in ("checkmate-approx", "ap-greedy") for b in ("80pct", "60pct")}
    expected |= {("gpt2-tiny", 4, "acg", b) for b in ("80pct", "65pct")}
    assert cells == expected and len(cases) == 12
    readme = (ROOT / "README.md").read_text()
    assert "each at two budgets (12 plans)" in readme
    assert re.search(r"\| `acg` \| 80%, 65% \|", readme)
