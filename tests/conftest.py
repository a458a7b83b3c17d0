"""Session-wide test settings shared by every test folder."""

import os
import sys
from typing import Iterator

import pytest

# Prefect's ephemeral server starts slowly on small machines; never phone home from tests.
os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
# The suite starts some eighty Python processes that import memplan (CLI runs, examples, ranks, flow runs, Dask
# workers) and three xdist workers that rewrite every test module's asserts: with PYTHONDONTWRITEBYTECODE set,
# as on many CI hosts, each compiled it all again (4 CPU-s of collection per worker, 0.5 s per process).
# Bytecode goes to the __pycache__ folders .gitignore lists.
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
sys.dont_write_bytecode = False
# Models are built from configs with random weights: never reach for a hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# Each xdist worker gets its share of the cores for torch's OpenMP pool (and the processes it starts):
# two workers with a pool of every core each oversubscribe the machine, and spinning OpenMP threads then
# slow a step several-fold (measured: test_variant_rules.py 50 s with 1 thread, 100 s with 2, beside a busy
# worker).
if os.environ.get("PYTEST_XDIST_WORKER"):
    _share = max(1, (os.cpu_count() or 1) // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")))
    os.environ["OMP_NUM_THREADS"] = str(_share)
    import torch

    torch.set_num_threads(_share)


@pytest.fixture(scope="session")
def harness() -> Iterator[str]:
    """One Prefect test harness (a server of its own) for the test session of a worker; yields its API URL, for
    the `memplan` processes a test starts."""
    from prefect.settings import PREFECT_API_URL
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=120):
        yield PREFECT_API_URL.value()


SHARED_CAPTURES = ("tests/runtime/test_executor.py", "tests/runtime/test_acg_plans.py")
"""Modules that trace the same torchvision models: one xdist worker runs them together, first, so each model
is traced once per suite instead of once per worker."""


def _work_unit(nodeid: str) -> str:
    module = nodeid.split("::", 1)[0]
    return "shared-captures" if module in SHARED_CAPTURES else module


WAITING = ("tests/fleet/test_fleet_ops.py", "tests/fleet/test_scheduler.py")
"""Modules that mostly wait on Prefect's clocks (a dead host's run is marked crashed after `zombie_after_s`
without a heartbeat; a cron run starts on the minute): about 80 of their 140 s. With 3 or more xdist workers
the last one runs only these, beside the others' CPU-bound tests, so the waits overlap with work."""


def pytest_xdist_make_scheduler(config, log):
    """Scheduling for the xdist workers of pyproject's addopts: a module's tests stay on one worker (as with
    `--dist loadfile`: module fixtures such as captures are built once), SHARED_CAPTURES together; with 3 or
    more workers, the last is a lane for the WAITING modules, which the others take only once they have
    nothing else."""
    from xdist.scheduler import LoadScopeScheduling

    class ModuleScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return _work_unit(nodeid)

        def _waiting_lane(self, node) -> bool:
            return len(self.nodes) >= 3 and node is self.nodes[-1]

        def _next_unit(self, node) -> str | None:
            """The first queued unit of the node's lane; for a worker of the others, any unit once its own
            lane's are gone."""
            lane = self._waiting_lane(node)
            mine = next((scope for scope in self.workqueue if (scope in WAITING) == lane), None)
            return mine if mine is not None or lane else next(iter(self.workqueue), None)

        def _assign_work_unit(self, node) -> None:
            scope = self._next_unit(node)
            if scope is None:
                return
            work_unit = self.workqueue.pop(scope)
            self.assigned_work.setdefault(node, {})[scope] = work_unit
            collection = self.registered_collections[node]
            node.send_runtest_some([collection.index(nodeid) for nodeid, done in work_unit.items() if not done])

        def schedule(self) -> None:
            super().schedule()
            for node in self.nodes:                 # a lane with nothing queued is never given a test
                if not node.shutting_down and not self.assigned_work.get(node):
                    self._reschedule(node)

        def _reschedule(self, node) -> None:
            if not node.shutting_down and self._next_unit(node) is None \
                    and not self._pending_of(self.assigned_work.get(node, {})):
                node.shutdown()                 # its lane is done (the base class waits for an empty queue)
                return
            super()._reschedule(node)

    return ModuleScheduling(config, log)


LONGEST_FIRST = ("tests/pipeline/test_training_doc.py", "tests/fleet/test_dask_runner.py", "shared-captures",
                 "tests/pipeline/test_default_pipeline.py", "tests/pipeline/test_fit.py", "tests/fleet/test_fleet_e2e.py",
                 "tests/runtime/test_compiled_search.py")
"""The work units of 30 s and more (each 30-100 s on 2 cores), longest first."""


def pytest_collection_modifyitems(config, items):
    """The LONGEST_FIRST units first, in that order (with `--no-loadscope-reorder` work units go out in
    collection order): long units start at once instead of ending the run on one worker while the others
    have finished (longest-first scheduling), then the rest in collection order."""
    rank = {unit: i for i, unit in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(_work_unit(item.nodeid), len(LONGEST_FIRST)))
