"""The Prefect automations that `memplan deploy` keeps on the server for a fleet's work pool.

- zombies: a run of the pool's deployments that sent no heartbeat for `zombie_after_s` (its host or
  process died: nothing reports its end) is marked CRASHED and, with `rerun_zombies`, its deployment is run
  again, so that a surviving worker of the class's queue takes it;
- failures (with `notify_block`): every FAILED or CRASHED run of the pool's deployments is sent to the
  notification block.

Runs are matched by the tag `memplan-pool:<pool>` that `memplan deploy` gives every deployment it makes.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from memplan.tasks.config import DeployConfig, MemplanError

FINAL_EVENTS = ("prefect.flow-run.Completed", "prefect.flow-run.Failed", "prefect.flow-run.Cancelled",
                "prefect.flow-run.Crashed")


def pool_tag(pool: str) -> str:
    """The tag of every deployment (and run) of `memplan deploy` in work pool `pool`."""
    return f"memplan-pool:{pool}"


def _of_pool(pool: str) -> dict[str, str]:
    return {"prefect.resource.role": "tag", "prefect.resource.id": f"prefect.tag.{pool_tag(pool)}"}


def desired_automations(deploy: DeployConfig, client) -> list[Any]:
    """The `AutomationCore`s the fleet of `deploy` needs (the notification block is looked up by `client`)."""
    from prefect.client.schemas.objects import StateType
    from prefect.events import AutomationCore, ChangeFlowRunState, EventTrigger, Posture, RunDeployment, SendNotification

    pool = deploy.work_pool
    actions: list[Any] = [ChangeFlowRunState(
        state=StateType.CRASHED, force=True,
        message=f"No heartbeat for {deploy.zombie_after_s} s: the host or the flow process died (memplan zombie "
                f"automation; docs/fleet.md, 'When a host dies').")]
    if deploy.rerun_zombies:
        actions.append(RunDeployment(source="inferred"))
    wanted = [AutomationCore(
        name=f"memplan {pool}: zombie runs",
        description=f"Runs of work pool {pool} without a heartbeat for {deploy.zombie_after_s} s are marked crashed"
                    + (" and run again." if deploy.rerun_zombies else "."),
        trigger=EventTrigger(
            posture=Posture.Proactive, after={"prefect.flow-run.heartbeat"},
            expect={"prefect.flow-run.heartbeat", *FINAL_EVENTS}, match={"prefect.resource.id": "prefect.flow-run.*"},
            match_related=_of_pool(pool), for_each={"prefect.resource.id"}, threshold=1,
            within=timedelta(seconds=deploy.zombie_after_s)),
        actions=actions)]
    if deploy.notify_block:
        wanted.append(AutomationCore(
            name=f"memplan {pool}: failed runs",
            description=f"Every failed or crashed run of work pool {pool} is sent to block {deploy.notify_block}.",
            trigger=EventTrigger(
                posture=Posture.Reactive, expect={"prefect.flow-run.Failed", "prefect.flow-run.Crashed"},
                match={"prefect.resource.id": "prefect.flow-run.*"}, match_related=_of_pool(pool), threshold=1,
                within=timedelta(0)),
            actions=[SendNotification(
                block_document_id=_block_id(client, deploy.notify_block),
                subject="memplan: {{ flow.name }}/{{ deployment.name }} {{ flow_run.state.name }}",
                body="Run {{ flow_run.name }} of {{ deployment.name }} ended {{ flow_run.state.name }}: "
                     "{{ flow_run.state.message }}")]))
    return wanted


def _block_id(client, slug: str):
    from prefect.exceptions import ObjectNotFound

    block_type, _, name = slug.partition("/")
    try:
        return client.read_block_document_by_name(name, block_type_slug=block_type, include_secrets=False).id
    except (ObjectNotFound, ValueError):
        raise MemplanError(
            f"[deploy] notify_block = {slug!r} names no block on the server. Create it first (e.g. `prefect block "
            f"create {block_type or 'slack-webhook'}`, or in Python: `SlackWebhook(url=...).save({name!r})`), then "
            f"deploy again; or remove notify_block.") from None


def _comparable(automation) -> dict[str, Any]:
    """What a deploy compares of an automation, in a canonical form: the trigger's event sets (`after`,
    `expect`, `for_each`) dump as lists in the process's string-hash order, so they are sorted."""
    data = automation.model_dump(mode="json", include={"name", "description", "enabled", "trigger", "actions"})
    data["trigger"].pop("id", None)
    return _canonical(data)


def _canonical(value: Any) -> Any:
    if isinstance(value, dict):
        return {key: _canonical(item) for key, item in value.items()}
    if isinstance(value, list):
        items = [_canonical(item) for item in value]
        return sorted(items) if all(isinstance(item, str) for item in items) else items
    return value


def ensure_automations(client, deploy: DeployConfig, dry_run: bool = False) -> list[tuple[str, str]]:
    """Create, update or remove (a notification no longer configured) the pool's automations; return
    (object, created|updated|unchanged|removed), with `would ...` and no change when `dry_run`."""
    done = []
    wanted = {a.name: a for a in desired_automations(deploy, client)}
    prefix = f"memplan {deploy.work_pool}: "
    existing = {a.name: a for a in client.read_automations() if a.name.startswith(prefix)}
    for name, automation in wanted.items():
        have = existing.get(name)
        if have is not None and _comparable(have) == _comparable(automation):
            done.append((f"automation {name}", "unchanged"))
            continue
        if not dry_run:
            if have is None:
                client.create_automation(automation)
            else:
                client.update_automation(have.id, automation)
        done.append((f"automation {name}", ("would be " if dry_run else "") + ("created" if have is None else "updated")))
    for name in sorted(set(existing) - set(wanted)):
        if not dry_run:
            client.delete_automation(existing[name].id)
        done.append((f"automation {name}", "would be removed" if dry_run else "removed"))
    return done
