"""`memplan.plan`: one plan for a model, its loss and a batch, made in this process by the stages `memplan run` runs.

    plan = memplan.plan(model, loss_fn, batch, max_overhead=0.05)   # trace, profile, solve, validate
    plan.save("plan.json")
    step = memplan.load("plan.json", model, loss_fn)                # then step(*batch) in your loop

No pipeline.toml, Prefect or server: the stage functions of the `plan` flow (flows/plan.py) run one after another on
copies of the model and batch handed in (the stages' `built` parameter in place of a `[[models]]` entry):

- trace: `tasks.trace.trace` captures the step as the pipeline's trace does (`runtime.capture(..., verify=True)`,
  or `capture_eager` for the policy form), so the same model and batch give the same graph fingerprint;
- profile: on the model's device into the profile store `store`, unless the store already holds a complete profile
  of that fingerprint on this device (a run of `memplan run` for the same model wrote one), which is then used as
  `memplan run`'s solve stage uses it: the newest complete profile (`tasks.store.query.load_costs`);
- reference: eager PyTorch's step (`tasks.validate.reference.measure_reference`), which budgets like "50% eager" are
  fractions of;
- solve: `tasks.solve_stage.solve_case` with the settings a `[[plans]]` table of `solver`, `form` and `options`
  gives (`PlanConfig.solve_settings`);
- validate: `tasks.validate.stage.validate_plans`, beside the no-recomputation plan for a `max_overhead` plan, whose
  ladder is then walked by measured overhead as the pipeline walks it (flows/refine.py `measured_choices`);
  `walk=False` keeps the predicted choice.

Same model, batch, seed, settings and profile: the same plan as the pipeline publishes for that cell (a
`max_overhead` plan's measured walk times steps, so two walks may choose different rungs of one ladder). A plan
that fails validation or that no schedule gives raises a `MemplanError` saying why (`PlanRejected`,
`PlanInfeasible`); bad arguments raise `PlanRequestError` before anything runs. The model, its gradients and the
RNG states are left as they were.
"""

from __future__ import annotations

import copy
import logging
import re
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from memplan.tasks.config import (Budget, Case, InputSpec, MemplanError, ModelConfig, PlanConfig, ProfileConfig,
                                  ValidateConfig)

log = logging.getLogger("memplan.plan")

FORMS = ("executor", "policy")
"""The forms `memplan.plan` makes; the compiled form's search runs in `memplan run` only."""


class PlanRequestError(MemplanError):
    """`memplan.plan` was called with arguments it cannot plan for (raised before any stage runs)."""


class PlanInfeasible(MemplanError):
    """No schedule of the solver fits the budget (the message names the least feasible budget found)."""


class PlanRejected(MemplanError):
    """The plan failed validation against eager PyTorch, or a stage raised."""


