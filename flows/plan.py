"""The `plan` flow: pipeline.toml -> trace -> profile -> reference (eager PyTorch's step, once per model and
batch size) -> solve (mapped over the matrix) -> for compiled policy cells, the measured search by peaks under
torch.compile (tasks/compiled/policy_cell.py) -> validate (and, for `max_overhead` cells, the walk along the search's
ladder by measured overhead: flows/refine.py) -> publish, plus the run's artifacts. Compiled-form cells (`form =
"compiled"`) are neither traced, profiled nor solved: per model, batch size and solver one stage searches their
plans by compiling and measuring them (`compiled_form_cells`, tasks/compiled/plans.py), and they join the others'
validation and publication. Plans in the
policy form are solved on the step as eager PyTorch runs it (`runtime.policy.apply.capture_eager`), which the trace
and profile stages capture and measure too for their models; the others on the executor's graph. `run_plan`
is the entry point the CLI and tests use."""

from __future__ import annotations

import functools
import importlib.util
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

from prefect import flow, unmapped

from memplan.flows.preflight import check_locations
from memplan.flows.run_events import announce_scheduled_state
from memplan.flows.worker_watch import die_with_worker
from memplan.flows.refine import PlanToValidate, Validate, measured_choices
from memplan.flows.report import Outcome, create_artifacts
from memplan.flows.steps import (compiled_plans_step, compiled_search_step, forget_captured, profile_step, publish_step,
                                 reference_step, solve_step, trace_step, validate_step)
from memplan.tasks.config import (Case, MemplanError, ModelConfig, PipelineConfig, PlanForm, RunConfig, expand_matrix,
                          graph_forms, load_config)
from memplan.tasks.fit.memory_limit import check_resident_fits, memory_limit
from memplan.tasks.models import allow_imports_from, check_model, resolve_device
from memplan.tasks.records import EAGER, Profiled, Referenced, Solved, StageError, Traced, Validated, attempt
from memplan.tasks.store.profiles import check_store


class PipelineFailed(MemplanError):
    """A plan failed validation or a stage raised for a cell (the outcomes that fail a run: a budget the device
    cannot meet is reported, not raised); the message says why for every unpublished cell, `outcomes` holds every
    cell's `Outcome` as JSON."""

    def __init__(self, message: str, outcomes: list[dict[str, Any]]):
        super().__init__(message)
        self.outcomes = outcomes


Graph = tuple[str, int, PlanForm]
"""A traced graph of a run: its model's name, batch size and plan form."""


@flow(name="plan", description="Trace, profile, solve, validate and publish the plans of a pipeline.toml.",
      persist_result=False, result_serializer="json", on_running=[announce_scheduled_state, die_with_worker])
