"""The state event Prefect's scheduler never sends, sent by the run itself.

Prefect 3.8.8's scheduler service inserts a cron run with its SCHEDULED state directly in the database, with
no `prefect.flow-run.Scheduled` event. Every later state event of the run names its previous state's event in
`follows` (when the two are less than 5 minutes apart), and the server's trigger service holds an event back
until the one it follows has been seen, for up to 15 minutes. So the Pending, Running and Completed events of
such a run wait behind the missing event while its heartbeats (which follow nothing) go through: the zombie
automation (flows/automations.py) sees the heartbeats stop with no final state, crashes the completed run,
runs it again and the failed-run automation sends a false alert. `announce_scheduled_state`, an `on_running`
hook of the deployed flows, sends that event (the state's id as the event's id, as the server does for every
other state), so the held events are evaluated at once, in order, before the run's first heartbeat.
"""

from __future__ import annotations


def announce_scheduled_state(flow, flow_run, state) -> None:
    """Send the `prefect.flow-run.<state>` event of the first state of a run the scheduler created (no-op for
    any other run)."""
    if not flow_run.auto_scheduled:
        return
    from prefect.client.orchestration import get_client
    from prefect.events import emit_event

    with get_client(sync_client=True) as client:
        first = min(client.read_flow_run_states(flow_run.id), key=lambda s: s.timestamp)
    emit_event(
        event=f"prefect.flow-run.{first.name}", id=first.id, occurred=first.timestamp,
        resource={"prefect.resource.id": f"prefect.flow-run.{flow_run.id}", "prefect.resource.name": flow_run.name,
                  "prefect.state-name": first.name, "prefect.state-type": first.type.value,
                  "prefect.state-timestamp": first.timestamp.isoformat()},
        related=[{"prefect.resource.id": f"prefect.deployment.{flow_run.deployment_id}",
                  "prefect.resource.role": "deployment"}] if flow_run.deployment_id else [])
