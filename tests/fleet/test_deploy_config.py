"""`[deploy]` and `[run]` in pipeline.toml, `memplan deploy`'s errors without a server, `memplan fleet status`
on a store with known run times."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

import pytest

from memplan.flows.commands.deploy import desired_deployments
from memplan.flows.prefect_server import DeployError, api_url
from memplan.flows.commands.fleet import fleet_status
from memplan.tasks.config import ConfigError, parse_config
from memplan.tasks.store.profiles import write_run

from .conftest import T0, free_port

BASE = {"models": [{"name": "mlp", "factory": "m:f", "inputs": [{"shape": [4]}]}],
        "plans": [{"solver": "ap-greedy", "budgets": ["90%"]}]}


def config(deploy=None, run=None, **top):
    data = {**BASE, **top}
    if deploy is not None:
        data["deploy"] = deploy
    if run is not None:
        data["run"] = run
    return parse_config(data, "fleet.toml", solvers=["ap-greedy"])


@pytest.mark.parametrize("deploy, message", [
    ({"classes": [{"name": "h100", "profile_cron": "0 3 * *"}]},
     r"key deploy.classes\[0\].profile_cron = '0 3 \* \*': .* is not a cron expression"),
    ({"classes": [{"name": "h100", "timezone": "Mars/Base"}]}, r"deploy.classes\[0\].timezone .* unknown"),
    ({"classes": [{"name": "h100", "plan_parameters": {"reuse": True}}]},
     r"deploy.classes\[0\].plan_parameters: unknown flow parameter\(s\) \['reuse'\]; allowed: refresh"),
    ({"classes": [{"name": "h100", "fit_parameters": {"device_memory": "16 GiB"}}]},
     r"deploy.classes\[0\].fit_parameters: unknown flow parameter\(s\) \['device_memory'\]; allowed: model, "
     r"max_overhead, solver, max_size, dimension, batch_size"),
    ({"classes": [{"name": "h100", "gpu": "x"}]}, r"deploy.classes\[0\].gpu = 'x': unknown key; allowed keys in "
                                                  r"deploy.classes\[0\]: name, device, profile_cron"),
    ({"classes": [{"name": "h100"}, {"name": "h100"}]}, "device class 'h100' is declared twice"),
    ({"classes": []}, "'classes' is empty"),
    ({"classes": [{"name": "h 100"}]}, "names a work queue"),
])
def test_bad_deploy_sections_name_the_key_path(deploy, message):
    with pytest.raises(ConfigError, match=message):
        config(deploy)


def test_run_section_defaults_to_threads_and_checks_dask_keys():
    assert config().run.task_runner == "threads" and config().deploy is None
    assert config(run={"task_runner": "dask", "dask_address": "tcp://127.0.0.1:8786"}).run.dask_address
    with pytest.raises(ConfigError, match="dask_address applies with task_runner = 'dask' only"):
        config(run={"dask_address": "tcp://127.0.0.1:8786"})
    with pytest.raises(ConfigError, match=r"key run.task_runner = 'ray'"):
        config(run={"task_runner": "ray"})


def test_store_urls_are_not_taken_relative_to_the_file():
    assert config(store="s3://bucket/prefix").relative_to("/project").store == "s3://bucket/prefix"
    assert config(store="db").relative_to("/project").store == "/project/db"


def test_cron_gaps_set_the_allowed_age():
    classes = config({"classes": [{"name": "a", "profile_cron": "0 * * * *"}, {"name": "b"},
                                  {"name": "c", "profile_cron": "0 2 * * 1", "timezone": "Europe/Paris"},
                                  {"name": "d", "profile_cron": "0 6,18 * * *"}]}).deploy.classes
    assert [c.max_age_s(T0) for c in classes] == [3600, 86400, 7 * 86400, 12 * 3600]


def test_deployments_per_class_and_flow():
    deploy = config({"directory": "/mnt/shared/memplan", "work_pool": "gpu-fleet",
                     "classes": [{"name": "h100", "plan_cron": "0 5 * * *", "profile_parameters": {"reuse": True},
                                  "fit_parameters": {"model": "gpt2-tiny", "max_overhead": 0.1}},
                                 {"name": "a100", "timezone": "Europe/Paris", "fit_cron": "0 6 * * 1"}]}).deploy
    wanted = {(d["flow"], d["name"].removesuffix("@gpu-fleet")): d
              for d in desired_deployments(deploy, Path("conf/fleet.toml"))}
    assert sorted(wanted) == [("fit", "a100"), ("fit", "h100"), ("plan", "a100"), ("plan", "h100"),
                              ("profile", "a100"), ("profile", "h100")]
    assert wanted["fit", "h100"]["name"] == "h100@gpu-fleet"          # deployment names are per server, pools not
    fit = wanted["fit", "h100"]
    assert (fit["entrypoint"], fit["schedules"], fit["work_queue_name"]) == ("memplan.flows.fit:fit_flow", [], "h100")
    assert fit["parameters"] == {"config_path": "/mnt/shared/memplan/fleet.toml", "model": "gpt2-tiny",
                                 "max_overhead": 0.1}
    assert wanted["fit", "a100"]["schedules"] == [("0 6 * * 1", "Europe/Paris")]
    profile = wanted["profile", "h100"]
    assert profile["parameters"] == {"config_path": "/mnt/shared/memplan/fleet.toml", "reuse": True}
    assert (profile["work_pool_name"], profile["work_queue_name"], profile["path"]) == (
        "gpu-fleet", "h100", "/mnt/shared/memplan")
    assert profile["entrypoint"] == "memplan.flows.profile:profile_flow" and profile["schedules"] == [("0 3 * * *", "UTC")]
    assert wanted["plan", "h100"]["schedules"] == [("0 5 * * *", "UTC")] and wanted["plan", "a100"]["schedules"] == []
    assert wanted["profile", "a100"]["schedules"] == [("0 3 * * *", "Europe/Paris")]
    assert wanted["plan", "a100"]["job_variables"] == {"env": {
        "MEMPLAN_DEVICE_CLASS": "a100", "PREFECT_FLOWS_HEARTBEAT_FREQUENCY": "60", "PREFECT_FLOWS_DEFAULT_RETRIES": "0",
        "PREFECT_RESULTS_DEFAULT_SERIALIZER": "json",
        "PREFECT_LOCAL_STORAGE_PATH": "/mnt/shared/memplan/.cache/memplan/prefect"}}
    assert "memplan-pool:gpu-fleet" in profile["tags"]


def test_deployment_runs_keep_results_on_shared_storage(tmp_path):
    project = tmp_path / "here"
    classes = [{"name": "h100"}]
    shared = config({"directory": "/mnt/shared/memplan", "classes": classes}).deploy
    env = desired_deployments(shared, project / "fleet.toml", str(project / "cache"))[0]["job_variables"]["env"]
    assert env["PREFECT_LOCAL_STORAGE_PATH"] == "/mnt/shared/memplan/cache/prefect"   # the workers' path
    block = config({"classes": classes, "result_storage": "s3-bucket/memplan-results"}).deploy
    env = desired_deployments(block, project / "fleet.toml")[0]["job_variables"]["env"]
    assert env["PREFECT_RESULTS_DEFAULT_STORAGE_BLOCK"] == "s3-bucket/memplan-results"
    assert "PREFECT_LOCAL_STORAGE_PATH" not in env and env["PREFECT_RESULTS_DEFAULT_SERIALIZER"] == "json"


def test_zombie_detection_must_wait_longer_than_a_heartbeat():
    with pytest.raises(ConfigError, match="zombie_after_s = 60 must exceed heartbeat_s = 60"):
        config({"classes": [{"name": "h100"}], "heartbeat_s": 60, "zombie_after_s": 60})
    with pytest.raises(ConfigError, match="heartbeat_s"):
        config({"classes": [{"name": "h100"}], "heartbeat_s": 10})


def test_deploy_needs_a_reachable_server(monkeypatch):
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with temporary_settings(restore_defaults={PREFECT_API_URL}):
        with pytest.raises(DeployError, match="PREFECT_API_URL is not set: .*`prefect server start`"):
            api_url()
    closed = f"http://127.0.0.1:{free_port()}/api"
    with temporary_settings({PREFECT_API_URL: closed}):
        with pytest.raises(DeployError, match=f"server at PREFECT_API_URL={closed} cannot be reached"):
            api_url()


def test_fleet_status_flags_late_and_missing_classes(tmp_path, make_run):
    store = str(tmp_path / "store")
    now = T0 + timedelta(days=3)
    write_run(make_run("fp", device="cpu-a", minutes=3 * 24 * 60 - 30), store)   # 30 min old, hourly: ok
    write_run(make_run("fp", device="h100", minutes=0), store)                   # 3 days old, daily: late
    write_run(make_run("fp", device="h100", minutes=10, nodes=3)[:-1], store)    # newer but incomplete: ignored
    loaded = config({"classes": [{"name": "cpu-a", "profile_cron": "0 * * * *"}, {"name": "big", "device": "h100"},
                                 {"name": "a100"}]}, store=store)
    rows = fleet_status(loaded, now=now)
    assert [(r["device_class"], r["device"], r["status"], r["age_s"]) for r in rows] == [
        ("cpu-a", "cpu-a", "ok", 1800.0), ("big", "h100", "late", 3 * 86400.0), ("a100", "a100", "missing", None)]
    assert rows[1]["profiled_at"] == T0.isoformat()
