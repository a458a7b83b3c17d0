"""Helpers shared by the solver tests: Checkmate's unit-cost linear graphs and the benchmark files."""

from __future__ import annotations

from pathlib import Path

import pytest

from memplan.tasks.solve.core.benchmarks import benchmark_graphs
from memplan.tasks.solve.core.problem import Problem


def linear_graph(n: int, cost: float = 1.0, nbytes: int = 1) -> Problem:
    """Checkmate's linear training graph (sec. 4.6, appendix A): 2n+1 nodes, chain edges i -> i+1
    plus forward node i -> node 2n-i; nodes 0..n are forward (n is the loss), n+1..2n backward."""
    size = 2 * n + 1
    edges = [(i, i + 1) for i in range(size - 1)] + [(i, 2 * n - i) for i in range(n)]
    return Problem.from_edges([cost] * size, [nbytes] * size, edges,
                              backward=[i > n for i in range(size)], name=f"linear{n}")


@pytest.fixture(scope="session")
def linear():
    """The `linear_graph(n)` factory."""
    return linear_graph


@pytest.fixture(scope="session")
def benchmark_paths() -> list[Path]:
    return benchmark_graphs()
