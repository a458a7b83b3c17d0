"""Validate a plan by running it: same loss, gradients and buffer updates as eager PyTorch, peak within
the budget, step time and overhead measured.

What counts:
- correctness: the loss, every parameter gradient and every buffer after one step of the plan equal
  those of one eager step from the same weights and batch: |plan - eager| <= atol + rtol * |eager|
  elementwise (`torch.allclose`), and a gradient that exists in one run exists in the other. Both run in
  the model's precision (`dtype`, `autocast`); a step computing in bfloat16 or float16 is compared with
  at least torch.testing's tolerances for that dtype (`step_tolerance`). On CUDA
  both steps run with ATen's own kernels in IEEE fp32 (`runtime.exact.exact_fp32`: cuDNN and TF32
  off), since eager cuDNN kernels round differently from the graph's ATen kernels by more than the
  tolerance; the timed and metered steps keep the process's settings;
- memory: `runtime.meter.PeakMeter(allocator=True)` measures the peak of bytes allocated during the step
  (activations, gradients, outputs, temporaries, kernels' own scratch, which the profile's workspace
  counts too; not the parameters, buffers and batch that exist before it, the same split as the plan's
  `peak_bytes` vs `constant_bytes`). It must not exceed `budget_bytes * (1 + peak_rtol)`;
- time: the plan and eager PyTorch take turns, one step each per round (eager first in even rounds, the
  plan first in odd ones), after `warmup` untimed rounds.
  Step times are medians over the timed rounds; overhead is the median over rounds of plan time / eager
  time - 1, so that a host that slows a whole round slows both sides of its ratio. After `steps` rounds,
  timing goes on, up to `max_steps` rounds, until the 95% interval of that median (`median_interval`)
  lies within +-`overhead_precision`; the interval (none below 6 rounds) and the rounds are recorded;
- the optimizer inside the step, for a plan with `provenance.optimizer_in_step` (`tasks.solve.core.optimizer`):
  eager runs `loss.backward(); opt.step()` with its own copy of that optimizer, the plan runs
  `runtime.load(..., optimizer=opt)`, and the parameters after the step are compared instead of the
  gradients (freed inside the step); the measured peak is a later step's, with the optimizer state resident;
- a device memory limit (`limit`, pipeline.toml's `device_memory`): the reference is the first step that
  fits it, eager, per-block checkpointing or micro-batches (tasks/fitting_reference.py, which also says
  the tolerance micro-batches need: the larger of theirs and `rtol`/`atol`), and the plan's measured peak plus
  the resident bytes (parameters, buffers, batch, optimizer state) must not exceed the limit;
- arena mode, for a plan with addresses: one more run with `runtime.load(..., arena=True)` must match
  eager the same way; its measured peak, step time and the bytes it could not place (ops without an
  in-place out= kernel) are recorded. The budget applies to the plan's normal run.
"""

from __future__ import annotations

import copy
import statistics
import time
import warnings
from math import comb
from typing import Any, Callable, Mapping, Sequence

import torch
from torch import nn

from runtime.arena import ArenaFallbackWarning
from runtime.exact import exact_fp32
from runtime.graph import OpGraph
from runtime.plan import Plan, plan_id
from tasks.config import MemplanError, ModelConfig, ValidateConfig
from tasks.fitting_reference import LOSS_REDUCTIONS, reference_step
from tasks.memory_limit import MemoryLimit
from tasks.models import build_batch, build_loss, build_model
from tasks.records import Validated
from tasks.solve.core.optimizer import OPTIMIZERS


class ValidationFailed(MemplanError):
    """A plan that does not reproduce eager training or exceeds its budget; it is not published."""


def compare_tensors(
    expected: Mapping[str, torch.Tensor | None], actual: Mapping[str, torch.Tensor | None], rtol: float, atol: float
) -> tuple[list[str], float, int]:
    """Mismatches between two name -> tensor maps (`torch.allclose(actual, expected, rtol, atol)`), in
    the order of `expected`, the largest absolute difference seen and the number of tensors compared."""
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
                problems.append(f"{name} differs from eager by up to {float(diff.max()):.3g} (rtol {rtol:g}, atol {atol:g})")
        elif not torch.equal(got, want):
            problems.append(f"{name} differs from eager")
    return problems, worst, compared


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


