"""`[run] dask_dashboard`: the local Dask cluster of the `plan` flow serves its dashboard (bokeh, in the fleet
extra) where asked, and prefect-dask's client links to it; elsewhere the key is refused."""

from __future__ import annotations

import urllib.request

import pytest

from memplan.flows.plan import cell_runner, check_task_runner
from memplan.tasks.config import ConfigError, parse_config

from .conftest import free_port

BASE = {"models": [{"name": "mlp", "factory": "m:f", "inputs": [{"shape": [4]}]}],
        "plans": [{"solver": "ap-greedy", "budgets": ["90%"]}]}


def _run(**run):
    return parse_config({**BASE, "run": run}, "fleet.toml", solvers=["ap-greedy"]).run


def test_the_local_clusters_dashboard_answers_where_asked():
    port = free_port()
    run = _run(task_runner="dask", dask_workers=1, dask_dashboard=f"127.0.0.1:{port}")
    check_task_runner(run)
    with cell_runner(run) as runner:
        assert runner.client.dashboard_link == f"http://127.0.0.1:{port}/status"
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/status", timeout=10) as page:
            assert page.status == 200 and b"Dask" in page.read()


@pytest.mark.parametrize("run, message", [
    (dict(dask_dashboard=":8787"), "dask_dashboard applies to the local cluster"),
    (dict(task_runner="dask", dask_address="tcp://10.0.0.5:8786", dask_dashboard=":8787"),
     r"dask scheduler --dashboard-address :8787"),
])
def test_dask_dashboard_is_refused_where_memplan_starts_no_cluster(run, message):
    with pytest.raises(ConfigError, match=message):
        _run(**run)