def plan_flow(config_path: str = "pipeline.toml", refresh: bool = False,
              config: PipelineConfig | None = None) -> list[dict[str, Any]]:
    """Run the pipeline of `config_path` (already parsed as `config` when given: the TOML is read once per
    run); `refresh` re-runs every stage instead of using its cache.

    Returns one `Outcome` (as JSON) per matrix cell, infeasible ones included. A stage that raises fails the
    cells it ran for (a trace, profile or reference those of its model and batch size) and the run goes on with
    the others; raises `PipelineFailed` after publishing what passed when any cell failed or any plan failed
    validation."""
    config = config or load_config(config_path)
    check_store(config.store)                  # before tracing: a missing bucket fails in a second
    allow_imports_from(Path(config_path).parent)
    device = resolve_device(config.device)
    if config.device_memory == "device":           # read the GPU's free memory once, before anything runs
        config = config.model_copy(update={"device_memory": memory_limit(config, device).limit_bytes})
    cases = expand_matrix(config)
    rerun = {"refresh_cache": True} if refresh else {}

    traced: dict[Graph, Traced | StageError] = {}
    try:
        for m, b in config.model_batches():
            for form in graph_forms(m.name, b, cases):
                traced[m.name, b, form] = attempt("trace", trace_step.with_options(**rerun), m, b, device, config.seed,
                                                  config.cache_dir, form)
        models = {m.name: m for m in config.models}
        profiled = {key: _profile(models[key[0]], record, config, device, rerun) for key, record in traced.items()}
        references = {(m.name, b): attempt("reference", _reference, m, b, device, config, cases, rerun)
                      for m, b in config.model_batches()
                      if _any_graph(m.name, b, profiled) or any(_cell(c) == (m.name, b) and _compiled(c) for c in cases)}
        outcomes = {c.alias: Outcome.failed(c, error) for c in cases
                    if (error := _model_error(c, profiled, references)) is not None}
        check_eager_budgets([c for c in cases if c.alias not in outcomes], references)
        compiled = [c for c in cases if c.alias not in outcomes and _compiled(c)]
        running = [c for c in cases if c.alias not in outcomes and not _compiled(c)]
        cells = dict(
            traced=[traced[_graph(c)] for c in running],
            profile=[profiled[_graph(c)] for c in running],
            solver=[c.plan.solver for c in running],
            budget=[c.budget.of_eager(references[c.model.name, c.batch_size].peak_bytes) for c in running],
            settings=[c.plan.solve_settings(config.optimizer) for c in running],
            device=unmapped(device),
            store=unmapped(config.store),
            cache_dir=unmapped(config.cache_dir),
            alias=[c.alias for c in running],
        )
        with cell_runner(config.run) as runner:
            solutions = compiled_searches(running, solve_cells(cells, runner, rerun), cells, config, device, rerun)
            running, solutions = running + compiled, solutions + compiled_form_cells(compiled, references, config,
                                                                                     device, rerun)
            outcomes |= {c.alias: Outcome.failed(c, s) for c, s in zip(running, solutions) if isinstance(s, StageError)}
            solved = [i for i, s in enumerate(solutions) if isinstance(s, Solved)]
            running, solutions = [running[i] for i in solved], [solutions[i] for i in solved]
            floors = least_known_budgets(running, solutions)
            validate = functools.partial(validate_groups, config=config, device=device, references=references,
                                         rerun=rerun, runner=runner)
            validations = _validate_cells(running, solutions, validate)
            solutions, validations, walks = measured_choices(running, solutions, validations, validate)
            outcomes |= {case.alias: _publish_cell(case, s, config, validations.get(case.alias),
                                                   floors.get(_graph(case)), references[_cell(case)].peak_bytes,
                                                   walks.get(case.alias, ""))
                         for case, s in zip(running, solutions)}
    finally:
        forget_captured({key: record for key, record in traced.items() if isinstance(record, Traced)})
    ordered = [outcomes[c.alias] for c in cases]
    create_artifacts(ordered, Path(config.cache_dir) / "reports")
    failed = [o for o in ordered if o.status != "published"]
    if any(o.status in ("rejected", "failed") for o in failed):
        raise PipelineFailed(
            f"{len(failed)} of {len(ordered)} plans were not published ({len(ordered) - len(failed)} were): "
            + " ".join(o.message for o in failed),
            [o.to_json() for o in ordered],
        )
    return [o.to_json() for o in ordered]


def _profile(model: ModelConfig, traced: Traced | StageError, config: PipelineConfig, device: str,
             rerun: dict[str, Any]) -> Profiled | StageError:
    """The profile of one traced graph of `model`, or the error of its trace or profile."""
    if isinstance(traced, StageError):
        return traced
    step = profile_step.with_options(retries=config.profile.retries, **rerun)
    return attempt("profile", step, model, traced, device, config.seed, config.profile, config.store)


def _any_graph(model: str, batch_size: int, profiled: dict[Graph, Profiled | StageError]) -> bool:
    """Whether some graph of `model` at `batch_size` was traced and profiled (its reference is worth measuring)."""
    return any(isinstance(record, Profiled) for (m, b, _), record in profiled.items() if (m, b) == (model, batch_size))


def _model_error(case: Case, profiled: dict[Graph, Profiled | StageError],
                 references: dict[tuple[str, int], Referenced | StageError]) -> StageError | None:
    """The error that fails every cell of `case`'s graph or of its model and batch size: its trace's or profile's
    (none for a compiled-form cell), else its reference's; None where all three ran."""
    for record in (profiled.get(_graph(case)), references.get(_cell(case))):
        if isinstance(record, StageError):
            return record
    return None


