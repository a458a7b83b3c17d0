"""Session-wide test settings shared by every test folder."""

import os

# Prefect's ephemeral server starts slowly on small machines; never phone home from tests.
os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
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


SHARED_CAPTURES = ("tests/runtime/test_executor.py", "tests/runtime/test_acg_plans.py")
"""Modules that trace the same torchvision models: one xdist worker runs them together, first, so each model
is traced once per suite instead of once per worker."""


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
