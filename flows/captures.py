"""The graphs this process captured, by fingerprint: `trace_step` keeps them so later stages on the same
process skip a second capture.

A module of its own, reached only as `captures.<function>`: cloudpickle pickles modules by reference, so
a task or flow function pickled by value for a Dask worker (prefect-dask) carries no captured graph (FX
programs hold torch objects that cannot be pickled). A worker process starts with an empty cache and
captures again where it needs a graph.
"""

from __future__ import annotations

from typing import Any, Iterable

_GRAPHS: dict[str, Any] = {}  # fingerprint -> captured OpGraph (with its FX program)


def keep(fingerprint: str, graph: Any) -> None:
    """Remember `graph` under `fingerprint` for this process."""
    _GRAPHS[fingerprint] = graph


def get(fingerprint: str) -> Any | None:
    """The graph captured here under `fingerprint`, or None."""
    return _GRAPHS.get(fingerprint)


def forget(fingerprints: Iterable[str]) -> None:
    """Drop the graphs of `fingerprints`."""
    for fingerprint in fingerprints:
        _GRAPHS.pop(fingerprint, None)
