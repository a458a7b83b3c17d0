"""Execute a plan: compile its schedule to one straight-line FX program and run it as a training step.

Each compute step copies the FX nodes of its operator node into a new `torch.fx.Graph`; a repeated
compute copies them again (recomputation), and later readers use the newest copies. FX code
generation drops every reference right after its last use, which realizes the memory model of
docs/plan-format.md: a value copy lives from its compute to its last read (explicit frees are implied,
since validation refuses a read after a free).

Random nodes that the plan recomputes replay the generator: the state is saved before their first
compute and set for each recomputation (then restored), so a recomputed dropout draws the same mask
and the generator ends the step where eager PyTorch leaves it.
"""

from __future__ import annotations

import os
from collections import Counter
from dataclasses import dataclass
from typing import Any, Callable, Mapping

import torch
from torch import fx, nn

from runtime.capture import Program, batch_signature, capture
from runtime.graph import OpGraph
from runtime.plan import Plan


def _rng_state(device: str) -> torch.Tensor:
    d = torch.device(device)
    return torch.cuda.get_rng_state(d) if d.type == "cuda" else torch.get_rng_state()


def _set_rng_state(state: torch.Tensor, device: str) -> None:
    d = torch.device(device)
    if d.type == "cuda":
        torch.cuda.set_rng_state(state, d)
    else:
        torch.set_rng_state(state)


def _replay_rng(state: torch.Tensor, device: str) -> torch.Tensor:
    """Set the generator of `device` to `state`; return the state it had."""
    current = _rng_state(device)
    _set_rng_state(state, device)
    return current


def compile_plan(graph: OpGraph, plan: Plan) -> fx.GraphModule:
    """The plan's schedule as one FX GraphModule `f(*params, *buffers, *batch) -> outputs` (the joint
    graph's output order: buffer updates, loss, gradients)."""
    program: Program = graph.program
    g = fx.Graph()
    env: dict[fx.Node, fx.Node] = {ph: g.placeholder(ph.name) for ph in program.placeholders}
    counts = Counter(plan.compute_steps())
    replayed = {n for n, c in counts.items() if c > 1 and n in program.random_devices}
    saved: dict[int, fx.Node] = {}
    for step in plan.schedule:
        if "compute" not in step:
            continue
        n = step["compute"]
        previous = None
        if n in replayed:
            device = program.random_devices[n]
            if n in saved:
                previous = g.call_function(_replay_rng, (saved[n], device))
            else:
                saved[n] = g.call_function(_rng_state, (device,))
        for m in program.groups[n]:
            env[m] = g.node_copy(m, env.__getitem__)
        if previous is not None:
            g.call_function(_set_rng_state, (previous, program.random_devices[n]))
    g.output(tuple(env[o] for o in program.outputs))
    return fx.GraphModule(program.gm, g)


@dataclass(eq=False)
class _Compiled:
    fn: fx.GraphModule
    params: list[torch.Tensor]
    buffers: list[torch.Tensor]
    mutated: list[torch.Tensor]
    grad_params: list[torch.Tensor]


def _accumulate_grad(p: torch.Tensor, g: torch.Tensor) -> None:
    """What autograd's AccumulateGrad does: steal a fresh gradient whose layout matches the parameter,
    else copy it into the parameter's layout; add in place to an existing `.grad`."""
    if p.grad is None:
        fresh = g.stride() == p.stride() and g.storage_offset() == 0 and \
            g.untyped_storage().nbytes() == g.numel() * g.element_size()
        p.grad = g if fresh else torch.empty_strided(p.shape, p.stride(), dtype=g.dtype, device=g.device).copy_(g)
    else:
        p.grad += g


class TrainStep:
    """`step(*batch)`: one training step under a plan. Returns the loss, accumulates gradients into
    `p.grad` and updates buffers in place. The first call for a batch shape captures the model and
    checks the plan against the captured graph; later calls reuse the compiled program."""

    def __init__(self, plan: Plan, model: nn.Module, loss_fn: Callable[..., torch.Tensor],
                 graph: OpGraph | None = None):
        self.plan = plan
        self.model = model
        self.loss_fn = loss_fn
        self._graph = graph
        self._compiled: dict[tuple, _Compiled] = {}

    @property
    def code(self) -> Mapping[tuple, str]:
        """The generated Python source per compiled batch signature."""
        return {k: c.fn.code for k, c in self._compiled.items()}

    def compile(self, *batch: torch.Tensor) -> _Compiled:
        key = batch_signature(self.model, batch)
        if key in self._compiled:
            return self._compiled[key]
        graph = self._graph
        if graph is None or graph.program is None or graph.program.batch_signature != key:
            graph = capture(self.model, self.loss_fn, batch)
        self.plan.validate(graph)
        program: Program = graph.program
        params = dict(self.model.named_parameters(remove_duplicate=False))
        buffers = dict(self.model.named_buffers(remove_duplicate=False))
        inputs = {v.name: v for v in graph.values if v.producer is None}
        for name, t in [*((n, params.get(n)) for n in program.params), *((n, buffers.get(n)) for n in program.buffers)]:
            if t is None or tuple(t.shape) != inputs[name].shape:
                raise ValueError(f"the graph passed to runtime.load has {inputs[name].kind} {name!r} of shape "
                                 f"{list(inputs[name].shape)}, which this model lacks or shapes differently: it "
                                 f"was captured from another model. Pass a graph of this model, or none.")
        compiled = _Compiled(
            fn=compile_plan(graph, self.plan),
            params=[params[name] for name in program.params],
            buffers=[buffers[name] for name in program.buffers],
            mutated=[buffers[name] for name in program.mutated_buffers],
            grad_params=[params[name] for name in program.grad_params],
        )
        self._compiled[key] = compiled
        return compiled

    def __call__(self, *batch: torch.Tensor) -> torch.Tensor:
        c = self.compile(*batch)
        with torch.no_grad():
            outs = c.fn(*c.params, *c.buffers, *batch)
            n_mut = len(c.mutated)
            for buf, new in zip(c.mutated, outs[:n_mut]):
                buf.copy_(new)
            for p, g in zip(c.grad_params, outs[n_mut + 1:]):
                _accumulate_grad(p, g)
            return outs[n_mut]


def load(plan_or_path: Plan | Mapping[str, Any] | str | os.PathLike, model: nn.Module,
         loss_fn: Callable[..., torch.Tensor], graph: OpGraph | None = None) -> TrainStep:
    """A training step running `model` and `loss_fn(model, *batch)` under the plan (a `Plan`, its JSON
    dict or a plan file). `graph`, a graph captured from the same model and batch shapes, saves the
    capture on the first call."""
    plan = plan_or_path if isinstance(plan_or_path, Plan) else Plan.load(plan_or_path)
    return TrainStep(plan, model, loss_fn, graph)