def check_task_runner(run: RunConfig) -> None:
    """Refuse, before any stage runs, a Dask task runner whose package is not installed."""
    if run.task_runner == "dask" and importlib.util.find_spec("prefect_dask") is None:
        raise MemplanError("[run] task_runner = \"dask\" needs prefect-dask and Dask, which the fleet extra "
                           "installs: pip install -c constraints.txt -e '.[fleet]' (docs/install.md); or set "
                           "task_runner = \"threads\".")
    if run.dask_dashboard is not None and importlib.util.find_spec("bokeh") is None:
        raise MemplanError(f"[run] dask_dashboard = {run.dask_dashboard!r} needs bokeh, which the fleet extra installs: "
                           "pip install -c constraints.txt -e '.[fleet]' (docs/install.md); or remove dask_dashboard.")


@contextmanager
def cell_runner(run: RunConfig) -> Iterator[Any]:
    """The task runner of the solve and validate cells: None for the flow's thread pool (`[run] task_runner
    = "threads"`), else a started prefect-dask `DaskTaskRunner` on the scheduler at `dask_address` or on a
    local cluster of `dask_workers` single-threaded processes bound to 127.0.0.1 (its dashboard at
    `dask_dashboard` when given; prefect-dask logs the link)."""
    if run.task_runner == "threads":
        yield None
        return
    from prefect_dask import DaskTaskRunner

    if run.dask_address:
        runner = DaskTaskRunner(address=run.dask_address)
    else:
        runner = DaskTaskRunner(cluster_kwargs={"n_workers": run.dask_workers, "threads_per_worker": 1,
                                                "processes": True, "host": "127.0.0.1",
                                                "dashboard_address": run.dask_dashboard})
    with runner:
        yield runner


def solve_cells(cells: dict[str, Any], runner: Any, rerun: dict[str, Any]) -> list[Solved | StageError]:
    """Solve every cell of `cells` (`solve_step`'s arguments, a list each) on the task runner (`cell_runner`: None
    for the flow's thread pool), all of them before any is validated (no solver competes with the timed steps),
    each cached result whose plan file is gone solved again; a cell whose solve raises gets its `StageError`."""
    step = solve_step.with_options(**rerun)
    solved = step.map(**cells) if runner is None else runner.map(step, cells)
    results = [attempt("solve", future.result) for future in solved]
    return [s if isinstance(s, StageError) else
            attempt("solve", _resolved_if_gone, s, {k: v[i] for k, v in cells.items()}) for i, s in enumerate(results)]


def _resolved_if_gone(solved: Solved, cell: dict[str, Any]) -> Solved:
    """`solved`, or, where it is a cached result whose plan file is gone (a cleaned cache folder), the cell
    solved again: the cache never serves a result that points at nothing."""
    if not solved.feasible or Path(solved.plan_path).exists():
        return solved
    return solve_step.with_options(refresh_cache=True)(**cell)


def compiled_searches(cases: list[Case], solutions: list[Solved | StageError], cells: dict[str, Any],
                      config: PipelineConfig, device: str, rerun: dict[str, Any]) -> list[Solved | StageError]:
    """The solutions with each compiled policy cell's replaced by its measured search's (`compiled_search_step`,
    tasks/compiled/policy_cell.py), or by its `StageError` where the search raises: a `selective-policy` plan in the policy
    form with `options = { compiled = true }` at a budget in bytes or as a fraction (a `max_overhead` cell walks its
    ladder instead), unless `[validate] compile_probes = 0`. One cell after another in this process, before any
    validation: each measures peaks."""
    searched = list(solutions)
    for i, (case, solved) in enumerate(zip(cases, solutions)):
        settings = cells["settings"][i]
        if (isinstance(solved, Solved) and settings.form == "policy" and settings.params.get("compiled") is True
                and case.budget.max_overhead is None and config.validation.compile_probes > 0):
            arguments = (solved, cells["traced"][i], cells["profile"][i], settings, case.model, case.batch_size, device,
                         config.seed, config.validation, config.store, config.cache_dir, case.alias)
            searched[i] = attempt("compiled search", _compiled_search, arguments, rerun)
    return searched