def plan(model: Any, loss_fn: Callable[..., Any], batch: Sequence[Any], *, max_overhead: float | None = None,
         budget: Any = None, solver: str = "dtr", form: str | None = None, options: Mapping[str, Any] | None = None,
         store: str = "profiles_db", name: str | None = None, seed: int = 0,
         profile: ProfileConfig | Mapping[str, Any] | None = None,
         validate: ValidateConfig | Mapping[str, Any] | None = None, walk: bool = True,
         cache_dir: str | Path | None = None, progress: bool = False) -> Any:
    """Trace, profile, solve and validate one plan of `model` trained by `loss_fn(model, *batch)` on the device the
    model is on, and return it (a `memplan.runtime.format.plan.Plan`: `.save(path)`, then `memplan.load(path, model,
    loss_fn)`). Give exactly one of `max_overhead` (the least memory whose predicted step time is at most that
    fraction above the no-recomputation schedule's, e.g. 0.05) or `budget` (bytes, a size such as "1.5 GiB", a
    fraction of the checkpoint-all peak such as "60%" or 0.6, a fraction of eager PyTorch's peak such as "50% eager",
    or a `Budget`). `solver`: a registered solver (`memplan solve --help`); `form`: "executor" (runtime.load; the
    default of most solvers) or "policy" (selective checkpointing in your own loop, `memplan.apply`; the default of
    "selective-policy"); `options`: the solver's own options, as a `[[plans]]` table's `options`. `store`: the profile
    store (a complete profile of this graph on this device there is reused); `name`: the model's name in the store and
    in messages (default: its class name); `seed`: of the profile's random inputs and of the steps validated (dropout);
    `profile`, `validate`: the `[profile]` and `[validate]` settings of pipeline.toml (a dict or the config object;
    defaults as there); `walk`: walk a `max_overhead` plan's ladder by measured overhead as `memplan run` does;
    `cache_dir`: where the graph, reference and solutions go (default: a temporary folder, removed after);
    `progress`: say each stage on stderr and show the profile's progress bar."""
    request = _Request.of(model, loss_fn, batch, max_overhead, budget, solver, form, options, store, name, seed,
                          profile, validate)
    import torch

    cuda = [torch.device(request.device).index or 0] if request.device.startswith("cuda") else []
    with torch.random.fork_rng(devices=cuda):
        if cache_dir is not None:
            return _plan(request, model, loss_fn, tuple(batch), Path(cache_dir), walk, progress)
        with tempfile.TemporaryDirectory(prefix="memplan-plan-") as folder:
            return _plan(request, model, loss_fn, tuple(batch), Path(folder), walk, progress)


class _Request:
    """What `plan` was asked for, checked: the cell's `Case` (its model a stand-in `ModelConfig` naming the model
    handed in), the device, the store and the profile and validation settings."""

    def __init__(self, case: Case, device: str, store: str, seed: int, profile: ProfileConfig,
                 validate: ValidateConfig) -> None:
        self.case, self.device, self.store, self.seed = case, device, store, seed
        self.profile, self.validate = profile, validate

    @classmethod
    def of(cls, model: Any, loss_fn: Any, batch: Any, max_overhead: Any, budget: Any, solver: Any, form: Any,
           options: Any, store: Any, name: Any, seed: Any, profile: Any, validate: Any) -> _Request:
        from torch import Tensor, nn

        from memplan.tasks.config import parse_budget, parse_max_overhead, registered_solvers
        from memplan.tasks.store.profiles import check_store

        if not isinstance(model, nn.Module):
            raise PlanRequestError(f"memplan.plan takes a torch.nn.Module as `model`, got a {type(model).__name__}.")
        if not callable(loss_fn):
            raise PlanRequestError(f"memplan.plan takes `loss_fn`, called as loss_fn(model, *batch) -> scalar loss; got "
                                   f"a {type(loss_fn).__name__}, which is not callable.")
        if isinstance(batch, Tensor) or not isinstance(batch, (tuple, list)) or not batch or \
                not all(isinstance(t, Tensor) for t in batch):
            raise PlanRequestError("memplan.plan takes `batch` as a tuple of tensors, the arguments after the model in "
                                   "loss_fn(model, *batch); wrap a single tensor as (tensor,).")
        if (budget is None) == (max_overhead is None):
            given = "both `budget` and `max_overhead`" if budget is not None else "neither `budget` nor `max_overhead`"
            raise PlanRequestError(f"memplan.plan got {given}; give exactly one: max_overhead=0.05 (the least memory "
                                   f"within 5% predicted step-time overhead) or budget=\"60%\" (of the checkpoint-all "
                                   f"peak; or bytes, \"1.5 GiB\", \"50% eager\").")
        solvers = registered_solvers()
        if solver not in solvers:
            raise PlanRequestError(f"memplan.plan: unknown solver {solver!r}; registered solvers: {', '.join(solvers)}.")
        if form == "compiled":
            raise PlanRequestError("memplan.plan makes plans in the executor and policy forms; the compiled form's plans "
                                   "are searched by compiling and measuring them under torch.compile, which `memplan "
                                   "run` does: add a [[plans]] table with solver = \"dtr\", form = \"compiled\" to "
                                   "pipeline.toml (docs/training.md, \"The compiled form\").")
        if form is not None and form not in FORMS:
            raise PlanRequestError(f"memplan.plan: form {form!r} is not one of {', '.join(map(repr, FORMS))} (or None: "
                                   f"the solver's default).")
        try:
            if max_overhead is not None:
                if isinstance(max_overhead, (list, tuple)):
                    raise ValueError("max_overhead takes one number here (one plan per call), e.g. max_overhead=0.05")
                cell_budget = Budget(max_overhead=parse_max_overhead(max_overhead)[0])
                table: dict[str, Any] = {"max_overhead": [cell_budget.max_overhead]}
            else:
                cell_budget = budget if isinstance(budget, Budget) else parse_budget(budget)
                table = {"budgets": [1.0]}           # the cell's budget is `cell_budget`; the table checks the rest
            plan_config = PlanConfig.model_validate({"solver": solver, "form": form, "options": dict(options or {}),
                                                     **table}, context={"solvers": solvers})
        except ValueError as exc:                       # pydantic's ValidationError is one
            raise PlanRequestError(f"memplan.plan: {_one_line(exc)}") from None
        profile = _settings(ProfileConfig, profile, "profile")
        validate = _settings(ValidateConfig, validate, "validate")
        if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
            raise PlanRequestError(f"memplan.plan: seed must be a non-negative integer, got {seed!r}.")
        device = _device(model, batch)
        check_store(store)
        spec = _stand_in(model, batch, name)
        return cls(Case(spec, int(batch[0].shape[0]) if batch[0].dim() else 1, plan_config, cell_budget), device,
                   str(store), seed, profile, validate)


