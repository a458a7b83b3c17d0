"""The pipeline stages as Prefect tasks: thin wrappers over the plain functions in `tasks/`.

The trace runs every time; each later task is cached by a content hash of what determines its result
(`cache_key_fn`: the graph's fingerprint, settings, and the sources of the code the stage imports,
flows/codehash.py), so re-running an unchanged pipeline re-uses
profiles, references, solutions and validations, and a changed model never gets a stale one. Results are
persisted by Prefect as JSON records (`result_serializer="json"`, never pickles) that point at the JSON graph
and plan files, the safetensors reference files and the Parquet profile runs the stages write (absolute
paths: valid from any working folder); `flows.plan.run_plan` puts Prefect's result storage under `cache_dir/prefect`.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict
from pathlib import Path
from typing import Any, Mapping

from prefect import task
from prefect.cache_policies import NO_CACHE

from memplan.flows import captures
from memplan.flows.codehash import code_hash
from memplan.flows.progress import stage_finished, stage_started
from memplan.tasks.config import Budget, MemplanError, ModelConfig, PlanForm, PlanSettings, ProfileConfig, ValidateConfig
from memplan.tasks.fit.memory_limit import MemoryLimit
from memplan.tasks.records import Profiled, Published, Referenced, Solved, StageError, Traced, Validated

PERSISTED = {"persist_result": True, "result_serializer": "json"}
HOOKS = {"on_running": [stage_started], "on_completion": [stage_finished], "on_failure": [stage_finished]}


class StaleCacheError(MemplanError):
    """A cached stage result points at a file that no longer exists."""


def content_key(stage: str, *parts: Any) -> str:
    """Cache key `<stage>-<sha256 of the canonical JSON of parts>`."""
    text = json.dumps(parts, sort_keys=True, default=_jsonable)
    return f"{stage}-{hashlib.sha256(text.encode()).hexdigest()}"


def _jsonable(obj: Any) -> Any:
    if hasattr(obj, "model_dump"):
        return obj.model_dump(mode="json")
    if isinstance(obj, Budget):
        return asdict(obj)
    raise TypeError(f"cannot hash {type(obj).__name__} into a cache key")


def _existing(path: str, stage: str) -> Path:
    if not Path(path).exists():
        raise StaleCacheError(
            f"the cached {stage} result points at {path}, which no longer exists (was the cache folder "
            "cleaned?); re-run with `memplan run --refresh` to rebuild the cached stages."
        )
    return Path(path)


# -- trace -------------------------------------------------------------------------------------------


@task(name="trace", cache_policy=NO_CACHE, task_run_name="trace {model.name} b{batch_size} {form}", **HOOKS)
def trace_step(model: ModelConfig, batch_size: int, device: str, seed: int, cache_dir: str,
               form: PlanForm = "executor") -> Traced:
    """Capture the model's training step for plans in `form` (tasks/trace.py), every run (never cached: the
    fingerprint it yields keys every later stage); the graph JSON lands in `cache_dir/graphs/`."""
    from memplan.tasks.trace import trace

    traced, graph = trace(model, batch_size, device, seed, cache_dir, form)
    captures.keep(traced.fingerprint, graph, form)
    return traced


# -- profile -----------------------------------------------------------------------------------------


def _profile_key(context: Any, p: Mapping[str, Any]) -> str:
    settings = p["settings"].model_dump(exclude={"retries"})
    return content_key("profile", p["traced"].fingerprint, p["device"], p["seed"], settings, p["store"],
                       code_hash("profile"))


@task(name="profile", cache_key_fn=_profile_key, retry_delay_seconds=5,
      task_run_name="profile {model.name} b{traced.batch_size}", **PERSISTED, **HOOKS)
def profile_step(model: ModelConfig, traced: Traced, device: str, seed: int, settings: ProfileConfig,
                 store: str) -> Profiled:
    """Measure every operator node of the traced graph on `device` and write the run to the store."""
    from memplan.tasks.profile.stage import ProfileSettings, profile_graph
    from memplan.tasks.trace import capture_model

    graph = captures.get(traced.fingerprint, traced.form) or capture_model(model, traced.batch_size, device, seed,
                                                                           traced.form)
    if graph.fingerprint != traced.fingerprint:
        raise MemplanError(
            f"re-capturing {model.name} at batch {traced.batch_size} gave graph {graph.fingerprint[:12]}, "
            f"not the traced {traced.fingerprint[:12]}; capture is not deterministic for this model."
        )
    run = profile_graph(graph, device, ProfileSettings(settings.warmup, settings.repeats, seed),
                        model=model.name, root=store, progress=False)
    return Profiled(run_id=run.run_id, device=run.device, fingerprint=run.fingerprint, rows=run.rows,
                    path=str(run.path))


# -- reference ---------------------------------------------------------------------------------------


def _reference_key(context: Any, p: Mapping[str, Any]) -> str:
    return content_key("reference", p["model"].content_hash(p["batch_size"]), p["device"], p["seed"],
                       p.get("limit"), p.get("optimizer"), _torch_version(), code_hash("reference"))


@task(name="reference", cache_key_fn=_reference_key, task_run_name="reference {model.name} b{batch_size}",
      **PERSISTED, **HOOKS)
def reference_step(model: ModelConfig, batch_size: int, device: str, seed: int, cache_dir: str,
                   limit: MemoryLimit | None = None, optimizer: str | None = None) -> Referenced:
    """Eager PyTorch's step of the model at `batch_size` on `device` (tasks/validate/reference.py), or under a device
    memory `limit` the first reference step that fits it, once per model x batch size x device x seed: the
    loss, gradients and buffers every plan of the cell must reproduce (with `optimizer`, the parameters after
    its update too; in `cache_dir/references/`, safetensors), the step's peak (which budgets such as
    "50% eager" are fractions of) and its step time."""
    from memplan.tasks.validate.reference import measure_reference

    key = _reference_key(None, dict(model=model, batch_size=batch_size, device=device, seed=seed, limit=limit,
                                    optimizer=optimizer))
    path = Path(cache_dir) / "references" / f"{model.name}-b{batch_size}-{key[10:26]}.safetensors"
    return measure_reference(model, batch_size, device, seed, path, limit=limit, optimizer=optimizer)


def _torch_version() -> str:
    from importlib.metadata import version

    return version("torch")


# -- solve -------------------------------------------------------------------------------------------


def _solve_key(context: Any, p: Mapping[str, Any]) -> str:
    return content_key("solve", p["traced"].fingerprint, p["profile"].run_id, p["solver"], p["budget"],
                       p["settings"], p["device"], code_hash("solve"))


@task(name="solve", cache_key_fn=_solve_key, task_run_name="solve {alias}", **PERSISTED, **HOOKS)
def solve_step(traced: Traced, profile: Profiled, solver: str, budget: Budget, settings: PlanSettings,
               device: str, store: str, cache_dir: str, alias: str) -> Solved:
    """Solve one matrix cell with the plan's `settings` on the costs of the device the
    profile just measured (its device key, e.g. a fleet class: a newer profile of the same graph from another
    class of the same device type is never used); the plan lands in `cache_dir/solutions/`."""
    key = _solve_key(None, dict(traced=traced, profile=profile, solver=solver, budget=budget, settings=settings,
                                device=device))
    plan_path = str(Path(cache_dir) / "solutions" / f"{alias}-{key[6:22]}.json")
    from memplan.tasks.solve_stage import solve_case

    return solve_case(_existing(traced.path, "trace"), solver, budget, settings, profile.device, store, plan_path)


# -- measured search of compiled cells ---------------------------------------------------------------


def _compiled_search_key(context: Any, p: Mapping[str, Any]) -> str:
    return content_key("compiled-search", p["traced"].fingerprint, p["profile"].run_id, p["solved"].plan_id,
                       p["solved"].budget_bytes, p["settings"], p["model"].content_hash(p["batch_size"]), p["device"],
                       p["seed"], p["validate"].compile_backend, p["validate"].compile_probes, _torch_version(),
                       code_hash("compiled_search"))


@task(name="compiled-search", cache_key_fn=_compiled_search_key, task_run_name="compiled search {alias}",
      **PERSISTED, **HOOKS)
def compiled_search_step(solved: Solved, traced: Traced, profile: Profiled, settings: PlanSettings, model: ModelConfig,
                         batch_size: int, device: str, seed: int, validate: ValidateConfig, store: str, cache_dir: str,
                         alias: str) -> Solved:
    """The measured search of a compiled policy cell (tasks/compiled/policy_cell.py): `solved` replaced by the cheapest plan
    whose peak under torch.compile, measured, fits its budget; the plan lands in `cache_dir/solutions/`."""
    from memplan.tasks.compiled.policy_cell import search_cell

    key = _compiled_search_key(None, dict(traced=traced, profile=profile, solved=solved, settings=settings,
                                          model=model, batch_size=batch_size, device=device, seed=seed,
                                          validate=validate))
    plan_path = str(Path(cache_dir) / "solutions" / f"{alias}-compiled-{key[16:32]}.json")
    return search_cell(_existing(traced.path, "trace"), solved, settings, model, batch_size, device, profile.device,
                       seed, store, validate, plan_path)


# -- compiled-form plans -----------------------------------------------------------------------------


def _compiled_plans_key(context: Any, p: Mapping[str, Any]) -> str:
    return content_key("compiled-plans", p["model"].content_hash(p["batch_size"]), p["solver"],
                       [(alias, budget) for alias, budget in zip(p["aliases"], p["budgets"])], p["device"], p["seed"],
                       p["probes"], _torch_version(), code_hash("compiled_plans"))


@task(name="compiled-plans", cache_key_fn=_compiled_plans_key,
      task_run_name="compiled plans {model.name} b{batch_size} {solver}", **PERSISTED, **HOOKS)
def compiled_plans_step(model: ModelConfig, batch_size: int, solver: str, budgets: list[Budget], aliases: list[str],
                        device: str, seed: int, probes: int, cache_dir: str) -> list[Solved]:
    """The compiled-form plans of one model, batch size and solver, one per budget, by a search measured under
    torch.compile (tasks/compiled/plans.py); the plans land in `cache_dir/solutions/`."""
    from memplan.tasks.compiled.plans import CompiledCell, plan_cells

    key = _compiled_plans_key(None, dict(model=model, batch_size=batch_size, solver=solver, budgets=budgets,
                                         aliases=aliases, device=device, seed=seed, probes=probes))
    folder = Path(cache_dir) / "solutions"
    folder.mkdir(parents=True, exist_ok=True)
    cells = [CompiledCell(alias, budget, str(folder / f"{alias}-{key[15:31]}.json"))
             for alias, budget in zip(aliases, budgets)]
    no_recompute = str(folder / f"{model.name}-b{batch_size}-inductor-{key[15:31]}.json")
    return plan_cells(model, batch_size, cells, solver, seed, device, probes, no_recompute)


# -- validate ----------------------------------------------------------------------------------------


def _validate_key(context: Any, p: Mapping[str, Any]) -> str:
    for path in p["plan_paths"]:
        _existing(path, "solve")
    _existing(p["reference"].path, "reference")
    return content_key("validate", p["plan_ids"], p["model"].content_hash(p["batch_size"]), p["device"], p["seed"],
                       p["settings"], p["reference"], p.get("limit"), p.get("no_recompute_ids"), _torch_version(),
                       code_hash("validate"))


@task(name="validate", cache_key_fn=_validate_key, task_run_name="validate {model.name} b{batch_size}",
      **PERSISTED, **HOOKS)
def validate_step(plan_paths: list[str], plan_ids: list[str], model: ModelConfig, batch_size: int, device: str,
                  seed: int, settings: ValidateConfig, reference: Referenced,
                  limit: MemoryLimit | None = None, no_recompute_paths: list[str | None] | None = None,
                  no_recompute_ids: list[str | None] | None = None) -> list[Validated | StageError]:
    """Run the plans of one model and batch size (solved as content addresses `plan_ids`) on `device`, check
    each against the cell's `reference` and time them against eager PyTorch in shared rounds
    (tasks/validate/stage.py `validate_plans`; a plan that raises gets a `StageError` in its place, and the others go on),
    on the graphs this run's trace captured when this process holds them
    (the plans run without capturing the model again: the executor's graph, and `capture_eager`'s for plans
    in the policy form); under a device memory `limit` each plan's peak and the
    resident bytes must fit it. `no_recompute_paths` (aligned with `plan_paths`, content addresses
    `no_recompute_ids`): each plan's no-recomputation plan, timed in the same rounds, which a `max_overhead`
    plan's overhead is measured against."""
    from memplan.runtime.format.plan import Plan
    from memplan.tasks.validate.stage import validate_plans

    plans = [Plan.load(path) for path in plan_paths]
    graphs = {plan.form: captures.get(plan.fingerprint, plan.form) for plan in plans}
    baselines = [None if path is None else Plan.load(_existing(path, "solve")) for path in no_recompute_paths or ()]
    validations = validate_plans(plans, model, batch_size, device, seed, settings, reference,
                                 graph=graphs.get("executor"), limit=limit, eager_graph=graphs.get("policy"),
                                 no_recompute=baselines or None, isolate=True)
    for path, solved, validation in zip(plan_paths, plan_ids, validations):
        if validation.plan_id != solved:
            raise RuntimeError(f"{path} changed after the solve stage wrote it (plan {validation.plan_id[:12]}, "
                               f"solved {solved[:12]}); run again with --refresh.")
    return validations


def forget_captured(traced: Mapping[Any, Traced]) -> None:
    """Drop the captured graphs of the `trace_step` results `traced` (at the end of a run)."""
    captures.forget((record.fingerprint, record.form) for record in traced.values())


# -- publish -----------------------------------------------------------------------------------------


@task(name="publish", task_run_name="publish {alias}", **HOOKS)
def publish_step(plan_path: str, validation: Validated, plans_dir: str, alias: str, model: str,
                 batch_size: int, budget: str) -> Published:
    """Publish the validated plan at `plan_path` into `plans_dir` (idempotent, so never cached; refused
    when the file is not the plan `validation` ran)."""
    from memplan.runtime.format.plan import Plan
    from memplan.tasks.publish import publish

    return publish(Plan.load(plan_path), validation, plans_dir, alias=alias, model=model, batch_size=batch_size,
                   budget=budget)
