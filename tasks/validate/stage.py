"""Validate a plan by running it: same loss, gradients and buffer updates as the reference step, peak within
the budget, step time and overhead against eager PyTorch measured.

What counts:
- correctness: the loss, every parameter gradient and every buffer after one step of the plan equal
  those of the reference step from the same weights and batch (`tasks.validate.reference`, measured once per model x
  batch size x device x seed and shared by the plans of that cell): |plan - reference| <= atol + rtol *
  |reference| elementwise (`torch.allclose`), or, for a tensor outside that, its largest distance to the float64
  step is within `FLOAT64_FACTOR` times eager's own (`float64_problem`: the capture rounds otherwise than eager
  autograd, and eager's own rounding is the measure of what rounding may do to that tensor), and a gradient that
  exists in one run exists in the other. On
  CUDA both steps run with ATen's own kernels in IEEE fp32 (`runtime.measure.exact.exact_fp32`: cuDNN and TF32
  off), since eager cuDNN kernels round differently from the graph's ATen kernels by more than the
  tolerance; the timed and metered steps keep the process's settings;
- memory: `runtime.measure.meter.PeakMeter(allocator=True)` measures the peak of bytes allocated during the step
  (activations, gradients, outputs, temporaries, kernels' own scratch, which the profile's workspace
  counts too; not the parameters, buffers and batch that exist before it, the same split as the plan's
  `peak_bytes` vs `constant_bytes`). It must not exceed `budget_bytes * (1 + peak_rtol)`;
- time: eager PyTorch and the plans take turns, one step each per round (in reverse order every other
  round), after `warmup` untimed rounds. Step times are medians over the timed rounds; a plan's overhead is
  the median over rounds of its time / eager's time in the same round - 1, so that a host that slows a
  whole round slows both sides of its ratio. After `steps` rounds, timing goes on, up to `max_steps`
  rounds, until the 95% interval of that median (`median_interval`) lies within +-`overhead_precision`
  for every plan; the interval (none below 6 rounds) and the rounds are recorded. `validate_plans` times
  several plans of one cell in the same rounds (one eager step per round for all of them), and with
  `no_recompute` each plan's no-recomputation plan too (each distinct one once per round), against which a
  `max_overhead` plan's overhead is measured the same way (`overhead_vs_no_recompute`, its interval);
- the optimizer inside the step, for a plan with `provenance.optimizer_in_step` (`tasks.solve.core.optimizer`):
  the reference also holds the parameters after that optimizer's update (`tasks.validate.reference`), the plan runs
  `runtime.load(..., optimizer=opt)` (a policy-form plan `runtime.apply(..., optimizer=opt)`, its hooks updating
  in the model's own backward), and its parameters after the step are compared instead of the gradients
  (freed inside the step); its step is timed against the reference step followed by `opt.step()`;
- a device memory limit (`limit`, pipeline.toml's `device_memory`): the reference is the first step that
  fits it, eager, per-block or nested checkpointing, micro-batches, else eager on the host CPU without the
  limit (tasks/fit/reference.py, which also says the tolerance each needs), timing runs that step, and the plan's measured peak plus the resident bytes
  (parameters, buffers, batch, optimizer state) must not exceed the limit;
- low precision: a model computing in bfloat16 or float16 (`dtype`, `autocast`) is compared with at least
  `torch.testing`'s tolerances for that dtype (`step_tolerance`);
- the policy form, for a plan whose `provenance.form` is "policy": it runs as a training job runs it,
  `runtime.apply` on a fresh copy of the model (on `capture_eager`'s graph) and then `loss_fn(model,
  *batch).backward()`, under the same meter, against the same reference and tolerances, and in the same
  timing rounds as the cell's other plans; its measured peak must also be within `peak_rtol` of its
  predicted peak (`prediction_problem`). One solved with `compiled = true` (provenance `compiled`), whose model
  trains under torch.compile, is also measured compiled (`runtime.policy.compiled_peak`, `settings.compile_backend`):
  the compiler's partitioner decides what a compiled step keeps, so the budget applies to that peak
  (`compiled_problem`), and the eager run's peak only to its prediction and the device memory limit (the measured
  search, tasks/compiled/policy_cell.py, may choose a plan whose eager peak is above the budget);
- the compiled form, for a plan with `compiled` decisions (tasks/compiled/plans.py): it runs as `runtime.load`
  runs it, compiled by inductor under the plan's decisions (a joint graph the plan does not name is refused),
  with inductor drawing random numbers as eager PyTorch does (`fallback_random`), so dropout's masks match; its
  measured peak must be within the budget and within `peak_rtol` of the peak the search measured for it;
- arena mode, for a plan with addresses: one more run with `runtime.load(..., arena=True)` must match
  the reference the same way; its measured peak, step time and the bytes it could not place (ops without an
  in-place out= kernel) are recorded. The budget applies to the plan's normal run.
"""

