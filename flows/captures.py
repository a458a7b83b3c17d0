"""The graphs this process captured, by fingerprint and the plan form they were captured for (an executor
graph and a policy-form graph, `runtime.policy.apply.capture_eager`'s, share a fingerprint where no rewrite
applies): `trace_step` keeps them so later stages on the same process skip a second capture.

A module of its own, reached only as `captures.<function>`: cloudpickle pickles modules by reference, so
a task or flow function pickled by value for a Dask worker (prefect-dask) carries no captured graph (FX
programs hold torch objects that cannot be pickled). A worker process starts with an empty cache and
captures again where it needs a graph.
"""

from __future__ import annotations

from typing import Any, Iterable

_GRAPHS: dict[tuple[str, str], Any] = {}  # (fingerprint, form) -> captured OpGraph (with its FX program)


def keep(fingerprint: str, graph: Any, form: str = "executor") -> None:
    """Remember `graph`, captured for plans in `form`, under `fingerprint` for this process."""
    _GRAPHS[fingerprint, form] = graph


def get(fingerprint: str, form: str = "executor") -> Any | None:
    """The graph captured here for plans in `form` under `fingerprint`, or None."""
    return _GRAPHS.get((fingerprint, form))


def forget(keys: Iterable[tuple[str, str]]) -> None:
    """Drop the graphs of the (fingerprint, form) pairs `keys`."""
    for key in keys:
        _GRAPHS.pop(key, None)