def _settings(kind: type, value: Any, argument: str) -> Any:
    """`value`, a `kind` (ProfileConfig, ValidateConfig) or a dict of its keys, as a `kind`."""
    if isinstance(value, kind):
        return value
    if value is not None and not isinstance(value, Mapping):
        raise PlanRequestError(f"memplan.plan: `{argument}` takes a dict of pipeline.toml's [{argument}] keys "
                               f"({', '.join(kind.toml_keys())}), got a {type(value).__name__}.")
    try:
        return kind.model_validate(dict(value or {}))
    except ValueError as exc:
        raise PlanRequestError(f"memplan.plan: `{argument}`: {_one_line(exc)} Its keys are pipeline.toml's "
                               f"[{argument}] keys: {', '.join(kind.toml_keys())}.") from None


def _one_line(exc: Exception) -> str:
    """A pydantic error (or another `ValueError`) as one sentence: its messages, each after the key it is about,
    without pydantic's URLs."""
    errors = getattr(exc, "errors", None)
    if callable(errors):
        text = "; ".join((f"{'.'.join(map(str, e['loc']))}: " if e.get("loc") else "")
                         + str(e.get("msg", "")).removeprefix("Value error, ") for e in errors())
    else:
        text = str(exc)
    text = " ".join(text.split())
    return text if text.endswith(".") else f"{text}."


def _device(model: Any, batch: Sequence[Any]) -> str:
    """The device the model's parameters and the batch are on ("cpu", "cuda:N"); refuses a mix."""
    import torch

    devices = {t.device for t in [*model.parameters(), *model.buffers(), *batch]}
    if len(devices) != 1:
        raise PlanRequestError(f"memplan.plan needs the model and the batch on one device, and they are on "
                               f"{', '.join(sorted(map(str, devices)))}; move them with .to(device) first.")
    device, = devices
    if device.type == "cuda":
        return f"cuda:{torch.cuda.current_device() if device.index is None else device.index}"
    if device.type != "cpu":
        raise PlanRequestError(f"memplan.plan profiles on cpu or cuda devices, and the model is on {device}.")
    return "cpu"