from __future__ import annotations

import copy
import functools
import math
import statistics
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence, TypeVar

import torch
from torch import nn

from memplan.runtime.execute.arena import ArenaFallbackWarning
from memplan.runtime.compiled.records import FORM as COMPILED
from memplan.runtime.format.graph import OpGraph
from memplan.runtime.format.plan import Plan, plan_id
from memplan.runtime.policy.form import FORM as POLICY
from memplan.tasks.config import MemplanError, ModelConfig, ValidateConfig
from memplan.tasks.fit.reference import LOSS_REDUCTIONS, rebuilt_step, training_step
from memplan.tasks.fit.memory_limit import MemoryLimit
from memplan.tasks.models import build_batch, build_loss, build_model
from memplan.tasks.records import Referenced, StageError, Validated, attempt
from memplan.tasks.validate.reference import (State, Step, first_steps, optimizer_named, reference_float64,
                                     reference_state)
from memplan.tasks.validate.step_timing import median_interval, paired_step_times


class ValidationFailed(MemplanError):
    """A plan that does not reproduce eager training or exceeds its budget; it is not published."""


def compare_tensors(
    expected: Mapping[str, torch.Tensor | None], actual: Mapping[str, torch.Tensor | None], rtol: float, atol: float,
    float64: Mapping[str, torch.Tensor] | None = None,
) -> tuple[list[str], float, int]:
    """Mismatches between two name -> tensor maps (`torch.allclose(actual, expected, rtol, atol)`), in
    the order of `expected`, the largest absolute difference seen and the number of tensors compared. With
    `float64` (name -> the float64 step's value minus `expected`'s, `tasks.validate.reference.reference_float64`), a
    floating tensor outside rtol / atol is still accepted when `float64_problem` accepts it."""
    problems, worst, compared = [], 0.0, 0
    for name in [*expected, *(k for k in actual if k not in expected)]:
        want, got = expected.get(name), actual.get(name)
        if want is None or got is None:
            if (want is None) != (got is None):
                problems.append(f"{name} is {'missing' if got is None else 'unexpected'} in the plan's step")
            continue
        if want.shape != got.shape or want.dtype != got.dtype:
            problems.append(f"{name} has shape {tuple(got.shape)} {got.dtype}, eager {tuple(want.shape)} {want.dtype}")
            continue
        compared += 1
        if want.is_floating_point():
            diff = (got.detach().double() - want.detach().double()).abs()
            worst = max(worst, float(diff.max()) if diff.numel() else 0.0)
            if not torch.allclose(got.detach(), want.detach(), rtol=rtol, atol=atol, equal_nan=True):
                reason = f"{name} differs from eager by up to {float(diff.max()):.3g} (rtol {rtol:g}, atol {atol:g})"
                delta = None if float64 is None else float64.get(name)
                if delta is None or delta.shape != want.shape:
                    problems.append(reason)
                elif (beyond := float64_problem(want, got, delta)) is not None:
                    problems.append(f"{reason}, {beyond}")
        elif not torch.equal(got, want):
            problems.append(f"{name} differs from eager")
    return problems, worst, compared


FLOAT64_FACTOR = 4.0
"""How many times eager's own largest distance to the float64 step a plan's tensor may be from it (`float64_problem`)."""
FLOAT64_ULPS = 2.0
"""And the ulps of the tensor's dtype at its largest float64 magnitude it may be beyond that (eager exact by chance)."""