def _compiled_search(arguments: tuple[Any, ...], rerun: dict[str, Any]) -> Solved:
    """`compiled_search_step(*arguments)`, searched again where it is a cached search whose plan file is gone (a
    cleaned cache folder)."""
    searched = compiled_search_step.with_options(**rerun)(*arguments)
    if searched.feasible and not Path(searched.plan_path).exists():
        searched = compiled_search_step.with_options(refresh_cache=True)(*arguments)
    return searched


References = dict[tuple[str, int], Referenced]
"""The reference of each (model name, batch size) of a run."""


def _compiled(case: Case) -> bool:
    """Whether a cell is in the compiled form (planned on torch.compile's own graph: tasks/compiled/plans.py)."""
    return case.plan.plan_form == "compiled"


def compiled_form_cells(cases: list[Case], references: References, config: PipelineConfig, device: str,
                        rerun: dict[str, Any]) -> list[Solved | StageError]:
    """The compiled-form cells' answers, aligned with `cases`: one `compiled_plans_step` per model, batch size and
    solver (its budgets share the plans it measures), one after another in this process (each compiles and
    measures peaks); budgets that are fractions of eager's peak resolved by the reference. Where a step raises,
    each of its cells gets the error."""
    groups: dict[tuple[str, int, str], list[Case]] = {}
    for case in cases:
        groups.setdefault((*_cell(case), case.plan.solver), []).append(case)
    answers: dict[str, Solved | StageError] = {}
    for (name, batch_size, solver), group in groups.items():
        arguments = (group[0].model, batch_size, solver,
                     [c.budget.of_eager(references[name, batch_size].peak_bytes) for c in group],
                     [c.alias for c in group], device, config.seed, config.validation.compile_probes, config.cache_dir)
        found = attempt("compiled plans", _compiled_plans, arguments, rerun)
        answers |= {c.alias: found if isinstance(found, StageError) else s for c, s in zip(group, found)}
    return [answers[c.alias] for c in cases]


def _compiled_plans(arguments: tuple[Any, ...], rerun: dict[str, Any]) -> list[Solved]:
    """`compiled_plans_step(*arguments)`, planned again where a cached answer's plan file is gone."""
    found = compiled_plans_step.with_options(**rerun)(*arguments)
    if any(not Path(path).exists() for s in found for path in (s.plan_path, s.no_recompute_path) if path):
        found = compiled_plans_step.with_options(refresh_cache=True)(*arguments)
    return found
"""The reference of each (model name, batch size) of a run."""


def _reference(model: ModelConfig, batch_size: int, device: str, config: PipelineConfig, cases: list[Case],
               rerun: dict[str, Any]) -> Referenced:
    """The reference step of one model and batch size (cached; under the device memory limit, with the
    pipeline's optimizer when a plan of the cell runs it inside the step), measured again when its tensors
    file is gone."""
    in_step = any(c.plan.optimizer_in_step for c in cases if (c.model.name, c.batch_size) == (model.name, batch_size))
    parameters = dict(model=model, batch_size=batch_size, device=device, seed=config.seed, cache_dir=config.cache_dir,
                      limit=memory_limit(config, device), optimizer=config.optimizer if in_step else None)
    reference = reference_step.with_options(**rerun)(**parameters)
    if not Path(reference.path).exists():                 # a cleaned cache folder: never point at nothing
        reference = reference_step.with_options(refresh_cache=True)(**parameters)
    return reference


def check_eager_budgets(cases: list[Case], references: References) -> None:
    """Refuse budgets that are fractions of eager's peak in a cell whose reference is not eager (eager does not
    fit the device memory limit there, so its peak was never measured)."""
    for case in cases:
        reference = references[_cell(case)]
        if case.budget.eager_fraction is not None and reference.kind != EAGER:
            raise MemplanError(
                f"budget {case.budget.label!r} of {case.model.name} at batch {case.batch_size} is a fraction of eager "
                f"PyTorch's peak, but eager does not fit device_memory there (the reference is {reference.kind}); "
                f"give that budget in bytes, as a fraction of the checkpoint-all peak, or as max_overhead.")


