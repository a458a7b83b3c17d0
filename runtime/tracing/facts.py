"""What a captured graph records about its ops for torch-free planners (docs/graph-format.md): the nodes
that may draw random numbers, and per dispatch backend the nodes whose default implementation arena mode
writes in place. Graphs saved before these facts were recorded are refused by the solve path with a
request to re-trace (`runtime.format.graph.OpGraph.random_nodes`)."""

from __future__ import annotations

from typing import Any

from memplan.runtime.execute.arena import in_place_nodes
from memplan.runtime.format.graph import BACKENDS, OpGraph
from memplan.runtime.tracing.ops import random_nodes


def graph_facts(graph: OpGraph) -> dict[str, Any]:
    """`meta["random_nodes"]` and `meta["in_place"]` (backend -> node ids) of `graph`."""
    return {"random_nodes": random_nodes(graph),
            "in_place": {key: sorted(in_place_nodes(graph, device)) for key, device in BACKENDS.items()}}