def in_step_optimizer(plan: Plan, model: nn.Module) -> torch.optim.Optimizer | None:
    """The optimizer a plan with `provenance.optimizer_in_step` was planned for, over `model`'s parameters."""
    name = plan.provenance.get("optimizer_in_step")
    if name is None:
        return None
    if name not in OPTIMIZERS:
        raise ValidationFailed(f"the plan's provenance.optimizer_in_step is {name!r}, which this memplan does not "
                               f"know (one of {', '.join(OPTIMIZERS)}); solve the plan again with this memplan.")
    spec = OPTIMIZERS[name]
    return getattr(torch.optim, spec.torch_class)(model.parameters(), lr=0.01, **dict(spec.torch_kwargs))


def step_state(model: nn.Module, loss: torch.Tensor, params: bool = False) -> dict[str, torch.Tensor | None]:
    """Loss, parameter gradients and buffers after a step, keyed `loss`, `grad:<name>`, `buffer:<name>`, and with
    `params` the parameters, `param:<name>` (the optimizer inside the step updates them and leaves no gradient)."""
    state: dict[str, torch.Tensor | None] = {"loss": loss.detach().clone()}
    if params:
        state |= {f"param:{n}": p.detach().clone() for n, p in model.named_parameters()}
    state |= {f"grad:{n}": None if p.grad is None else p.grad.detach().clone() for n, p in model.named_parameters()}
    state |= {f"buffer:{n}": b.detach().clone() for n, b in model.named_buffers()}
    return state


def validate_plan(
    plan: Plan, spec: ModelConfig, batch_size: int, device: str, seed: int, settings: ValidateConfig,
    graph: OpGraph | None = None, limit: MemoryLimit | None = None,
) -> Validated:
    """Run `plan` and eager PyTorch from the same seeded weights and batch on `device` (see module doc).
    `graph`, the graph of `spec`'s step captured at `batch_size` on `device` (the trace stage's), spares
    `runtime.load` capturing the model again; without it the plan's step captures the model itself. Under a
    device memory `limit` the reference is the first step that fits it (tasks/fitting_reference.py)."""
    import runtime

    base = build_model(spec, seed).to(device)
    loss_fn = build_loss(spec)
    batch = build_batch(spec, batch_size, seed, device)
    reference = reference_step(base, loss_fn, batch, device, limit, seed, LOSS_REDUCTIONS.get(spec.loss))
    eager_model, plan_model = reference.model, copy.deepcopy(base)
    eager_opt, plan_opt = (in_step_optimizer(plan, m) for m in (eager_model, plan_model))

    def eager_step() -> torch.Tensor:
        loss = reference.step()
        if eager_opt is not None:
            eager_opt.step()
            eager_opt.zero_grad(set_to_none=True)
        return loss

    planned_step = runtime.load(plan, plan_model, loss_fn, graph=graph, optimizer=plan_opt)

    def plan_step() -> torch.Tensor:
        return planned_step(*batch)

    runs = [(eager_model, eager_step), (plan_model, plan_step)]
    arena = {}
    if plan.addresses:
        arena_model = copy.deepcopy(base)
        arena_step = runtime.load(plan, arena_model, loss_fn, graph=graph, arena=True)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ArenaFallbackWarning)     # recorded as arena_bytes_not_placed
            arena_step.compile(*batch)
        runs.append((arena_model, lambda: arena_step(*batch)))

    in_step = plan_opt is not None
    eager, eager_peak = _first_steps(eager_model, eager_step, device, seed, in_step)
    planned, peak = _first_steps(plan_model, plan_step, device, seed, in_step)
    if plan.addresses:                          # before any timed step moves its buffers
        in_arena, arena_peak = _first_steps(arena_model, runs[2][1], device, seed)
    times = paired_step_times(runs, device, settings.warmup, settings.steps, settings.max_steps,
                              settings.overhead_precision)
    eager_ms, step_ms = (statistics.median(t) for t in times[:2])
    ratios = [p / e for p, e in zip(times[1], times[0])]
    interval = median_interval(ratios)

    rtol, atol = step_tolerance(spec, settings)
    rtol, atol = max(rtol, reference.rtol), max(atol, reference.atol)
    problems, worst, compared = compare_tensors(eager, planned, rtol, atol)
    if plan.addresses:
        mismatches, arena_worst, _ = compare_tensors(eager, in_arena, rtol, atol)
        problems += [f"arena mode: {m}" for m in mismatches]
        worst = max(worst, arena_worst)
        report, = arena_step.arena_report.values()
        arena = dict(arena_peak_bytes=int(arena_peak), arena_step_ms=statistics.median(times[2]),
                     arena_bytes_not_placed=report.bytes_not_placed)
    budget = plan.provenance.get("budget_bytes")
    if budget is None:
        problems.append("the plan has no provenance.budget_bytes to check the measured peak against")
    elif reason := peak_problem(peak, int(budget), settings.peak_rtol):
        problems.append(reason)
    if limit is not None and peak + (resident := limit.module_resident_bytes(base, batch)) > limit.limit_bytes:
        problems.append(f"measured peak {peak:,} B plus {resident:,} B resident exceeds the device memory limit "
                        f"{limit.limit_bytes:,} B")
    return Validated(
        plan_id=plan_id(plan),
        passed=not problems,
        reasons=problems,
        device=device,
        device_name=torch.cuda.get_device_name(device) if device.startswith("cuda") else "cpu",
        budget_bytes=int(budget or 0),
        predicted_peak_bytes=int(plan.predicted.get("peak_bytes") or 0),
        measured_peak_bytes=int(peak),
        eager_peak_bytes=int(eager_peak),
        measured_step_ms=step_ms,
        eager_step_ms=eager_ms,
        overhead=statistics.median(ratios) - 1,
        overhead_interval=None if interval is None else [interval[0] - 1, interval[1] - 1],
        timed_steps=len(ratios),
        loss=float(planned["loss"]),
        eager_loss=float(eager["loss"]),
        max_abs_error=worst,
        tensors_compared=compared,
        reference=reference.kind,
        limit_bytes=None if limit is None else limit.limit_bytes,
        **arena,
    )


