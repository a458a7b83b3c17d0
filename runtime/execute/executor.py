"""Execute a plan: compile its schedule to one straight-line FX program and run it as a training step.

Each compute step copies the FX nodes of its operator node into a new `torch.fx.Graph`; a repeated
compute copies them again (recomputation), and later readers use the newest copies. FX code
generation drops every reference right after its last use, which realizes the memory model of
docs/plan-format.md: a value copy lives from its compute to its last read (explicit frees are implied,
since validation refuses a read after a free).

Random nodes that the plan recomputes replay the generator: the state is saved before their first
compute and set for each recomputation (then restored), so a recomputed dropout draws the same mask
and the generator ends the step where eager PyTorch leaves it. (On CPU graphs a dropout's draw is a node
of its own, runtime/tracing/dropout.py: recomputing the output from the kept mask draws nothing.)

A compute step naming a non-default `impl` emits the variant's code (`runtime.variants.rules`); variant
values (e.g. masks) have their own environment keyed by value id, newest copy first like graph values.
With `arena=True`, copies with addresses live in one arena per step (`runtime.execute.arena`); with
`cuda_graph=True` the program is replayed as one CUDA graph (`runtime.execute.cuda_graph`). A model wrapped in
`DistributedDataParallel` has its gradients all-reduced in buckets by the program (`runtime.execute.ddp_sync`).
"""

from __future__ import annotations

import os
import warnings
from collections import Counter
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import torch
from torch import fx, nn
from torch.nn.parallel import DistributedDataParallel

from memplan.runtime.execute.arena import ArenaFallbackWarning, ArenaReport, emit_out_call, keep_alive, new_arena, plan_arena
from memplan.runtime.tracing.capture import batch_signature, capture
from memplan.runtime.execute.cuda_graph import GraphedStep
from memplan.runtime.execute.ddp_sync import GradientSync
from memplan.runtime.execute.grads import accumulate_grad
from memplan.runtime.format.graph import OpGraph
from memplan.runtime.execute.model_state import Change, ModelChanged, ModelState, describe
from memplan.runtime.execute.optim_step import (InStepOptimizer, check_optimizer, check_slice_bytes, refuse_accumulation,
                                refuse_global_clipping, update_points)
from memplan.runtime.format.plan import Plan, PlanError
from memplan.runtime.tracing.program import Program
from memplan.runtime.format.schedule import UPDATE_SLICE_BYTES
from memplan.runtime.variants.ops import head_node
from memplan.runtime.variants.rules import emit_variant
from memplan.runtime.variants.offered import GraphVariants


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


def _own_storage(t: torch.Tensor) -> torch.Tensor:
    """A scalar result in a storage of its own size. Some kernels reduce into the storage of their unreduced
    result (on CPU `mse_loss` and `smooth_l1_loss`: a 0-dim loss holding its batch-sized buffer); the plan's
    memory model counts the result's extent (docs/plan-format.md), so the copy the plan keeps is that size."""
    return t.clone() if t.untyped_storage().nbytes() > t.element_size() else t


def replayed_random_nodes(plan: Plan, program: Program) -> set[int]:
    """The random operator nodes (e.g. dropout) that `plan` computes more than once."""
    counts = Counter(plan.compute_steps())
    return {n for n, c in counts.items() if c > 1 and n in program.random_devices}


