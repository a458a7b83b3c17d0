"""Session-wide test settings shared by every test folder."""

import os

# Prefect's ephemeral server starts slowly on small machines; never phone home from tests.
os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
# Models are built from configs with random weights: never reach for a hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


SHARED_CAPTURES = ("tests/runtime/test_executor.py", "tests/runtime/test_acg_plans.py")
"""Modules that trace the same large torchvision models (densenet121 takes a minute): one xdist worker
runs them together, first, so each model is traced once per suite instead of once per worker."""


def _work_unit(nodeid: str) -> str:
    module = nodeid.split("::", 1)[0]
    return "shared-captures" if module in SHARED_CAPTURES else module


def pytest_xdist_make_scheduler(config, log):
    """Scheduling for the 2 xdist workers of pyproject's addopts: a module's tests stay on one worker (as
    with `--dist loadfile`: module fixtures such as captures are built once), SHARED_CAPTURES together."""
    from xdist.scheduler import LoadScopeScheduling

    class ModuleScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return _work_unit(nodeid)

    return ModuleScheduling(config, log)


def pytest_collection_modifyitems(config, items):
    """The shared-captures unit first (with `--no-loadscope-reorder` work units go out in collection
    order): the longest unit starts at once instead of ending the run on one worker."""
    items.sort(key=lambda item: _work_unit(item.nodeid) != "shared-captures")