def _cell(case: Case) -> tuple[str, int]:
    return case.model.name, case.batch_size


def _graph(case: Case) -> tuple[str, int, PlanForm]:
    """The traced graph a case is solved on: its model and batch size's, for its plan's form."""
    return case.model.name, case.batch_size, case.plan.plan_form


def _validate_cells(cases: list[Case], solutions: list[Solved],
                    validate: Validate) -> dict[str, Validated | StageError]:
    """The validation of every feasible plan, by alias (a `StageError` where it raised): `validate`
    (`validate_groups`) runs one `validate_step` per model and batch size, its plans timed in shared rounds."""
    groups: dict[tuple[str, int], list[tuple[Case, Solved]]] = {}
    for case, solved in zip(cases, solutions):
        if solved.feasible:
            groups.setdefault(_cell(case), []).append((case, solved))
    results = validate({cell: [(case.model, PlanToValidate.of(s)) for case, s in group]
                        for cell, group in groups.items()})
    return {case.alias: validation for cell, group in groups.items()
            for (case, _), validation in zip(group, results[cell])}


def validate_groups(groups: dict[tuple[str, int], list[tuple[ModelConfig, PlanToValidate]]], config: PipelineConfig,
                    device: str, references: References, rerun: dict[str, Any],
                    runner: Any) -> dict[tuple[str, int], list[Validated | StageError]]:
    """One `validate_step` per model and batch size of `groups`, its plans timed in shared rounds (beside their
    no-recomputation plans): on the task runner's workers, one cell each, when `runner` is given; else one cell
    after another in this process. A plan that raises gets its `StageError`; where what a group's plans share
    raises (the model, its reference, the timed rounds), each of them gets that error."""
    parameters = {
        cell: dict(plan_paths=[p.plan_path for _, p in group], plan_ids=[p.plan_id for _, p in group],
                   model=group[0][0], batch_size=cell[1], device=device, seed=config.seed,
                   settings=config.validation, reference=references[cell], limit=memory_limit(config, device),
                   no_recompute_paths=[p.no_recompute_path for _, p in group],
                   no_recompute_ids=[p.no_recompute_id for _, p in group])
        for cell, group in groups.items()}
    validate = validate_step.with_options(**rerun)
    if runner is None:
        return {cell: _group_results(functools.partial(validate, **p), p["plan_ids"]) for cell, p in parameters.items()}
    futures = {cell: runner.submit(validate, p) for cell, p in parameters.items()}
    return {cell: _group_results(future.result, parameters[cell]["plan_ids"]) for cell, future in futures.items()}


def _group_results(run: Callable[[], list[Validated | StageError]],
                   plan_ids: list[str]) -> list[Validated | StageError]:
    """`run()`, the validation of one group of plans (content addresses `plan_ids`), or where it raises, that
    error for each plan."""
    results = attempt("validate", run)
    if isinstance(results, StageError):
        return [results.model_copy(update={"plan_id": plan}) for plan in plan_ids]
    return results


@dataclass(frozen=True)
class KnownFloor:
    """The least budget a run knows to be feasible for one model and batch size, and what showed it."""

    bytes: int
    source: str


def least_known_budgets(cases: list[Case], solutions: list[Solved]) -> dict[tuple[str, int, PlanForm], KnownFloor]:
    """Per (model, batch size, plan form): the least of the peaks of the run's schedules and of the smallest
    feasible budgets its probes found for infeasible cells (greedy checkpointing; the policy form's own
    solver): the floor an infeasibility message cites."""
    floors: dict[tuple[str, int, PlanForm], KnownFloor] = {}
    for case, solved in zip(cases, solutions):
        if solved.feasible:
            found = KnownFloor(solved.predicted_peak_bytes, f"the peak of {case.alias}'s schedule")
        elif solved.smallest_feasible_budget is not None:
            found = KnownFloor(solved.smallest_feasible_budget, case.plan.solver if case.plan.plan_form == "policy"
                               else "greedy checkpointing")
        else:
            continue
        key = _graph(case)
        if key not in floors or found.bytes < floors[key].bytes:
            floors[key] = found
    return floors