def compile_plan(graph: OpGraph, plan: Plan, variants: GraphVariants | None = None, *,
                 arena: bool = False, update: Callable[..., None] | None = None,
                 updates: Mapping[int, Sequence[tuple[int, Sequence[int]]]] | None = None,
                 sync: GradientSync | None = None, reductions: Mapping[int, Sequence[Sequence[int]]] | None = None,
                 ) -> tuple[fx.GraphModule, ArenaReport | None]:
    """The plan's schedule as one FX GraphModule `f(*params, *buffers, *batch) -> outputs` (the joint
    graph's output order: buffer updates, loss, gradients), and with `arena` the arena report
    (runtime.execute.arena). `variants` are the graph's (`plan.validate(graph)`, which runs when they are None).
    With `updates` (schedule step -> (k, gradient output indices js), `runtime.execute.optim_step.update_points`), the
    program calls `update(((k, len(js)), ...), *each k's gradients js)` once right after that step and outputs
    None for those gradients (the optimizer inside the step). With `reductions` (schedule step -> the gradient
    output indices of each bucket, `GradientSync.reduce_points`), the program calls `sync.launch(*bucket's
    gradients)` right after that step and `sync.finish(its result, *bucket's gradients)` at its end (DDP's
    all-reduce, runtime.execute.ddp_sync)."""
    variants = plan.validate(graph) if variants is None else variants
    program: Program = graph.program
    g = fx.Graph()
    env: dict[fx.Node, fx.Node] = {ph: g.placeholder(ph.name) for ph in program.placeholders}
    variant_values: dict[int, fx.Node] = {}               # variant value id -> its newest copy
    device = str(program.placeholders[0].meta["val"].device)
    placements, report = plan_arena(graph, plan, variants, device) if arena else ({}, None)
    arena_node = g.call_function(new_arena, (report.arena_bytes, device)) if placements else None
    replayed = replayed_random_nodes(plan, program)
    saved: dict[int, fx.Node] = {}
    updates = updates or {}
    reductions = reductions or {}
    launched: list[tuple[fx.Node, Sequence[int]]] = []
    grads = program.outputs[len(program.mutated_buffers) + 1:]
    for i, step in enumerate(plan.schedule):
        if "compute" not in step:
            continue
        n = step["compute"]
        previous = None
        if n in replayed:
            device_n = program.random_devices[n]
            if n in saved:
                previous = g.call_function(_replay_rng, (saved[n], device_n))
            else:
                saved[n] = g.call_function(_rng_state, (device_n,))
        spec = variants.spec(n, step.get("impl"))
        if spec is not None:
            variant_values.update(emit_variant(g, graph, variants, spec, env, env.__getitem__, variant_values))
        else:
            head = head_node(graph, n) if i in placements else None
            for m in program.groups[n]:
                env[m] = (emit_out_call(g, m, env.__getitem__, placements[i], arena_node, device) if m is head
                          else g.node_copy(m, env.__getitem__))
            for v in graph.nodes[n].outputs if head is None else ():
                where = program.primary[v]
                if graph.values[v].shape == () and isinstance(where, fx.Node):
                    env[where] = g.call_function(_own_storage, (env[where],))
        if previous is not None:
            g.call_function(_set_rng_state, (previous, program.random_devices[n]))
        if updates.get(i):
            members = tuple((k, len(js)) for k, js in updates[i])
            g.call_function(update, (members, *(env[grads[j]] for _, js in updates[i] for j in js)))
        for js in reductions.get(i, ()):
            launched.append((g.call_function(sync.launch, tuple(env[grads[j]] for j in js)), js))
    for work, js in launched:
        g.call_function(sync.finish, (work, *(env[grads[j]] for j in js)))
    if arena_node is not None:
        g.call_function(keep_alive, (arena_node,))
    updated = {grads[j] for group in updates.values() for _, js in group for j in js}
    g.output(tuple(None if o in updated else env[o] for o in program.outputs))
    return fx.GraphModule(program.gm, g), report


@dataclass(eq=False)
class _Compiled:
    fn: fx.GraphModule
    params: list[torch.Tensor]
    buffers: list[torch.Tensor]
    mutated: list[torch.Tensor]
    grad_params: list[torch.Tensor]
    graphed: Callable[[tuple], torch.Tensor] | None = None
    in_step: InStepOptimizer | None = None


def _refuse_random_replays(plan: Plan, program: Program) -> None:
    """A CUDA graph cannot hold a plan that recomputes a random op: replaying its draws resets the
    generator (`_replay_rng`), which capture forbids."""
    replayed = sorted(replayed_random_nodes(plan, program))
    if replayed:
        raise ValueError(f"cuda_graph=True cannot replay this plan: it recomputes random operator node(s) "
                         f"{replayed[:5]}{' ...' if len(replayed) > 5 else ''} (e.g. dropout), whose draws the "
                         f"executor repeats by resetting the CUDA generator, which a CUDA graph capture does not "
                         f"allow. Plan without recomputing random nodes (or with dropout off), or load without "
                         f"cuda_graph=True.")


