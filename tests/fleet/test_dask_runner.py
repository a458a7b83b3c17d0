"""`[run] task_runner = "dask"` for real: the `plan` flow's solve and validate cells go through prefect-dask
to a local cluster and to an external `dask scheduler` with two `dask worker` processes (started on
loopback here, stopped in teardown), and publish the same plans as the default thread pool.

All three runs start from the same traced graph and profile run (the threads run traces and profiles; each
Dask run gets a copy of its cache without the solve and validate results), so any difference in a plan
comes from the runner. Plan ids are hashes of the plans' content: equal ids mean equal schedules. The runs
report to one `prefect server start` (as a platform team's runs do), not to an ephemeral server each.
"""

from __future__ import annotations

import os
import shutil
import sys
import textwrap
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Iterator

import pytest

from .conftest import REPO, free_port, prefect_server_on, started

ALIASES = ("mlp-b64-checkmate-95pct", "mlp-b64-checkmate-85pct")

PIPELINE = """
device = "cpu"
store = "{store}"
cache_dir = "{cache}"

[[models]]
name = "mlp"
factory = "dask_models:mlp"
loss = "cross_entropy"
batch_sizes = [64]
inputs = [{{ shape = [8] }}, {{ shape = [], dtype = "int64", high = 4 }}]

[profile]
warmup = 0
repeats = 1

[[plans]]
solver = "checkmate"
budgets = ["95%", "85%"]

[validate]
steps = 2
max_steps = 2

[publish]
dir = "{plans}"

[run]
{run}
"""

# A module name of its own: other fleet tests import their own `tiny_models` in the same pytest process, and
# the local cluster's forked workers would inherit that module instead of importing this one.
MODELS = '''
from torch import nn

def mlp(width=32, depth=4):
    layers = []
    for i in range(depth):
        layers += [nn.Linear(8 if i == 0 else width, width), nn.Tanh()]
    return nn.Sequential(*layers, nn.Linear(width, 4))
'''


def _write(project: Path, runner: str, run: str) -> Path:
    """pipeline-<runner>.toml with its own cache and plans folders; one store for all runners."""
    path = project / f"pipeline-{runner}.toml"
    path.write_text(PIPELINE.format(store=project / "store", cache=project / f"cache-{runner}",
                                    plans=project / f"plans-{runner}", run=run))
    return path


def _copy_profiled_cache(source: Path, target: Path) -> None:
    """`source` without its solve and validate results: the trace and profile run are re-used."""
    shutil.copytree(source, target)
    shutil.rmtree(target / "solutions")
    dropped = [r for r in (target / "prefect").iterdir() if r.name.startswith(("solve-", "validate-"))]
    assert len(dropped) == len(ALIASES) + 1, sorted(r.name for r in (target / "prefect").iterdir())   # one cell
    for record in dropped:
        record.unlink()