def float64_problem(eager: torch.Tensor, plan: torch.Tensor, delta: torch.Tensor) -> str | None:
    """Why `plan`'s tensor is too far from the float64 step's, or None: with `exact = eager + delta` (the float64
    step's value, `delta` its distance to eager's, tasks/validate/reference.py), it is accepted when

        max |plan - exact| <= FLOAT64_FACTOR * max |eager - exact| + FLOAT64_ULPS * eps(dtype) * max |exact|.

    Per tensor, not per element: the plan and eager are two computations of the same step in the same dtype that
    round differently (the captured graph's decomposed backward formulas, another summation order), so each is one
    sample of the same rounding error, and where eager happens to round an element exactly the plan need not; the
    tensor's largest error is the bound rounding analysis gives, scaled by the model's conditioning (BatchNorm over
    two samples), and one sample estimates it within a small factor (EfficientNet-B0, batch 2: a plan's largest
    distance within 1.9 x eager's over all 312 tensors, and mostly within 1.05 x). 4 x leaves room beyond that,
    while a gradient a few percent off, or missing a term, is farther than that wherever eager itself is not (a
    tensor eager computes no better than its own size, nothing can judge). A float64 step that overflows or is
    NaN where eager is not judges nothing: the rtol / atol verdict stands."""
    truth = eager.detach().double() + delta.detach().to(eager.device, torch.float64)
    own = float(delta.detach().double().abs().max())
    floor = FLOAT64_ULPS * torch.finfo(eager.dtype).eps * float(truth.abs().max())
    if not (math.isfinite(own) and math.isfinite(floor)):
        return f"and eager's own distance to the float64 step is not finite ({own:g})"
    distance = float((plan.detach().double() - truth).abs().max())
    if distance <= FLOAT64_FACTOR * own + floor:          # NaN (the plan's alone) is not
        return None
    return (f"and from the float64 step by up to {distance:.3g}, more than {FLOAT64_FACTOR:g} x eager's own "
            f"{own:.3g} (+ {floor:.2g})")


LOW_PRECISION_TOLERANCES = {"bfloat16": (1.6e-2, 1e-5), "float16": (1e-3, 1e-5)}
"""(rtol, atol) of `torch.testing.assert_close` for each low-precision dtype: one rounding in it."""


def step_tolerance(spec: ModelConfig, settings: ValidateConfig) -> tuple[float, float]:
    """(rtol, atol) for comparing the plan's step with eager's: `settings`', widened to
    `LOW_PRECISION_TOLERANCES` of the model's `dtype` or `autocast` dtype when it computes in one."""
    low = [LOW_PRECISION_TOLERANCES[d] for d in (spec.dtype, spec.autocast) if d in LOW_PRECISION_TOLERANCES]
    return max([settings.rtol, *(r for r, _ in low)]), max([settings.atol, *(a for _, a in low)])


def peak_problem(measured_bytes: int, budget_bytes: int, peak_rtol: float) -> str | None:
    """Why a measured peak breaks its budget (`measured > budget * (1 + peak_rtol)`), or None."""
    limit = budget_bytes * (1 + peak_rtol)
    if measured_bytes > limit:
        return (
            f"measured peak {measured_bytes:,} B exceeds the budget {budget_bytes:,} B by "
            f"{measured_bytes / budget_bytes - 1:.1%} (allowed {peak_rtol:.1%})"
        )
    return None


def prediction_problem(measured_bytes: int, predicted_bytes: int | None, peak_rtol: float) -> str | None:
    """Why a policy-form plan's measured peak breaks its prediction (`measured > predicted * (1 + peak_rtol)`,
    or no prediction), or None. The executor runs a plan's schedule itself; under the policy form autograd
    decides what lives, and the prediction is what says it kept what the plan keeps."""
    if predicted_bytes is None:
        return "the plan has no predicted.peak_bytes to check its measured peak against"
    if measured_bytes > predicted_bytes * (1 + peak_rtol):
        return (f"measured peak {measured_bytes:,} B exceeds the predicted {predicted_bytes:,} B by "
                f"{measured_bytes / predicted_bytes - 1:.1%} (allowed {peak_rtol:.1%}): autograd keeps more than the "
                f"policy form predicts (runtime/policy/form.py: an op whose backward is several graph ops)")
    return None


def compiled_problem(measured_bytes: int, budget_bytes: int, peak_rtol: float, backend: str) -> str | None:
    """Why a compiled policy plan's peak under torch.compile (`backend`) breaks its budget, or None."""
    reason = peak_problem(measured_bytes, budget_bytes, peak_rtol)
    if reason is None:
        return None
    return (f"under torch.compile (backend {backend!r}) the {reason}: the compiler's partitioner keeps other tensors "
            f"than the plan predicts (docs/training.md, torch.compile); plan with the measured search "
            f"(tasks.compiled.policy_search) or at a lower budget")


