"""The one problem loader: a graph file (and, for a memplan graph, its newest complete profile) as the
`Problem` the solvers see. `memplan solve` and the pipeline's solve stage both load through here."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from memplan.runtime.format.graph import OpGraph
from memplan.runtime.variants.offered import graph_variants
from memplan.tasks.config import VARIANT_RULES, VariantChoice
from memplan.tasks.solve.core.problem import Problem, ProblemError
from memplan.tasks.store.query import CostTable, load_costs


@dataclass(frozen=True)
class LoadedProblem:
    """A problem with where it came from: `graph` and `costs` are None for a node-link benchmark."""

    problem: Problem
    graph: OpGraph | None
    costs: CostTable | None

    @property
    def device(self) -> str | None:
        return None if self.costs is None else self.costs.device

    @property
    def profile_run_id(self) -> str | None:
        return None if self.costs is None else self.costs.run_id


def load_problem(path: str | os.PathLike, *, device: str | None = None,
                 store: str | os.PathLike | None = None, variants: VariantChoice = "all") -> LoadedProblem:
    """The problem of a memplan-graph JSON, priced by the newest complete profile of that graph in
    `store` (on `device` if given; `tasks.store.profiles.ProfileNotFoundError` says what to profile), with the
    implementation variants of `variants` (`VARIANT_RULES`) that the graph offers and the profile measured
    (for "bit-identical", only those the profile also found bit-identical on its device: `verified_exact`);
    or of a node-link benchmark graph (shared/benchmarks/README.md)."""
    if variants not in VARIANT_RULES:
        raise ProblemError(f"variants = {variants!r} is not a choice; use one of "
                           f"{', '.join(map(repr, VARIANT_RULES))}.")
    path = Path(path)
    try:
        head = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ProblemError(f"cannot read graph file {path}: {exc}. Pass a memplan-graph JSON (from `memplan "
                           f"trace`) or a node-link benchmark graph.") from None
    if isinstance(head, dict) and head.get("format") == "memplan-graph":
        graph = OpGraph.from_json(head, source=f"graph file {path}")
        costs = load_costs(graph.fingerprint, device, root=store)
        offered = graph_variants(graph, VARIANT_RULES[variants])
        if variants == "bit-identical":
            offered = offered.restricted(lambda s: verified_exact(costs, s.node, s.name))
        problem = Problem.from_graph(graph, costs, offered, graph.random_nodes())
        return LoadedProblem(problem, graph, costs)
    return LoadedProblem(Problem.from_node_link(path), None, None)


def verified_exact(costs: CostTable, node: int, impl: str) -> bool:
    """Whether the profile found variant `impl` of `node` bit-identical to the default on its device (False
    when it was not compared: unavailable there, or a profile of schema version 1)."""
    cost = costs.variants.get(node, {}).get(impl)
    return cost is not None and cost.exact is True