def _run(config: Path, api: str) -> None:
    """`memplan run --debug config` in a process of its own, as a user runs it (a local cluster's workers then
    fork from that process, not from this test session's; `--debug` keeps Prefect's task logs, which the
    run's settings carry to the Dask workers, on the workers' consoles), reporting to the server at `api`."""
    import subprocess

    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(config.parent)]), "OMP_NUM_THREADS": "1",
           "PREFECT_API_URL": api}
    done = subprocess.run([sys.executable, "-m", "memplan.flows.cli", "run", "--debug", str(config)], cwd=config.parent, env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, (done.stdout[-3000:], done.stderr[-3000:])


def _published(plans: Path) -> dict[str, tuple[str, int]]:
    """Per cell: the content address of the plan file its alias names (a hash of the schedule and the rest
    of the plan, without its creation time) and the peak its validation measured, from the plans index."""
    from memplan.runtime.format.plan import Plan
    from memplan.tasks.publish import plan_id, read_index

    rows = {r["alias"]: r for r in read_index(plans)}
    assert sorted(rows) == sorted(ALIASES), rows
    addresses = {alias: plan_id(Plan.load(plans / f"{alias}.json")) for alias in rows}
    assert addresses == {alias: r["plan_id"] for alias, r in rows.items()}
    return {alias: (addresses[alias], r["measured_peak_bytes"]) for alias, r in rows.items()}


@pytest.fixture(scope="module")
def api(tmp_path_factory) -> Iterator[str]:
    """`prefect server start` on a SQLite database: the API URL every run of this module reports to."""
    home = tmp_path_factory.mktemp("dask-prefect")
    with prefect_server_on(f"sqlite+aiosqlite:///{home / 'prefect.db'}", home) as url:
        yield url


@pytest.fixture(scope="module")
def baseline(tmp_path_factory, api):
    """A project (model module, store) and the plans of the default thread pool: (project, published)."""
    project = tmp_path_factory.mktemp("dask-project")
    (project / "dask_models.py").write_text(textwrap.dedent(MODELS))
    _run(_write(project, "threads", 'task_runner = "threads"'), api)
    return project, _published(project / "plans-threads")


@contextmanager
def dask_cluster(folder: Path, workers: int = 2) -> Iterator[str]:
    """`dask scheduler` and `workers` single-threaded `dask worker` processes on 127.0.0.1, run from
    `folder` (the project: its model module is importable there) as an operator starts them; yields the
    scheduler's address once every worker has joined."""
    from distributed import Client

    dask = str(Path(sys.executable).with_name("dask"))
    address = f"tcp://127.0.0.1:{free_port()}"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(folder)]), "OMP_NUM_THREADS": "1",
           "PREFECT_LOGGING_LEVEL": "INFO"}
    with ExitStack() as stack:
        stack.enter_context(started([dask, "scheduler", "--host", "127.0.0.1", "--port", address.rsplit(":", 1)[1],
                                     "--no-dashboard"], folder / "scheduler.log", env=env, cwd=folder))
        for i in range(workers):
            stack.enter_context(started([dask, "worker", address, "--host", "127.0.0.1", "--nthreads", "1",
                                         "--no-dashboard", "--name", f"w{i}"], folder / f"worker-{i}.log",
                                        env=env, cwd=folder))
        with Client(address, timeout=60) as client:
            try:
                client.wait_for_workers(workers, timeout=120)
            except TimeoutError as exc:
                raise TimeoutError(f"{workers} dask workers did not join {address} within 120 s:\n"
                                   + _logs(folder)) from exc
        yield address


def _logs(folder: Path) -> str:
    return "\n".join(f"--- {p.name}\n{p.read_text()[-2000:]}" for p in sorted(folder.glob("*.log")))


@pytest.mark.fleet_e2e
def test_local_dask_cluster_publishes_the_thread_pools_plans(baseline, api):
    project, expected = baseline
    _copy_profiled_cache(project / "cache-threads", project / "cache-local")
    _run(_write(project, "local", 'task_runner = "dask"\ndask_workers = 2'), api)
    assert _published(project / "plans-local") == expected
    assert len(list((project / "cache-local" / "solutions").glob("*.json"))) == len(ALIASES)   # solved again


@pytest.mark.fleet_e2e
def test_external_dask_cluster_publishes_the_thread_pools_plans(baseline, api):
    project, expected = baseline
    _copy_profiled_cache(project / "cache-threads", project / "cache-external")
    with dask_cluster(project) as address:
        _run(_write(project, "external", f'task_runner = "dask"\ndask_address = "{address}"'), api)
        published = _published(project / "plans-external")
        finished = _finished_on_workers(address)
    assert len(finished) == len(ALIASES) + 1, (finished, _logs(project))      # each solve cell and the validate cell
    assert published == expected


def _finished_on_workers(address: str) -> set[str]:
    """The keys of the tasks the scheduler at `address` saw a worker finish (its transition log: a task reaches
    "memory" only when a worker has computed it), whatever the workers print."""
    from distributed import Client

    def finished(dask_scheduler) -> list[str]:
        return sorted({str(t[0]) for t in dask_scheduler.transition_log if t[2] == "memory"})

    with Client(address, timeout=60) as client:
        return set(client.run_on_scheduler(finished))