def _first_steps(
    model: nn.Module, step: Callable[[], torch.Tensor], device: str, seed: int, params: bool = False
) -> tuple[dict[str, torch.Tensor | None], int]:
    """The state after one step from the fresh `model` (`step_state`, with `params`), and the measured peak of a
    second step."""
    from runtime.meter import PeakMeter

    torch.manual_seed(seed)
    with exact_fp32(device):
        state = step_state(model, step(), params)
    model.zero_grad(set_to_none=True)
    with PeakMeter(device, allocator=True) as meter:
        step()
    model.zero_grad(set_to_none=True)
    return state, meter.peak_bytes


def median_interval(samples: Sequence[float], confidence: float = 0.95) -> tuple[float, float] | None:
    """Distribution-free interval of the median of `samples`: the order statistics x_(k) and x_(n+1-k),
    k the largest rank with P(Binomial(n, 1/2) < k) <= (1 - confidence) / 2; None when even the whole
    range falls short of `confidence` (fewer than 6 samples at 95%)."""
    ordered = sorted(samples)
    n = len(ordered)
    tail, k = 0.0, 0
    while k < n and tail + comb(n, k) / 2**n <= (1 - confidence) / 2:
        tail += comb(n, k) / 2**n
        k += 1
    return (ordered[k - 1], ordered[n - k]) if k else None


def paired_step_times(runs: list[tuple[nn.Module, Callable[[], Any]]], device: str, warmup: int, steps: int,
                      max_steps: int, precision: float, clock: Callable[[], float] = time.perf_counter,
                      ) -> list[list[float]]:
    """Wall times (ms, CUDA synchronised) of each run's step, the runs taking turns round by round so that a
    busy host slows a round's runs alike, in reverse order every other round so that no run always goes
    first (caches warmed by the step before); gradients are cleared between steps. The rounds after `warmup`
    are timed: at least `steps` of them, then more, up to `max_steps`, until for every run after the first
    the `median_interval` of its per-round time ratios to the first run reaches no further than `precision`
    from their median."""
    cuda = device.startswith("cuda")
    times: list[list[float]] = [[] for _ in runs]
    rounds = 0
    while True:
        turns = list(zip(runs, times))
        for (model, step), measured in turns if rounds % 2 == 0 else reversed(turns):
            if cuda:
                torch.cuda.synchronize(device)
            start = clock()
            step()
            if cuda:
                torch.cuda.synchronize(device)
            if rounds >= warmup:
                measured.append((clock() - start) * 1000)
            model.zero_grad(set_to_none=True)
        rounds += 1
        timed = rounds - warmup
        if timed >= max(steps, max_steps) or (timed >= steps and all(
                _settled([t / e for t, e in zip(other, times[0])], precision) for other in times[1:])):
            return times


def _settled(ratios: list[float], precision: float) -> bool:
    interval = median_interval(ratios)
    middle = statistics.median(ratios)
    return interval is not None and middle - interval[0] <= precision and interval[1] - middle <= precision
