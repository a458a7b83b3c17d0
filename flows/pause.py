"""`memplan fleet pause` and `resume`: a class's deployments paused (Prefect's scheduler then creates none of
their runs, and the server deletes their future cron runs) and, what pausing alone leaves, every run of them
still waiting to start cancelled: late cron slots, runs started by hand or by the zombie automation, retries
waiting their turn. A running run finishes."""

from __future__ import annotations

from uuid import UUID

CANCELLED_BY = "Cancelled by `memplan fleet pause`: its deployment is paused (`memplan fleet resume` runs it again)."


def cancel_waiting_runs(client, deployment_id: UUID) -> int:
    """Cancel the deployment's runs in a SCHEDULED state (Scheduled, Late, AwaitingRetry, AwaitingConcurrencySlot)
    as `prefect flow-run cancel` does (a run not started yet is cancelled at once); return how many were."""
    from prefect.client.schemas.filters import (DeploymentFilter, DeploymentFilterId, FlowRunFilter, FlowRunFilterState,
                                                FlowRunFilterStateType)
    from prefect.client.schemas.objects import StateType
    from prefect.states import Cancelling

    waiting = FlowRunFilter(state=FlowRunFilterState(type=FlowRunFilterStateType(any_=[StateType.SCHEDULED])))
    of_deployment = DeploymentFilter(id=DeploymentFilterId(any_=[deployment_id]))
    tried: set[UUID] = set()
    cancelled = 0
    while runs := [r for r in client.read_flow_runs(flow_run_filter=waiting, deployment_filter=of_deployment, limit=200)
                   if r.id not in tried]:
        for run in runs:
            tried.add(run.id)
            result = client.set_flow_run_state(run.id, Cancelling(message=CANCELLED_BY))
            cancelled += result.state is not None and result.state.type in (StateType.CANCELLED, StateType.CANCELLING)
    return cancelled


def set_paused(deploy, paused: bool, classes: list[str] | None = None) -> list[tuple[str, str]]:
    """Pause the profile, plan and fit deployments of `classes` (default: all of `deploy`) and cancel their
    waiting runs, or resume them; return (deployment, what was done)."""
    from prefect.client.orchestration import get_client
    from prefect.exceptions import ObjectNotFound

    from memplan.flows.commands.deploy import ENTRYPOINTS, deployment_name
    from memplan.flows.prefect_server import api_url, server_errors
    from memplan.tasks.config import ConfigError

    names = [c.name for c in deploy.classes]
    unknown = sorted(set(classes or []) - set(names))
    if unknown:
        raise ConfigError(f"--class {unknown[0]!r} is not a device class of [deploy]; classes: {', '.join(names)}.")
    api_url()
    done: list[tuple[str, str]] = []
    with server_errors(), get_client(sync_client=True) as client:
        for name in classes or names:
            for flow in ENTRYPOINTS:
                label = f"{flow}/{deployment_name(deploy, name)}"
                try:
                    found = client.read_deployment_by_name(label)
                except ObjectNotFound:
                    done.append((label, "absent (run `memplan deploy`)"))
                    continue
                if paused:
                    client.pause_deployment(found.id)
                    cancelled = cancel_waiting_runs(client, found.id)
                    done.append((label, ("was paused already" if found.paused else "paused") +
                                 f"; {cancelled} scheduled or late run{'s' * (cancelled != 1)} cancelled"))
                else:
                    client.resume_deployment(found.id)
                    done.append((label, "resumed (was paused)" if found.paused else "not paused: unchanged"))
    return done