def _stand_in(model: Any, batch: Sequence[Any], name: str | None) -> ModelConfig:
    """A `ModelConfig` standing for the model handed in: its name (`name`, else the model's class name), its
    batch's shapes and dtypes, the precision of its parameters (which widens validation's tolerances). Nothing is
    ever built from it: the stages get the model, loss and batch themselves (`built`)."""
    import torch

    label = name if name is not None else type(model).__name__
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,99}", label):
        if name is not None:
            raise PlanRequestError(f"memplan.plan: name {name!r} must be letters, digits, '-', '_' or '.' (at most "
                                   f"100; it becomes part of file names).")
        label = "model"
    floating = [p.dtype for p in model.parameters() if p.is_floating_point()]
    dtype = {torch.bfloat16: "bfloat16", torch.float16: "float16"}.get(floating[0] if floating else None, "float32")
    inputs = [InputSpec.model_construct(shape=list(t.shape[1:]), dtype=str(t.dtype).removeprefix("torch."),
                                        high=None if t.is_floating_point() or t.dtype == torch.bool else
                                        max(1, int(t.max()) + 1 if t.numel() else 1)) for t in batch]
    return ModelConfig.model_construct(name=label, factory=f"{__name__}:not_rebuilt", loss=f"{__name__}:not_rebuilt",
                                       inputs=inputs, batch_sizes=[int(batch[0].shape[0]) if batch[0].dim() else 1],
                                       dtype=dtype)


def not_rebuilt(*args: Any, **kwargs: Any) -> Any:
    """The factory and loss `memplan.plan`'s stand-in model names: never called (the stages get the model)."""
    raise MemplanError("memplan.plan's model is handed to the stages, not built from its stand-in entry.")


def _copies(model: Any, loss_fn: Callable[..., Any], batch: tuple) -> tuple[Any, Callable[..., Any], tuple]:
    """A fresh copy of the model, without gradients, with the loss and a copy of the batch: what one stage gets."""
    copied = copy.deepcopy(model)
    copied.zero_grad(set_to_none=True)
    return copied, loss_fn, tuple(t.detach().clone() for t in batch)


def _say(progress: bool, text: str) -> None:
    log.info(text)
    if progress:
        print(f"memplan.plan: {text}", file=sys.stderr, flush=True)


def _plan(request: _Request, model: Any, loss_fn: Callable[..., Any], batch: tuple, folder: Path, walk: bool,
          progress: bool) -> Any:
    """The stages, in the `plan` flow's order, for the one cell of `request`; returns the validated plan."""
    from memplan.runtime.format.plan import Plan
    from memplan.tasks.profile.stage import ProfileSettings, device_info, profile_graph
    from memplan.tasks.validate.reference import measure_reference
    from memplan.tasks.solve_stage import solve_case
    from memplan.tasks.store.profiles import ProfileNotFoundError
    from memplan.tasks.store.query import load_costs
    from memplan.tasks.trace import trace

    import torch

    case, device, seed = request.case, request.device, request.seed
    spec, batch_size, form = case.model, case.batch_size, case.plan.plan_form

    _say(progress, f"tracing {spec.name} at batch {batch_size} on {device} ({form} form)")
    traced, graph = trace(spec, batch_size, device, seed, folder, form, built=_copies(model, loss_fn, batch))

    key = device_info(torch.device(device))["device"]
    try:
        costs = load_costs(traced.fingerprint, key, root=request.store)
        _say(progress, f"using profile {costs.run_id} of graph {traced.fingerprint[:12]} on {key} in {request.store}")
    except ProfileNotFoundError:
        _say(progress, f"profiling {traced.nodes} nodes of graph {traced.fingerprint[:12]} on {device}")
        settings = ProfileSettings(request.profile.warmup, request.profile.repeats, seed)
        key = profile_graph(graph, device, settings, model=spec.name, root=request.store, progress=progress).device

    _say(progress, "measuring eager PyTorch's step (the reference)")
    reference = measure_reference(spec, batch_size, device, seed, folder / "references" / f"{spec.name}-b{batch_size}"
                                  f".safetensors", built=_copies(model, loss_fn, batch))
    budget = case.budget.of_eager(reference.peak_bytes)
    case = Case(spec, batch_size, case.plan, budget)

    _say(progress, f"solving with {case.plan.solver} at {budget.label}")
    solved = solve_case(traced.path, case.plan.solver, budget, case.plan.solve_settings(), key, request.store,
                        str(folder / "solutions" / f"{case.alias}.json"))
    if not solved.feasible:
        raise PlanInfeasible(_infeasible(case, solved))

    def validate_groups(groups: dict) -> dict:
        return {cell: _validated(group, request, case, graph, reference, model, loss_fn, batch)
                for cell, group in groups.items()}

    from memplan.flows.refine import PlanToValidate, measured_choices

    _say(progress, "validating the plan against eager PyTorch")
    cell = (spec.name, batch_size)
    validation, = validate_groups({cell: [(spec, PlanToValidate.of(solved))]})[cell]
    if walk and case.budget.max_overhead is not None:
        _say(progress, "walking the overhead ladder by measured overhead")
        (solved,), validations, walks = measured_choices([case], [solved], {case.alias: validation}, validate_groups)
        validation = validations[case.alias]
        if case.alias in walks:
            _say(progress, walks[case.alias])
    from memplan.tasks.records import StageError

    if isinstance(validation, StageError):
        raise PlanRejected(validation.explain(case.alias))
    if not validation.passed:
        raise PlanRejected(validation.explain(case.alias))
    _say(progress, f"plan {case.alias}: measured peak {validation.measured_peak_bytes:,} B (eager "
                   f"{validation.eager_peak_bytes:,} B), overhead {validation.overhead:+.1%}")
    return Plan.load(solved.plan_path)


