"""Where the public benchmark graphs live (shared/benchmarks/graphs, next to the repository)."""

from __future__ import annotations

import os
from pathlib import Path

from memplan.tasks.solve.core.problem import ProblemError

_CANDIDATES = (
    Path(__file__).resolve().parents[4] / "shared" / "benchmarks" / "graphs",
    Path("/work/shared/benchmarks/graphs"),
)


def benchmark_graphs() -> list[Path]:
    """The benchmark JSON files, from $MEMPLAN_BENCHMARKS or shared/benchmarks/graphs beside the repo."""
    env = os.environ.get("MEMPLAN_BENCHMARKS")
    folders = (Path(env),) if env else _CANDIDATES
    for folder in folders:
        files = sorted(folder.glob("*.json"))
        if files:
            return files
    raise ProblemError(f"no benchmark graphs (*.json) in {', '.join(map(str, folders))}; set MEMPLAN_BENCHMARKS "
                       f"to the folder holding them.")