def validate_plan(
    plan: Plan, spec: ModelConfig, batch_size: int, device: str, seed: int, settings: ValidateConfig,
    reference: Referenced, graph: OpGraph | None = None, limit: MemoryLimit | None = None,
) -> Validated:
    """Run `plan` from `seed`'s weights and batch on `device` and check it against `reference`, the
    reference step of `spec` at `batch_size` (tasks/validate/reference.py), timing it against that step (see module
    doc). `graph`, the graph of `spec`'s step captured at `batch_size` on `device` (the trace stage's), spares
    `runtime.load` capturing the model again; without it the plan's step captures the model itself. Under a
    device memory `limit` the plan's peak and the resident bytes must fit it."""
    return validate_plans([plan], spec, batch_size, device, seed, settings, reference, graph, limit)[0]


def validate_alone(
    plan: Plan, spec: ModelConfig, batch_size: int, device: str, seed: int, settings: ValidateConfig,
    graph: OpGraph | None = None, limit: MemoryLimit | None = None, no_recompute: Plan | None = None,
) -> Validated:
    """`validate_plan` outside a pipeline run: the reference step measured for this plan alone (with the
    optimizer it runs inside the step, under `limit`) in a temporary folder, then the plan checked against it
    (`validate_plans`), timed beside its `no_recompute` plan when given."""
    import tempfile
    from pathlib import Path

    from memplan.tasks.validate.reference import measure_reference

    with tempfile.TemporaryDirectory(prefix="memplan-reference-") as folder:
        reference = measure_reference(spec, batch_size, device, seed, Path(folder) / "reference.safetensors",
                                      limit=limit, optimizer=plan.provenance.get("optimizer_in_step"))
        return validate_plans([plan], spec, batch_size, device, seed, settings, reference, graph, limit,
                              no_recompute=[no_recompute])[0]


def validate_plans(
    plans: Sequence[Plan], spec: ModelConfig, batch_size: int, device: str, seed: int, settings: ValidateConfig,
    reference: Referenced, graph: OpGraph | None = None, limit: MemoryLimit | None = None,
    eager_graph: OpGraph | None = None, no_recompute: Sequence[Plan | None] | None = None, isolate: bool = False,
    built: tuple[nn.Module, Callable[..., torch.Tensor], tuple] | None = None,
) -> list[Validated | StageError]:
    """`validate_plan` for several plans of one model and batch size at once: each is checked against
    `reference` alone, and their steps are timed in shared rounds, one eager step and one step of each plan
    per round, each plan's overhead the median of its per-round ratios to that round's eager step. Each plan
    (and its arena run) keeps a copy of the model until timing ends. `graph` is the executor plans' graph,
    `eager_graph` the policy-form plans' (`runtime.policy.apply.capture_eager`'s; a `graph` whose meta says
    `capture = "eager"` is taken as that); without `graph`, executor plans of
    one graph and rewrite selection share one capture of the model, and without `eager_graph` the policy-form
    plans share one eager capture. `no_recompute` (aligned with `plans`): each plan's no-recomputation plan
    (None: none), timed in the same rounds (each distinct one once), against which a plan's
    `overhead_vs_no_recompute` is measured as its overhead is against the reference step. With `isolate`, a
    plan that raises as it is loaded, run or judged (or whose no-recomputation plan does) gets a `StageError` in
    its place and the others are timed and judged without it; without, the error is raised. What the plans
    share (the reference, the model, its batch and captures, the timed rounds) raises either way. `built`: the model
    (on `device`, left unchanged: the plans run on copies), loss and batch to run instead of building them from
    `spec` (`memplan.plan`'s)."""
    check_reference(reference, spec, batch_size, device, seed)
    in_step = {plan.provenance.get("optimizer_in_step") for plan in plans} - {None}
    if in_step - {reference.optimizer}:
        raise MemplanError(f"plans with the optimizer {sorted(in_step)} inside the step need a reference with that "
                           f"optimizer's update, and the reference at {reference.path} has "
                           f"{reference.optimizer or 'none'}; measure it with optimizer= (tasks.validate.reference).")
    expected, float64 = reference_state(reference, device), reference_float64(reference, device)
    if built is None:
        base, loss_fn = build_model(spec, seed).to(device), build_loss(spec)
        batch = build_batch(spec, batch_size, seed, device)
    else:
        base, loss_fn, batch = built
    runs = [_baseline(reference, base, loss_fn, batch, spec, None)]
    if reference.optimizer in in_step:           # the plans that update inside the step pair with this one
        runs.append(_baseline(reference, base, loss_fn, batch, spec, reference.optimizer))
    tolerance = step_tolerance(spec, settings)
    tolerance = max(tolerance[0], reference.rtol), max(tolerance[1], reference.atol)
    if graph is not None and graph.meta.get("capture") == "eager" and eager_graph is None:
        graph, eager_graph = None, graph                      # capture_eager's graph: the policy plans'
    executor = [plan for plan in plans if plan.form not in (POLICY, COMPILED)]
    if graph is None and len({p.fingerprint for p in executor}) == 1 and len({str(p.rewrites) for p in executor}) == 1:
        from memplan.runtime.tracing.capture import capture

        graph = capture(copy.deepcopy(base), loss_fn, batch, rewrites=executor[0].rewrites)   # once, not once per plan
    if eager_graph is None and any(plan.form == POLICY for plan in plans):
        from memplan.runtime.policy.apply import capture_eager

        eager_graph = capture_eager(copy.deepcopy(base), loss_fn, batch)
    each = functools.partial(_attempt, isolate)
    measured = [each(plan, _first_run, plan, base, loss_fn, batch, device, seed,
                     eager_graph if plan.form == POLICY else graph, runs, settings) for plan in plans]
    baselines: dict[str, _PlanRun | StageError] = {}                 # no-recomputation plan id -> its run
    for other in {plan_id(p): p for p in no_recompute or () if p is not None}.values():
        baselines[plan_id(other)] = each(other, _first_run, other, base, loss_fn, batch, device, seed, graph, runs,
                                         settings)
    against = [None if p is None else baselines[plan_id(p)] for p in no_recompute or [None] * len(plans)]
    times = paired_step_times(runs, device, settings.warmup, settings.steps, settings.max_steps,
                              settings.overhead_precision)
    resident = None if limit is None else limit.module_resident_bytes(base, batch)
    results: list[Validated | StageError] = []
    for run, baseline in zip(measured, against):
        if isinstance(run, StageError):
            results.append(run)
        elif isinstance(baseline, StageError):
            results.append(_baseline_error(run.plan, baseline))
        else:
            results.append(each(run.plan, _verdict, run, expected, times, reference, settings, tolerance, limit,
                                resident, None if baseline is None else baseline.index, float64))
    return results