def _validated(group: list, request: _Request, case: Case, graph: Any, reference: Any, model: Any,
               loss_fn: Callable[..., Any], batch: tuple) -> list:
    """`validate_plans` on the plans of `group` ((ModelConfig, PlanToValidate) pairs) beside their no-recomputation
    plans, as the pipeline's validate stage runs them (flows/steps.py `validate_step`); where what they share raises,
    that error for each plan (flows/plan.py `_group_results`)."""
    from memplan.runtime.format.plan import Plan
    from memplan.tasks.records import StageError, attempt
    from memplan.tasks.validate.stage import validate_plans

    plans = [Plan.load(p.plan_path) for _, p in group]
    baselines = [None if p.no_recompute_path is None else Plan.load(p.no_recompute_path) for _, p in group]
    graphs = {"policy": dict(eager_graph=graph)} if case.plan.plan_form == "policy" else {"executor": dict(graph=graph)}
    results = attempt("validate", validate_plans, plans, case.model, case.batch_size, request.device, request.seed,
                      request.validate, reference, no_recompute=baselines if any(baselines) else None, isolate=True,
                      built=_copies(model, loss_fn, batch), **next(iter(graphs.values())))
    if isinstance(results, StageError):
        return [results.model_copy(update={"plan_id": p.plan_id}) for _, p in group]
    return results


def _infeasible(case: Case, solved: Any) -> str:
    """Why the cell has no plan, in one paragraph, with the least feasible budget found."""
    where = f"memplan.plan: {case.alias}: solver {case.plan.solver}"
    if case.budget.max_overhead is not None:
        return (f"{where} found {solved.message or 'no schedule within the overhead limit'}; raise max_overhead or "
                f"pick another solver.")
    text = (f"{where} found no schedule within {solved.budget_bytes:,} B ({case.budget.label}; the checkpoint-all peak "
            f"is {solved.checkpoint_all_peak_bytes:,} B), status {solved.status}"
            + (f" ({solved.message})" if solved.message else ""))
    least = solved.smallest_feasible_budget
    if least is not None:
        text += (f"; the least feasible budget found is {least:,} B ({least / solved.checkpoint_all_peak_bytes:.0%} of "
                 f"the checkpoint-all peak, by {'this solver' if case.plan.plan_form == 'policy' else 'greedy checkpointing'}"
                 f"): pass budget={least} or more")
    else:
        text += f"; no schedule fits below {solved.min_budget_lower_bound:,} B: raise the budget"
    if "time limit" in (solved.message or "").lower():
        text += f", or a longer time limit (now {case.plan.time_limit_s:g} s)"
    return text + ", or use max_overhead= instead."
