"""`memplan.plan`: the five-line script (plan, save, load, three steps) trains as eager PyTorch does; on the default
pipeline.toml's gpt2-tiny it makes the plan the pipeline's solve stage makes on the same stored profile; bad
arguments are refused before anything runs; docs/training.md's example runs as written."""

from __future__ import annotations

import copy
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import memplan
from memplan.flows.python_api import PlanInfeasible, PlanRequestError

ROOT = Path(__file__).resolve().parents[2]
FAST = dict(profile={"warmup": 0, "repeats": 1}, validate={"steps": 2, "max_steps": 3})
"""One profiling call per node and round, two or three timed steps: the plan does not depend on them (the measured
walk's choice may)."""


def small_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(32, 32), nn.Tanh()) for _ in range(8)], nn.Linear(32, 10))


def loss_fn(model, x, y):
    return F.cross_entropy(model(x), y)


def small_batch() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return torch.randn(512, 32, generator=generator), torch.randint(0, 10, (512,), generator=generator)


def test_five_line_script_trains_as_eager_and_reuses_the_stored_profile(tmp_path):
    from memplan.runtime.format.plan import Plan
    from memplan.tasks.store.profiles import run_files

    torch.set_num_threads(1)
    model, batch = small_model(), small_batch()
    before = copy.deepcopy(model.state_dict())
    rng = torch.get_rng_state()
    store = str(tmp_path / "store")

    plan = memplan.plan(model, loss_fn, batch, max_overhead=0.25, store=store, **FAST)   # with the measured walk
    plan.save(tmp_path / "plan.json")
    step = memplan.load(tmp_path / "plan.json", model, loss_fn)

    assert isinstance(plan, Plan) and plan.provenance["max_overhead"] == 0.25
    assert Plan.load(tmp_path / "plan.json").schedule == plan.schedule
    assert torch.equal(torch.get_rng_state(), rng)                          # RNG state restored
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())   # model untouched
    assert all(p.grad is None for p in model.parameters())
    eager = copy.deepcopy(model)
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, eager)]
    for _ in range(3):
        for opt in optimizers:
            opt.zero_grad()
        loss = step(*batch)
        expected = loss_fn(eager, *batch)
        expected.backward()
        torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-6)
        for (name, p), q in zip(model.named_parameters(), eager.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6, msg=name)
        for opt in optimizers:
            opt.step()

    runs = run_files(store)
    assert len(runs) == 1
    fixed = memplan.plan(small_model(), loss_fn, batch, budget="60%", store=store, walk=False, **FAST)
    assert run_files(store) == runs                                       # the stored profile of this graph, reused
    assert fixed.fingerprint == plan.fingerprint and fixed.provenance["profile_run_id"] == plan.provenance["profile_run_id"]
    with pytest.raises(PlanInfeasible, match=r"least feasible budget found is [\d,]+ B .*pass budget=\d+"):
        memplan.plan(small_model(), loss_fn, batch, budget=1000, store=store, **FAST)


def test_gpt2_tiny_plan_equals_the_pipeline_solve_on_the_same_profile(tmp_path):
    """The default pipeline.toml's gpt2-tiny, its dtr cell at 5% overhead: `memplan.plan` (profiling into a fresh
    store) and the pipeline's own trace and solve stages on that store give one plan (content address and schedule)."""
    from memplan.runtime.format.plan import plan_id
    from memplan.tasks.config import Budget, load_config
    from memplan.tasks.models import build_batch, build_loss, build_model, resolve_device
    from memplan.tasks.profile.stage import device_info
    from memplan.tasks.solve_stage import solve_case
    from memplan.tasks.trace import trace

    torch.set_num_threads(1)
    config = load_config(ROOT / "pipeline.toml")
    spec = next(m for m in config.models if m.name == "gpt2-tiny")
    table = next(p for p in config.plans if p.solver == "dtr" and p.plan_form == "executor")
    device, batch_size, store = resolve_device(config.device), spec.batch_sizes[0], str(tmp_path / "store")
    model = build_model(spec, config.seed).to(device)
    batch = build_batch(spec, batch_size, config.seed, device)

    plan = memplan.plan(model, build_loss(spec), batch, max_overhead=table.max_overhead[0], solver="dtr", store=store,
                        name=spec.name, seed=config.seed, walk=False, **FAST)

    traced, _ = trace(spec, batch_size, device, config.seed, tmp_path / "pipeline")
    solved = solve_case(traced.path, "dtr", Budget(max_overhead=table.max_overhead[0]),
                        table.solve_settings(config.optimizer), device_info(torch.device(device))["device"], store,
                        str(tmp_path / "pipeline" / "plan.json"))
    assert traced.fingerprint == plan.fingerprint
    assert solved.feasible and solved.plan_id == plan_id(plan)
    from memplan.runtime.format.plan import Plan

    assert Plan.load(solved.plan_path).schedule == plan.schedule