def _refuse_under_ddp(optimizer: torch.optim.Optimizer | None, cuda_graph: bool) -> None:
    """Refuse what the executor does not run under DistributedDataParallel, in one paragraph."""
    if optimizer is not None:
        raise ValueError("runtime.load got a DistributedDataParallel model and optimizer=: the optimizer inside the "
                         "step would update each parameter as soon as its own gradient is final, before its bucket's "
                         "all-reduce completes, so each rank would step with its unreduced gradient. Load the DDP "
                         "model without optimizer= and call optimizer.step() after the step (the gradients in .grad "
                         "are then averaged over the ranks).")
    if cuda_graph:
        raise ValueError("runtime.load got a DistributedDataParallel model and cuda_graph=True: the step's "
                         "asynchronous all-reduces cannot be captured in a CUDA graph by memplan yet. Load the DDP "
                         "model without cuda_graph=True.")


class TrainStep:
    """`step(*batch)`: one training step under a plan. Returns the loss, accumulates gradients into
    `p.grad` and updates buffers in place. The first call for a batch shape captures the model with the
    plan's recorded rewrite selection (`Plan.rewrites`: the same graph whatever this host's CPU and thread
    count) and checks the plan against the captured graph; later calls reuse the compiled program. With `arena`, value
    copies live at the plan's addresses in one arena per step (runtime.execute.arena); `arena_report[signature]`
    says what each compiled batch signature placed. With `cuda_graph`, each batch signature's program is
    captured once and replayed as a CUDA graph (runtime.execute.cuda_graph says what that asks of the caller). A
    `DistributedDataParallel` model is captured through its `.module`, and the step all-reduces the gradients as
    DDP would (runtime.execute.ddp_sync), after the ranks confirm on the first step that they hold the same plan. Each call
    checks that the model's modules and parameters are the ones compiled (`_follow_model`)."""

    def __init__(self, plan: Plan, model: nn.Module, loss_fn: Callable[..., torch.Tensor],
                 graph: OpGraph | None = None, arena: bool = False, cuda_graph: bool = False,
                 optimizer: torch.optim.Optimizer | None = None, clip_grad_value: float | None = None,
                 clip_grad_norm: float | None = None, update_slice_bytes: int | None = UPDATE_SLICE_BYTES):
        check_slice_bytes(update_slice_bytes)
        if optimizer is not None:
            check_optimizer(optimizer)
            refuse_global_clipping(clip_grad_norm)
            if cuda_graph:
                raise ValueError("cuda_graph=True does not run the optimizer inside the step yet: the replayed CUDA "
                                 "graph holds the step's kernels only. Load with optimizer= and without "
                                 "cuda_graph=True, or with cuda_graph=True and call optimizer.step() after the step.")
        elif clip_grad_value is not None or clip_grad_norm is not None:
            raise ValueError("clip_grad_value= and clip_grad_norm= apply to the optimizer inside the step, and "
                             "runtime.load got no optimizer=. Pass optimizer=, or clip p.grad yourself after the "
                             "step (torch.nn.utils.clip_grad_norm_) before calling optimizer.step().")
        if arena and not plan.addresses and plan.v1_offsets is None:
            raise ValueError("arena=True needs a plan with addresses (value copy -> arena offset), and this plan has "
                             "none. Plan with addresses (solve option addresses = 'greedy', or "
                             "tasks.solve.core.addresses.greedy_addresses), or load it without arena=True.")
        self.gradient_sync = None
        if isinstance(model, DistributedDataParallel):
            _refuse_under_ddp(optimizer, cuda_graph)
            self.gradient_sync = GradientSync(model)
            model = model.module
        devices = {t.device.type for t in (*model.parameters(), *model.buffers())}
        if cuda_graph and devices != {"cuda"}:
            raise ValueError(f"cuda_graph=True replays the step as a CUDA graph, and this model's parameters and "
                             f"buffers are on {', '.join(sorted(devices)) or 'no device (it has none)'}. Move the "
                             f"model to a GPU (model.cuda()) before runtime.load, or load without cuda_graph=True.")
        self.plan = plan
        self.model = model
        self.loss_fn = loss_fn
        self.arena = arena
        self.cuda_graph = cuda_graph
        self.arena_report: dict[tuple, ArenaReport] = {}
        self.optimizer = optimizer
        self.clip_grad_value = clip_grad_value
        self.update_slice_bytes = update_slice_bytes
        self._graph = graph
        self._compiled: dict[tuple, _Compiled] = {}
        self._model: ModelState | None = None           # the model as compiled
        self._plan_agreed = False                       # the ranks hold the same plan (DDP)

    @property
    def code(self) -> Mapping[tuple, str]:
        """The generated Python source per compiled batch signature."""
        return {k: c.fn.code for k, c in self._compiled.items()}

    def compile(self, *batch: torch.Tensor) -> _Compiled:
        """The compiled program for this batch signature, after checking the model (`_follow_model`)."""
        changes = self._follow_model()
        key = batch_signature(self.model, batch)
        if key in self._compiled:
            return self._compiled[key]
        try:
            compiled = self._compile(key, batch)
        except PlanError as exc:
            if not changes:
                raise
            raise PlanError(f"the model changed since this step captured it ({describe(changes)}), so the step "
                            f"captured it again, and the plan does not fit the new graph: {exc}") from exc
        if self._model is None or changes:
            self._model = ModelState.of(self.model)
        return compiled

    def _follow_model(self) -> list[Change]:
        """Check the model against the one compiled (`runtime.execute.model_state`). A change under DDP, or a parameter
        that no longer requires grad, is refused (ModelChanged); on any other change what was compiled is
        dropped, so the step captures the model again and checks the plan against the new graph. Returns the
        changes."""
        changes = [] if self._model is None else self._model.changes(self.model)
        if not changes:
            return changes
        if self.gradient_sync is not None:
            raise ModelChanged(f"the model under DistributedDataParallel changed since this step captured it "
                               f"({describe(changes)}): DDP keeps the modules and parameters it was built with "
                               f"in step across the ranks, so the step does not capture another model under it. "
                               f"Wrap the changed model in DistributedDataParallel again and load the plan on it "
                               f"with runtime.load (a plan made for the changed model if its graph changed).")
        frozen = [c for c in changes if c.kind == "frozen"]
        if frozen:
            raise ModelChanged(f"{describe(frozen)} since this step captured the model: memplan plans and runs "
                               f"full training steps, in which every parameter gets a gradient (runtime.capture "
                               f"refuses a frozen one), so the step cannot leave its gradient out. To stop "
                               f"training a parameter, make it require grad again (requires_grad_(True)) and leave "
                               f"it out of the optimizer.")
        self._compiled.clear()
        self.arena_report.clear()
        self._graph = None
        return changes

    def _compile(self, key: tuple, batch: tuple) -> _Compiled:
        graph = self._graph
        if graph is None or graph.program is None or graph.program.batch_signature != key:
            graph = capture(self.model, self.loss_fn, batch, rewrites=self.plan.rewrites)
        variants = self.plan.validate(graph)
        program: Program = graph.program
        params = dict(self.model.named_parameters(remove_duplicate=False))
        buffers = dict(self.model.named_buffers(remove_duplicate=False))
        inputs = {v.name: v for v in graph.values if v.producer is None}
        for name, t in [*((n, params.get(n)) for n in program.params), *((n, buffers.get(n)) for n in program.buffers)]:
            if t is None or tuple(t.shape) != inputs[name].shape:
                raise ValueError(f"the graph passed to runtime.load has {inputs[name].kind} {name!r} of shape "
                                 f"{list(inputs[name].shape)}, which this model lacks or shapes differently: it "
                                 f"was captured from another model. Pass a graph of this model, or none.")
        if self.cuda_graph:
            _refuse_random_replays(self.plan, program)
        grad_params = [params[name] for name in program.grad_params]
        in_step = updates = None
        if self.optimizer is not None:
            tensors = [grad_params[graph.outputs.index(grads[0]) - 1] for grads, _ in graph.gradient_updates()]
            in_step = InStepOptimizer(self.optimizer, tensors, self.clip_grad_value, self.update_slice_bytes)
            updates = update_points(graph, self.plan, variants, [k for k in range(len(tensors)) if in_step.holds(k)])
        reductions = None if self.gradient_sync is None else \
            self.gradient_sync.reduce_points(graph, self.plan, variants, program.grad_params)
        fn, report = compile_plan(graph, self.plan, variants, arena=self.arena,
                                  update=None if in_step is None else in_step.update, updates=updates,
                                  sync=self.gradient_sync, reductions=reductions)
        if report is not None:
            self.arena_report[key] = report
            if report.fallback:
                warnings.warn(report.warning(), ArenaFallbackWarning, stacklevel=3)
        compiled = _Compiled(
            fn=fn,
            params=[params[name] for name in program.params],
            buffers=[buffers[name] for name in program.buffers],
            mutated=[buffers[name] for name in program.mutated_buffers],
            grad_params=grad_params,
            in_step=in_step,
        )
        if self.cuda_graph:
            compiled.graphed = GraphedStep(fn, compiled.params, compiled.buffers, compiled.mutated,
                                           compiled.grad_params)
        self._compiled[key] = compiled
        return compiled

    def __call__(self, *batch: torch.Tensor) -> torch.Tensor:
        if self.gradient_sync is not None and not self._plan_agreed:
            self.gradient_sync.check_plan(self.plan)
            self._plan_agreed = True
        c = self.compile(*batch)
        if c.in_step is not None:
            refuse_accumulation(c.in_step)
        if self.gradient_sync is not None:
            self.gradient_sync.broadcast_buffers()
        with torch.no_grad():
            if c.graphed is not None:
                return c.graphed(batch)
            outs = c.fn(*c.params, *c.buffers, *batch)
            n_mut = len(c.mutated)
            for buf, new in zip(c.mutated, outs[:n_mut]):
                buf.copy_(new)
            for p, g in zip(c.grad_params, outs[n_mut + 1:]):
                if g is not None:
                    accumulate_grad(p, g)
            return outs[n_mut]


