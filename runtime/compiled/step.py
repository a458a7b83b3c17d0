"""A training step compiled by inductor in the compiled form."""

from __future__ import annotations

import itertools
import types
from typing import Any, Callable

import torch

from memplan.runtime.compiled.partition import Decide, DecidingPartitioner, Partitioned

_STEPS = itertools.count()


def _calling(fn: Callable[..., Any]) -> Callable[..., Any]:
    def step(*args: Any, **kwargs: Any) -> Any:
        return fn(*args, **kwargs)
    return step


def own_code(fn: Callable[..., Any]) -> Callable[..., Any]:
    """A function calling `fn` whose code object is its own: Dynamo caches compiled graphs per code object, so
    two steps of one loss function (two plans, two model copies) would otherwise share the first one's graph."""
    template = _calling(fn)
    code = template.__code__.replace(co_name=f"memplan_compiled_step_{next(_STEPS)}")
    return types.FunctionType(code, template.__globals__, code.co_name, None, template.__closure__)


class CompiledStep:
    """`fn` under `torch.compile(backend="inductor")`, each compiled region partitioned by `decide`
    (`DecidingPartitioner`): the first call compiles, as torch.compile does; `partitioned` lists what each
    region's forward saves. Inductor's graph caches are off while it compiles: a cached graph would skip the
    partitioner."""

    def __init__(self, fn: Callable[..., Any], decide: Decide) -> None:
        self.partitioner = DecidingPartitioner(decide)
        self._compiled = torch.compile(own_code(fn), backend="inductor")

    @property
    def partitioned(self) -> list[Partitioned]:
        return self.partitioner.partitioned

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        with torch._inductor.config.patch(custom_partitioner_fn=self.partitioner, fx_graph_cache=False), \
                torch._functorch.config.patch(enable_autograd_cache=False):
            return self._compiled(*args, **kwargs)