class Untouchable(nn.Module):
    """A model whose forward fails the test: nothing may run it."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(2, 2)

    def forward(self, x):
        raise AssertionError("memplan.plan ran the model before refusing its arguments")


@pytest.mark.parametrize("kwargs, message", [
    ({}, "neither `budget` nor `max_overhead`"),
    (dict(budget="60%", max_overhead=0.05), "both `budget` and `max_overhead`"),
    (dict(budget="60%", solver="no-such-solver"), "unknown solver 'no-such-solver'; registered solvers: .*dtr"),
    (dict(budget="60%", form="compiled"), "memplan run"),
    (dict(budget="60%", form="sideways"), "form 'sideways'"),
    (dict(budget="sixty"), "budget"),
    (dict(max_overhead=[0.05, 0.25]), "one number"),
    (dict(budget="60%", solver="dtr", form="policy"), "dtr"),
    (dict(budget="60%", options={"no_such_option": 1}), "no_such_option"),
    (dict(budget="60%", validate={"stepz": 2}), "stepz"),
])
def test_bad_arguments_are_refused_before_any_work(tmp_path, kwargs, message):
    store = tmp_path / "store"
    with pytest.raises(PlanRequestError, match=message) as raised:
        memplan.plan(Untouchable(), loss_fn, (torch.randn(4, 2), torch.randint(0, 2, (4,))), store=str(store),
                     **kwargs)
    assert "\n" not in str(raised.value)
    assert not store.exists() or not any(store.iterdir())


def test_batch_and_device_arguments_are_checked():
    model = Untouchable()
    with pytest.raises(PlanRequestError, match="tuple of tensors"):
        memplan.plan(model, loss_fn, torch.randn(4, 2), budget="60%")
    with pytest.raises(PlanRequestError, match="not callable"):
        memplan.plan(model, "cross_entropy", (torch.randn(4, 2),), budget="60%")


def test_training_doc_example_runs_as_written(tmp_path):
    """docs/training.md's `python-api` example: plan, save, load, three steps (its losses printed)."""
    doc = (ROOT / "docs" / "training.md").read_text()
    block, = [b for b in re.findall(r"```python\n(.*?)```", doc, re.S) if b.startswith("# example: python-api\n")]
    (tmp_path / "example.py").write_text(block)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    done = subprocess.run([sys.executable, "example.py"], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    losses = [float(line) for line in done.stdout.split()]
    assert len(losses) == 3 and losses[2] < losses[0], done.stdout
    assert (tmp_path / "plan.json").exists() and (tmp_path / "profiles_db").is_dir()


def test_policy_form_plan_trains_in_the_users_own_loop(tmp_path):
    """`solver="selective-policy"` makes a plan in the policy form (its default), which `memplan.apply` runs."""
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(32, 128), nn.Tanh(), nn.Linear(128, 32)) for _ in range(6)])
    batch = small_batch()
    plan = memplan.plan(model, loss_fn, batch, budget="70%", solver="selective-policy", store=str(tmp_path / "store"),
                        **FAST)
    assert plan.provenance["form"] == "policy"
    eager = copy.deepcopy(model)
    applied = memplan.apply(plan, model, loss_fn, batch)
    loss_fn(applied, *batch).backward()
    loss_fn(eager, *batch).backward()
    for p, q in zip(applied.parameters(), eager.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6)
