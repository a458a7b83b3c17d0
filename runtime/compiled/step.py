"""A training step compiled by inductor in the compiled form."""

from __future__ import annotations

import itertools
import time
import types
import warnings
from typing import Any, Callable, Literal

import torch
from torch import nn

from memplan.runtime.compiled.partition import Decide, DecidingPartitioner, Partitioned
from memplan.runtime.compiled.records import Decision, JointGraph, RegionDecision

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


class GraphBreakError(ValueError):
    """A step torch.compile cannot compile whole (a graph break), with where it breaks."""


class CompiledStep:
    """`fn` under `torch.compile(backend="inductor", dynamic=False, fullgraph=True)`, its joint graph partitioned by
    `decide` (`DecidingPartitioner`; a step that graph-breaks raises `GraphBreakError` naming where: the frames after
    a break would share Dynamo's cache with every other step of the same model code, and so one step's decisions):
    the first call compiles, as torch.compile does (and so does each new batch shape);
    `partitioned` lists what each region's forward saves, `compile_seconds` the time of the calls that compiled.
    Inductor's graph caches are off while it compiles: a cached graph would skip the partitioner. With
    `exact_random`, inductor draws random numbers as eager PyTorch does (`fallback_random`: dropout's masks equal
    eager's, for validation)."""

    def __init__(self, fn: Callable[..., Any], decide: Decide, exact_random: bool = False) -> None:
        self.partitioner = DecidingPartitioner(decide)
        self.exact_random = exact_random
        self.compile_seconds = 0.0
        self._fn = fn
        self._compiled = torch.compile(own_code(fn), backend="inductor", dynamic=False, fullgraph=True)

    @property
    def partitioned(self) -> list[Partitioned]:
        return self.partitioner.partitioned

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        regions, start = len(self.partitioned), time.perf_counter()
        with torch._inductor.config.patch(custom_partitioner_fn=self.partitioner, fx_graph_cache=False,
                                          fallback_random=self.exact_random), \
                torch._functorch.config.patch(enable_autograd_cache=False):
            try:
                out = self._compiled(*args, **kwargs)
            except torch._dynamo.exc.Unsupported:
                breaks = graph_breaks(self._fn, *args, **kwargs)
                raise GraphBreakError(
                    "torch.compile breaks this step's graph at " + ("; ".join(breaks[:3]) or "a place Dynamo does "
                    "not name") + ". The compiled form plans a step torch.compile compiles whole (one joint graph, "
                    "fullgraph=True): remove the break (torch._dynamo.explain lists them), or plan the step in the "
                    "executor or policy form.") from None
        if len(self.partitioned) > regions:
            self.compile_seconds += time.perf_counter() - start
        return out


class CompiledPlanWarning(UserWarning):
    """torch.compile made a joint graph a compiled-form plan does not name (another batch shape, dtype or model):
    inductor partitions it by its own choice."""


Unplanned = Literal["warn", "error"]


class PlannedDecide:
    """A `Decide` answering from a plan's region decisions by joint graph fingerprint. A graph the plan does not
    name is partitioned by inductor's own choice with a `CompiledPlanWarning` (`unplanned = "warn"`) or refused
    (`"error"`)."""

    def __init__(self, regions: tuple[RegionDecision, ...], unplanned: Unplanned = "warn") -> None:
        if unplanned not in ("warn", "error"):
            raise ValueError(f"unplanned={unplanned!r}: give 'warn' (inductor partitions a graph the plan does not "
                             f"name) or 'error' (refuse it).")
        self.regions = {r.fingerprint: r.decision for r in regions}
        self.unplanned = unplanned

    def __call__(self, joint: JointGraph) -> Decision:
        decision = self.regions.get(joint.fingerprint)
        if decision is not None:
            return decision
        message = (f"torch.compile made a joint graph ({len(joint.nodes)} ops, fingerprint {joint.fingerprint[:12]}) "
                   f"that this compiled-form plan does not name (it names {', '.join(f[:12] for f in self.regions)}): "
                   f"the batch shape, dtype, model or torch version differs from the plan's. ")
        if self.unplanned == "error":
            raise ValueError(message + "Make a plan for this step (memplan run with form = \"compiled\"), or load "
                                       "with unplanned=\"warn\" to let inductor partition it.")
        warnings.warn(message + "Inductor partitions it by its own choice.", CompiledPlanWarning, stacklevel=2)
        return Decision()


class CompiledTrainStep:
    """`step(*batch)`: `loss_fn(model, *batch)` compiled by inductor under a compiled-form plan's decisions
    (`PlannedDecide`), then its backward; returns the loss (detached), gradients accumulate into `p.grad` as in
    eager PyTorch. The first call compiles."""

    def __init__(self, regions: tuple[RegionDecision, ...], model: nn.Module,
                 loss_fn: Callable[..., torch.Tensor], unplanned: Unplanned = "warn", exact_random: bool = False):
        self.model, self.loss_fn = model, loss_fn
        self.compiled = CompiledStep(lambda *batch: loss_fn(model, *batch), PlannedDecide(regions, unplanned),
                                     exact_random)

    def __call__(self, *batch: Any) -> torch.Tensor:
        loss = self.compiled(*batch)
        loss.backward()
        return loss.detach()


def graph_breaks(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> list[str]:
    """Where Dynamo breaks the graph of `fn(*args, **kwargs)`: "file:line: reason" for each break (runs `fn` once
    through `torch._dynamo.explain`, whose caches are reset after)."""
    try:
        explained = torch._dynamo.explain(own_code(fn))(*args, **kwargs)
    finally:
        torch.compiler.reset()
    out = []
    for reason in explained.break_reasons:
        frame = reason.user_stack[-1] if reason.user_stack else None
        where = f"{frame.filename}:{frame.lineno}: " if frame is not None else ""
        out.append(where + " ".join(str(reason.reason).split())[:200])
    return out