def _publish_cell(case: Case, solved: Solved, config: PipelineConfig, validation: Validated | StageError | None,
                  floor: KnownFloor | None, eager_peak: int, walk: str = "") -> Outcome:
    """Publish one cell's plan when its `validation` passed; `floor` is the least budget the run knows feasible
    for the cell's model and batch size, `eager_peak` eager PyTorch's measured peak there, `walk` what the
    measured walk of a `max_overhead` cell validated (flows/refine.py); a published compiled cell's message says what
    its measured search measured (tasks/compiled/policy_cell.py). A cell whose validation or publication raised failed."""
    if validation is None:                                  # no schedule: nothing was validated
        return Outcome.of(case, solved, message=infeasible_message(case, solved, floor),
                          least_feasible_bytes=None if floor is None else floor.bytes, eager_peak_bytes=eager_peak)
    if isinstance(validation, StageError):
        return Outcome.failed(case, validation, solved)
    if not validation.passed:
        return Outcome.of(case, solved, validation, message=validation.explain(case.alias))
    published = attempt("publish", publish_step, solved.plan_path, validation, config.publish.dir, case.alias,
                        case.model.name, case.batch_size, case.budget.label)
    if isinstance(published, StageError):
        return Outcome.failed(case, published, solved)
    return Outcome.of(case, solved, validation, published, message=walk or solved.measured_search)


def infeasible_message(case: Case, solved: Solved, floor: KnownFloor | None = None) -> str:
    """Why a cell has no plan, with the least feasible budget the run knows (`floor`)."""
    budget, peak = solved.budget_bytes, solved.checkpoint_all_peak_bytes
    if _compiled(case):
        return (f"{case.alias}: {solved.message}; the least peak measured is {solved.smallest_feasible_budget:,} B: "
                f"raise the budget.")
    if case.budget.max_overhead is not None:
        return (f"{case.alias}: solver {case.plan.solver} found {solved.message}; raise max_overhead or pick "
                f"another solver.")
    text = (
        f"{case.alias}: solver {case.plan.solver} found no schedule within {budget:,} B ({case.budget.label}; "
        f"the checkpoint-all peak is {peak:,} B), status {solved.status}"
        + (f" ({solved.message})" if solved.message else "")
        + f"; no schedule fits below {solved.min_budget_lower_bound:,} B"
    )
    if floor is not None:
        text += f", and the least feasible budget this run knows is {floor.bytes:,} B ({floor.source})"
    if "time limit" in solved.message.lower():
        text += f"; raise time_limit_s (now {case.plan.time_limit_s:g} s) or the budget"
    else:
        text += "; raise the budget"
    return text + "."


def run_plan(config_path: str | Path = "pipeline.toml", refresh: bool = False,
             config: PipelineConfig | None = None) -> list[dict[str, Any]]:
    """Validate `config_path` (or take its parsed `config`), then run `plan_flow` with Prefect's results
    stored under `<cache_dir>/prefect` (JSON records, failures included: no pickle; caching survives
    across runs)."""
    from prefect.settings import PREFECT_LOCAL_STORAGE_PATH, PREFECT_RESULTS_DEFAULT_SERIALIZER, temporary_settings

    config = config or load_config(config_path)
    allow_imports_from(Path(config_path).parent)
    limit = memory_limit(config, resolve_device(config.device))      # device_memory = "device" on a CPU fails here
    check_store(config.store)
    for model in config.models:
        check_model(model)
    check_resident_fits(config, limit)
    check_task_runner(config.run)
    check_locations(config, publishes=True)
    storage = Path(config.cache_dir).resolve() / "prefect"
    with temporary_settings({PREFECT_LOCAL_STORAGE_PATH: storage, PREFECT_RESULTS_DEFAULT_SERIALIZER: "json"}):
        return plan_flow(str(config_path), refresh, config)
