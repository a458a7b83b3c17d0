"""DDP's buckets without processes: the bucketing rule (order of finality, cap), the simulator's charge for the
bucket buffers (peaks computed by hand on a four-node graph), and the refusals of what cannot run."""

from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from memplan import runtime
from memplan.runtime.tracing.program import CaptureError
from memplan.runtime.format.schedule import GradientBucket, gradient_buckets
from memplan.tasks.solve.core.ddp import bucket_cap_bytes, under_ddp
from memplan.tasks.solve.core.problem import ParamUpdate, Problem, ProblemError
from memplan.tasks.solve.core.simulator import default_schedule, simulate


def steps(*outputs):
    """One compute step per tuple of allocated values (None: a free step)."""
    return [None if out is None else SimpleNamespace(inputs=(), outputs=out, overwrites=()) for out in outputs]


def test_buckets_follow_the_order_gradients_become_final_within_the_cap():
    # gradient values 10..13 of 40, 30, 20, 50 bytes; 12 is computed first, 10 is recomputed last
    io = steps((10,), (12,), None, (11, 13), (10,))
    buckets = gradient_buckets(io, [10, 11, 12, 13], [40, 30, 20, 50], cap_bytes=60)
    # finality order: 12 (step 1), 11 and 13 (step 3, in gradient order), 10 (step 4)
    assert buckets == [GradientBucket(3, (2, 1), 50), GradientBucket(3, (3,), 50), GradientBucket(4, (0,), 40)]
    assert all(b.nbytes <= 60 for b in buckets)


def test_a_gradient_above_the_cap_is_a_bucket_alone_and_a_missing_one_is_left_out():
    io = steps((1,), (2,), (3,))
    assert gradient_buckets(io, [1, 2, 3, 4], [10, 100, 10, 10], cap_bytes=50) == [
        GradientBucket(0, (0,), 10), GradientBucket(1, (1,), 100), GradientBucket(2, (2,), 10)]
    assert gradient_buckets(io, [1, 2, 3], [10, 10, 10], cap_bytes=10**9) == [GradientBucket(2, (0, 1, 2), 30)]
    with pytest.raises(ValueError, match="positive number of bytes"):
        gradient_buckets(io, [1], [10], cap_bytes=0)


def four_nodes() -> Problem:
    """Parameter 0 -> activation 1 (60 B) -> loss 2 (4 B); gradient 3 (40 B) from 1, gradient 4 (30 B) from 0
    with 50 B of workspace."""
    return Problem(name="four", cost=np.ones(4), workspace=np.array([0, 0, 0, 50]),
                   phase=("forward", "loss", "backward", "backward"), node_inputs=((0,), (1,), (1,), (0,)),
                   node_outputs=((1,), (2,), (3,), (4,)), value_bytes=np.array([8, 60, 4, 40, 30]),
                   value_producer=np.array([-1, 0, 1, 2, 3]), outputs=(2, 3, 4), order=np.arange(4))


def test_the_simulator_charges_each_bucket_buffer_from_its_launch_to_the_end():
    problem = four_nodes()
    gradients = [((3,), (0,)), ((4,), (0,))]
    schedule = default_schedule(problem)
    # no DDP: step 2 holds 60 + 4 + 40 = 104, step 3 holds 4 + 40 + 30 + 50 workspace = 124
    assert simulate(problem, schedule).timeline.tolist() == [60, 64, 104, 124]
    # two buckets (50 B cap): gradient 3's 40 B buffer from step 2 (after its node: 4 + 40 + 40 = 84 < 104),
    # then step 3 holds 124 + 40 = 164 while computing, 4 + 40 + 30 + 40 + 30 = 144 after its launch
    two = under_ddp(problem, gradients, 50 / bucket_cap_bytes(1))
    assert simulate(two, schedule).timeline.tolist() == [60, 64, 104, 164]
    # one bucket: launched after step 3, when its workspace is gone: 74 + 70 = 144
    one = under_ddp(problem, gradients, 1.0)
    assert simulate(one, schedule).timeline.tolist() == [60, 64, 104, 144]


def test_bad_settings_are_refused():
    problem = four_nodes()
    with pytest.raises(ValueError, match="ddp_bucket_mb must be a positive number"):
        under_ddp(problem, [((3,), (0,))], 0)
    with pytest.raises(ProblemError, match="does not combine with the optimizer inside the step"):
        under_ddp(problem.__class__(**{**problem.__dict__, "outputs": (2, 4), "updates": (ParamUpdate((3,), (0,)),)}),
                  [((4,), (0,))])


def loss_fn(model, x, y):
    return F.cross_entropy(model(x), y)


@pytest.fixture
def ddp_model(tmp_path):
    """A small model under DDP in a one-rank gloo group."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    torch.manual_seed(0)
    yield DDP(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)))
    dist.destroy_process_group()


def test_capture_of_the_ddp_wrapper_names_the_fix(ddp_model):
    with pytest.raises(CaptureError, match=r"Capture its \.module"):
        runtime.capture(ddp_model, loss_fn, (torch.randn(4, 8), torch.randint(0, 4, (4,))))


def test_ddp_with_the_optimizer_inside_the_step_or_cuda_graphs_is_refused(ddp_model):
    plan = runtime.default_plan(runtime.capture(ddp_model.module, loss_fn, (torch.randn(4, 8), torch.randint(0, 4, (4,)))))
    with pytest.raises(ValueError, match="before its bucket's all-reduce completes"):
        runtime.load(plan, ddp_model, loss_fn, optimizer=torch.optim.SGD(ddp_model.parameters(), lr=0.1))
    with pytest.raises(ValueError, match="cuda_graph=True"):
        runtime.load(plan, ddp_model, loss_fn, cuda_graph=True)
    ddp_model.register_comm_hook(None, lambda state, bucket: None)
    with pytest.raises(ValueError, match="communication hook"):
        runtime.load(plan, ddp_model, loss_fn)


def test_no_sync_launches_no_all_reduce(ddp_model):
    batch = (torch.randn(4, 8), torch.randint(0, 4, (4,)))
    step = runtime.load(runtime.default_plan(runtime.capture(ddp_model.module, loss_fn, batch)), ddp_model, loss_fn)
    launches = []
    launch = step.gradient_sync.launch
    step.gradient_sync.launch = lambda *grads: launches.append(launch(*grads)) or launches[-1]
    step(*batch)
    with ddp_model.no_sync():
        step(*batch)
    assert len(launches) >= 1 and launches.count(None) == len(launches) // 2


def test_the_plan_setting_reaches_the_solver_and_bad_values_are_refused():
    from pydantic import ValidationError

    from memplan.tasks.config.sections import PlanConfig

    assert PlanConfig(solver="dtr", budgets=[0.5], ddp_bucket_mb=5).solve_settings().ddp_bucket_mb == 5
    assert PlanConfig(solver="dtr", budgets=[0.5]).solve_settings().ddp_bucket_mb is None
    with pytest.raises(ValidationError, match="ddp_bucket_mb"):
        PlanConfig(solver="dtr", budgets=[0.5], ddp_bucket_mb=0)
    with pytest.raises(ValidationError, match="both optimizer_in_step = true and ddp_bucket_mb"):
        PlanConfig(solver="dtr", budgets=[0.5], ddp_bucket_mb=5, optimizer_in_step=True)
