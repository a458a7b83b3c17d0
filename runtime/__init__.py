"""memplan runtime: capture a training step, load and execute memory plans, measure memory.

Exports are lazy (module `__getattr__`), so `import memplan.runtime.format.graph` or `memplan.runtime.format.plan` never imports torch.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "OpGraph": "memplan.runtime.format.graph",
    "Plan": "memplan.runtime.format.plan",
    "default_plan": "memplan.runtime.format.plan",
    "capture": "memplan.runtime.tracing.capture",
    "node_function": "memplan.runtime.tracing.node_functions",
    "variant_function": "memplan.runtime.tracing.node_functions",
    "load": "memplan.runtime.execute.executor",
    "apply": "memplan.runtime.policy.apply",
    "ArenaFallbackWarning": "memplan.runtime.execute.arena",
    "chunked_linear_cross_entropy": "memplan.runtime.chunked_loss",
    "chunked_causal_lm_loss": "memplan.runtime.chunked_loss",
    "ChunkedCausalLMLoss": "memplan.runtime.chunked_loss",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'runtime' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