def load(plan_or_path: Plan | Mapping[str, Any] | str | os.PathLike, model: nn.Module,
         loss_fn: Callable[..., torch.Tensor], graph: OpGraph | None = None, arena: bool = False,
         cuda_graph: bool = False, optimizer: torch.optim.Optimizer | None = None,
         clip_grad_value: float | None = None, clip_grad_norm: float | None = None,
         update_slice_bytes: int | None = UPDATE_SLICE_BYTES) -> TrainStep:
    """A training step running `model` and `loss_fn(model, *batch)` under the plan (a `Plan`, its JSON
    dict or a plan file). `graph`, a graph captured from the same model and batch shapes, saves the
    capture on the first call. `arena=True` places value copies at the plan's addresses (runtime.execute.arena);
    otherwise addresses are ignored. `cuda_graph=True` (a model on a GPU) replays each step as one CUDA
    graph (runtime.execute.cuda_graph). `optimizer=opt` (a torch.optim optimizer over the model's parameters) runs it
    inside the step: each parameter it holds is updated right after its final gradient and that gradient is
    freed, so the step leaves no `.grad` for them (runtime.execute.optim_step; docs/training.md); `clip_grad_value`
    clamps each gradient elementwise first, and `clip_grad_norm` is refused there with the reason;
    `update_slice_bytes` bounds the slices in which it updates a large parameter whose update allocates
    temporaries (runtime.format.schedule.UPDATE_SLICE_BYTES, which plans assume; None: whole). A
    `DistributedDataParallel`-wrapped model is captured through its `.module` and its gradients are all-reduced
    in DDP's buckets as the planned backward finishes them (runtime.execute.ddp_sync; not with optimizer= or
    cuda_graph=True). A compiled-form plan (`plan.form == "compiled"`) gives a step compiled by inductor under
    the plan's decisions (runtime.compiled.step.CompiledTrainStep), which takes none of the options."""
    plan = plan_or_path if isinstance(plan_or_path, Plan) else Plan.load(plan_or_path)
    if plan.compiled is not None:
        return _compiled_step(plan, model, loss_fn, graph=graph, arena=arena, cuda_graph=cuda_graph,
                              optimizer=optimizer, clip_grad_value=clip_grad_value, clip_grad_norm=clip_grad_norm)
    return TrainStep(plan, model, loss_fn, graph, arena, cuda_graph, optimizer, clip_grad_value, clip_grad_norm,
                     update_slice_bytes)


def _compiled_step(plan: Plan, model: nn.Module, loss_fn: Callable[..., torch.Tensor], **options: Any):
    """A compiled-form plan's step; refuses the executor's options, none of which it runs."""
    from memplan.runtime.compiled.step import CompiledTrainStep

    given = [name for name, value in options.items() if value not in (None, False)]
    if given:
        raise ValueError(f"runtime.load got {', '.join(given)} for a compiled-form plan, which inductor runs: those "
                         f"options are the executor's. Load it without them (call optimizer.step() after the step), "
                         f"or use a plan in the executor form.")
    return CompiledTrainStep(plan.compiled, model, loss_fn)