T = TypeVar("T")


def _attempt(isolate: bool, plan: Plan, run: Callable[..., T], *args: Any) -> T | StageError:
    """`run(*args)`; with `isolate`, the error it raises as `plan`'s `StageError` instead (stage "validate")."""
    return attempt("validate", run, *args, plan_id=plan_id(plan)) if isolate else run(*args)


def _baseline_error(plan: Plan, error: StageError) -> StageError:
    """`plan`'s error where its no-recomputation plan raised `error`: its overhead cannot be measured."""
    return StageError(stage=error.stage, error=error.error, plan_id=plan_id(plan),
                      message=f"its no-recomputation plan {error.plan_id[:12]} raised it: {error.message}")


def compiled_plan_peak(plan: Plan, base: nn.Module, loss_fn: Callable[..., torch.Tensor],
                       batch: tuple[torch.Tensor, ...], graph: OpGraph | None, settings: ValidateConfig) -> int | None:
    """The peak under torch.compile of a policy plan solved compiled (provenance `compiled`; with the optimizer it
    updates inside the step), else None."""
    if plan.form != POLICY or not plan.provenance.get("compiled"):
        return None
    from memplan.runtime.policy.compiled_peak import compiled_peak

    name = plan.provenance.get("optimizer_in_step")
    return compiled_peak(plan, base, loss_fn, batch, graph=graph, backend=settings.compile_backend,
                         optimizer=None if name is None else functools.partial(optimizer_named, name))


def _baseline(reference: Referenced, base: nn.Module, loss_fn: Callable[..., torch.Tensor],
              batch: tuple[torch.Tensor, ...], spec: ModelConfig, optimizer: str | None) -> tuple[nn.Module, Step]:
    """The reference's step (its `kind`) on a copy of `base`, followed by `optimizer`'s update when given, warmed
    up by one untimed step: what the plans' steps are timed against."""
    chosen = rebuilt_step(reference.kind, base, loss_fn, batch, LOSS_REDUCTIONS.get(spec.loss))
    update = None if optimizer is None else optimizer_named(optimizer, chosen.model)

    def step() -> torch.Tensor:
        loss = chosen.step()
        if update is not None:
            update.step()
            update.zero_grad(set_to_none=True)
        return loss

    step()                                      # untimed, as the plans' first steps warm them up
    chosen.model.zero_grad(set_to_none=True)
    return chosen.model, step


