"""The `profile` flow: trace and profile every model of a pipeline.toml (and, for models with policy-form
plans, the step as eager PyTorch runs it, which those plans are solved on), nothing else. Meant for
scheduled deployments that keep the profile store fresh on each GPU class; the `plan` flow then solves
against the newest complete profile."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from prefect import flow

from memplan.flows.preflight import check_locations
from memplan.flows.run_events import announce_scheduled_state
from memplan.flows.worker_watch import die_with_worker
from memplan.flows.steps import profile_step, trace_step
from memplan.tasks.config import PipelineConfig, expand_matrix, graph_forms, load_config
from memplan.tasks.models import allow_imports_from, check_model, resolve_device
from memplan.tasks.store.profiles import check_store


@flow(name="profile", description="Trace and profile the models of a pipeline.toml into the profile store.",
      on_running=[announce_scheduled_state, die_with_worker])
def profile_flow(config_path: str = "pipeline.toml", reuse: bool = False,
                 config: PipelineConfig | None = None) -> list[dict[str, Any]]:
    """Profile every (model, batch size) of `config_path` (parsed once: `config` when given); a new run is
    measured each time unless `reuse`, which keeps a cached profile of an unchanged graph. Traces are
    always re-used when unchanged."""
    config = config or load_config(config_path)
    check_store(config.store)                  # before tracing: a missing bucket fails in a second
    allow_imports_from(Path(config_path).parent)
    device = resolve_device(config.device)
    measure = profile_step.with_options(retries=config.profile.retries, refresh_cache=not reuse)
    runs, cases = [], expand_matrix(config)
    for model, batch_size in config.model_batches():
        for form in graph_forms(model.name, batch_size, cases):
            traced = trace_step(model, batch_size, device, config.seed, config.cache_dir, form)
            run = measure(model, traced, device, config.seed, config.profile, config.store)
            runs.append({"model": model.name, "batch_size": batch_size, "form": form, "nodes": traced.nodes,
                         **run.to_json()})
    return runs


def run_profile(config_path: str | Path = "pipeline.toml", reuse: bool = False,
                config: PipelineConfig | None = None) -> list[dict[str, Any]]:
    """Validate `config_path` (or take its parsed `config`), then run `profile_flow` with Prefect's results
    under `<cache_dir>/prefect`."""
    from prefect.settings import PREFECT_LOCAL_STORAGE_PATH, temporary_settings

    config = config or load_config(config_path)
    allow_imports_from(Path(config_path).parent)
    resolve_device(config.device)
    check_store(config.store)
    for model in config.models:
        check_model(model)
    check_locations(config, publishes=False)
    with temporary_settings({PREFECT_LOCAL_STORAGE_PATH: Path(config.cache_dir).resolve() / "prefect"}):
        return profile_flow(str(config_path), reuse, config)
