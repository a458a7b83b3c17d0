"""Which `[[models]]` entry and batch size a plan file was made for."""

from __future__ import annotations

import json
from pathlib import Path

from memplan.runtime.format.plan import Plan
from memplan.tasks.config import ConfigError, ModelConfig, PipelineConfig


def model_for_plan(config: PipelineConfig, plan: Plan, model: str | None, batch: int | None) -> tuple[ModelConfig, int]:
    """The (model entry, batch size) of `config` the plan belongs to: the only cell left after the
    `model`/`batch` filters, or the one whose traced graph in `cache_dir/graphs` has the plan's fingerprint."""
    cells = config.model_batches(model, batch)
    if len(cells) > 1:
        traced = _traced_cells(Path(config.cache_dir) / "graphs", plan.fingerprint)
        cells = [(m, b) for m, b in cells if (m.name, b) in traced] or cells
    if len(cells) != 1:
        listed = ", ".join(f"--model {m.name} --batch {b}" for m, b in cells) or "none"
        raise ConfigError(
            f"cannot tell which model of the pipeline file plan {plan.fingerprint[:12]} was made for "
            f"(candidates: {listed}); pass --model and --batch."
        )
    return cells[0]


def _traced_cells(graphs: Path, fingerprint: str) -> set[tuple[str, int]]:
    found = set()
    for path in graphs.glob("*.json"):
        data = json.loads(path.read_text())
        if data.get("fingerprint") == fingerprint:
            found.add((data["meta"].get("model"), data["meta"].get("batch_size")))
    return found