def _first_run(plan: Plan, base: nn.Module, loss_fn: Callable[..., torch.Tensor], batch: tuple[torch.Tensor, ...],
               device: str, seed: int, graph: OpGraph | None, runs: list[tuple[nn.Module, Step]],
               settings: ValidateConfig) -> _PlanRun:
    """Load `plan` on a copy of `base` (with the optimizer it was planned to run inside the step; in the policy
    form, `runtime.apply` on `graph`, capture_eager's, then the model's own backward), take its state
    after one step and its peak (and, for a plan with addresses, those of its arena run, before any timed step
    moves its buffers; for a policy plan solved compiled, its peak under torch.compile); appends its timed runs to
    `runs` once all of that ran."""
    from memplan import runtime

    plan_model = copy.deepcopy(base)
    optimizer = plan.provenance.get("optimizer_in_step")
    update = None if optimizer is None else optimizer_named(optimizer, plan_model)
    if plan.form == POLICY:                     # the user's own loop: loss_fn(model, *batch).backward()
        planned = training_step(runtime.apply(plan, plan_model, loss_fn, batch, graph=graph, optimizer=update),
                                loss_fn, batch)
    elif plan.compiled is not None:             # inductor draws dropout's masks as eager does (fallback_random)
        from memplan.runtime.compiled.step import CompiledTrainStep

        planned = functools.partial(CompiledTrainStep(plan.compiled, plan_model, loss_fn, unplanned="error",
                                                      exact_random=True), *batch)
    else:
        planned = functools.partial(runtime.load(plan, plan_model, loss_fn, graph=graph, optimizer=update), *batch)
    state, peak = first_steps(plan_model, planned, device, seed, params=update is not None)
    timed, arena = [(plan_model, planned)], None
    if plan.addresses:
        arena_model = copy.deepcopy(base)
        arena_step = runtime.load(plan, arena_model, loss_fn, graph=graph, arena=True)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ArenaFallbackWarning)     # recorded as arena_bytes_not_placed
            arena_step.compile(*batch)
        in_arena, arena_peak = first_steps(arena_model, functools.partial(arena_step, *batch), device, seed)
        timed.append((arena_model, functools.partial(arena_step, *batch)))
        report, = arena_step.arena_report.values()
        arena = _ArenaRun(len(runs) + 1, in_arena, arena_peak, report.bytes_not_placed)
    compiled = compiled_plan_peak(plan, base, loss_fn, batch, graph, settings)
    runs.extend(timed)
    return _PlanRun(plan, len(runs) - len(timed), 1 if update is not None else 0, state, peak, arena, compiled)


def check_reference(reference: Referenced, spec: ModelConfig, batch_size: int, device: str, seed: int) -> None:
    """Refuse a reference of another model, batch size, device or seed than the plan's validation."""
    want = (spec.name, batch_size, device, seed)
    have = (reference.model, reference.batch_size, reference.device, reference.seed)
    if want != have:
        raise MemplanError(
            f"the reference at {reference.path} is of model {have[0]} at batch {have[1]} on {have[2]} with seed "
            f"{have[3]}, not of {want[0]} at batch {want[1]} on {want[2]} with seed {want[3]}; measure the "
            "reference of the plan's own model, batch size, device and seed (tasks.validate.reference.measure_reference).")


@dataclass(frozen=True)
class _ArenaRun:
    """A plan's run in arena mode: its index among the timed runs, its state after one step, its peak and
    the bytes it could not place."""

    index: int
    state: State
    peak_bytes: int
    bytes_not_placed: int


@dataclass(frozen=True)
class _PlanRun:
    """A plan's run: its index among the timed runs and that of the run it is timed against, its state after one
    step, its peak, its arena run and its peak under torch.compile (`compiled_plan_peak`)."""

    plan: Plan
    index: int
    baseline: int
    state: State
    peak_bytes: int
    arena: _ArenaRun | None
    compiled_peak: int | None = None


