"""A deployment run's flow process ends with the worker that started it.

Prefect's process worker starts each flow run as a child process in a session of its own, so a worker killed
alone (SIGKILL, the OOM killer, a worker started outside systemd) left the run going on without it, and the
run ended CRASHED, a final state the zombie automation takes as an answer: it was never re-run.
`die_with_worker`, an `on_running` hook of the deployed flows, watches the parent process and, once it is
gone, kills the flow process (and its process group when it leads one) with SIGKILL: nothing reports an
end, its heartbeats stop, and the zombie automation (flows/automations.py) crashes the run and runs it again
on a surviving worker of the class.
"""

from __future__ import annotations

import os
import signal
import threading
import time

POLL_S = 2.0


def die_with_worker(flow, flow_run, state) -> None:
    """In a flow process a worker started (PREFECT__FLOW_RUN_ID set, a deployment's run), start a daemon
    thread that kills this process once its parent, the worker, has exited."""
    if flow_run.deployment_id is None or os.environ.get("PREFECT__FLOW_RUN_ID") != str(flow_run.id):
        return
    worker = os.getppid()

    def watch() -> None:
        while os.getppid() == worker:
            time.sleep(POLL_S)
        me = os.getpid()
        if os.getpgrp() == me:
            os.killpg(me, signal.SIGKILL)
        os.kill(me, signal.SIGKILL)

    threading.Thread(target=watch, name="memplan-die-with-worker", daemon=True).start()