def _verdict(run: _PlanRun, cell_state: State, times: list[list[float]], reference: Referenced,
             settings: ValidateConfig, tolerance: tuple[float, float], limit: MemoryLimit | None,
             resident: int | None, no_recompute: int | None = None,
             float64: Mapping[str, torch.Tensor] | None = None) -> Validated:
    """The `Validated` record of one plan's run: its state against the reference's (parameters instead of
    gradients for a plan updating inside the step), its peak against its budget and the device memory limit,
    its step times against its baseline's in the same rounds, and against those of the run `no_recompute`
    (its no-recomputation plan) where given; its peak under torch.compile, where measured, against the budget and
    the limit too. `float64`: the float64 step's distance to the reference's tensors, where measured
    (`compare_tensors`)."""
    plan, compiled_peak = run.plan, run.compiled_peak
    compared_kinds = ("loss", "param", "buffer") if run.baseline else ("loss", "grad", "buffer")
    expected = {k: v for k, v in cell_state.items() if k.split(":")[0] in compared_kinds}
    ratios = [p / e for p, e in zip(times[run.index], times[run.baseline])]
    interval = median_interval(ratios)
    rtol, atol = tolerance
    float64 = {k: v for k, v in (float64 or {}).items() if k in expected} or None
    problems, worst, compared = compare_tensors(expected, run.state, rtol, atol, float64=float64)
    optional = {}                                  # arena mode's, the no-recomputation plan's, the compiled peak
    if run.arena is not None:
        mismatches, arena_worst, _ = compare_tensors(expected, run.arena.state, rtol, atol, float64=float64)
        problems += [f"arena mode: {m}" for m in mismatches]
        worst = max(worst, arena_worst)
        optional = dict(arena_peak_bytes=int(run.arena.peak_bytes),
                        arena_step_ms=statistics.median(times[run.arena.index]),
                        arena_bytes_not_placed=run.arena.bytes_not_placed)
    if no_recompute is not None:
        against = [p / n for p, n in zip(times[run.index], times[no_recompute])]
        span = median_interval(against)
        optional |= dict(no_recompute_step_ms=statistics.median(times[no_recompute]),
                         overhead_vs_no_recompute=statistics.median(against) - 1,
                         overhead_vs_no_recompute_interval=None if span is None else [span[0] - 1, span[1] - 1])
    budget = plan.provenance.get("budget_bytes")
    if budget is None:
        problems.append("the plan has no provenance.budget_bytes to check the measured peak against")
    elif compiled_peak is None and (reason := peak_problem(run.peak_bytes, int(budget), settings.peak_rtol)):
        problems.append(reason)                   # a compiled plan's budget is its compiled peak's (below)
    if plan.form in (POLICY, COMPILED) and (reason := prediction_problem(run.peak_bytes, plan.predicted.get("peak_bytes"),
                                                             settings.peak_rtol)):
        problems.append(reason)
    if limit is not None and run.peak_bytes + resident > limit.limit_bytes:
        problems.append(f"measured peak {run.peak_bytes:,} B plus {resident:,} B resident exceeds the device memory "
                        f"limit {limit.limit_bytes:,} B")
    if compiled_peak is not None:
        optional["compiled_peak_bytes"] = int(compiled_peak)
        if budget is not None and (reason := compiled_problem(compiled_peak, int(budget), settings.peak_rtol,
                                                              settings.compile_backend)):
            problems.append(reason)
        if limit is not None and compiled_peak + resident > limit.limit_bytes:
            problems.append(f"under torch.compile the measured peak {compiled_peak:,} B plus {resident:,} B resident "
                            f"exceeds the device memory limit {limit.limit_bytes:,} B")
    return Validated(
        plan_id=plan_id(plan),
        passed=not problems,
        reasons=problems,
        device=reference.device,
        device_name=reference.device_name,
        budget_bytes=int(budget or 0),
        predicted_peak_bytes=int(plan.predicted.get("peak_bytes") or 0),
        measured_peak_bytes=int(run.peak_bytes),
        eager_peak_bytes=reference.peak_bytes,
        measured_step_ms=statistics.median(times[run.index]),
        eager_step_ms=statistics.median(times[run.baseline]),
        overhead=statistics.median(ratios) - 1,
        overhead_interval=None if interval is None else [interval[0] - 1, interval[1] - 1],
        timed_steps=len(ratios),
        loss=float(run.state["loss"]),
        eager_loss=reference.loss,
        max_abs_error=worst,
        tensors_compared=compared,
        reference=reference.kind,
        limit_bytes=None if limit is None else limit.limit_bytes,
        float64_tensors=len(float64 or ()),
        **optional,
    )
