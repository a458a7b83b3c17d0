"""The references past per-block checkpointing (tasks/fit/reference.py): nested checkpointing, and eager's
step on the host without the device memory limit, which validates a BatchNorm model that no in-device
reference fits (micro-batches change its batch statistics)."""

from __future__ import annotations

import copy
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from memplan.runtime.measure.meter import DeviceMemoryExceeded, PeakMeter
from memplan.tasks.fit.reference import (HOST, HOST_ATOL, HOST_RTOL, NESTED_CHECKPOINT, NoFittingReference,
                                     checkpoint_blocks, checkpoint_nested, reference_step, training_step)
from memplan.tasks.fit.memory_limit import MemoryLimit
from tests.pipeline.fit_blocks import bn_convnet, wide_blocks

BLOCKS = Path(__file__).with_name("fit_blocks.py")
BATCH, SIDE = 16, 12
UNLIMITED = MemoryLimit(limit_bytes=10**12)

PIPELINE = '''
device = "cpu"
device_memory = {limit}

[[models]]
name = "convnet"
factory = "fit_blocks:bn_convnet"
loss = "cross_entropy"
batch_sizes = [{batch}]
inputs = [{{ shape = [3, {side}, {side}] }}, {{ shape = [], dtype = "int64", high = 10 }}]

[profile]
warmup = 0
repeats = 1

[[plans]]
solver = "dtr"
budgets = [{budget}]

[validate]
steps = 1
max_steps = 1
warmup = 0
{validate}
'''


def cross_entropy(model, x, y):
    return F.cross_entropy(model(x), y)


def mse(model, x, y):
    return F.mse_loss(model(x), y)


def convnet_and_batch():
    torch.manual_seed(0)
    return bn_convnet(), (torch.randn(BATCH, 3, SIDE, SIDE), torch.randint(0, 10, (BATCH,)))


def step_total(model, loss_fn, batch, wrap=None) -> int:
    """The measured peak of one step of a copy of `model` (checkpointed by `wrap`) plus the resident bytes."""
    model = copy.deepcopy(model)
    if wrap is not None:
        wrap(model)
    step = training_step(model, loss_fn, batch, keep_buffers=wrap is not None)
    with PeakMeter("cpu") as meter:
        step()
    return meter.peak_bytes + UNLIMITED.module_resident_bytes(model, batch)


def least_in_device_total(model, loss_fn, batch) -> int:
    return min(step_total(model, loss_fn, batch, wrap) for wrap in (None, checkpoint_blocks, checkpoint_nested))


def test_nested_checkpointing_gives_eager_gradients_and_batchnorm_buffers_bit_for_bit():
    model, batch = convnet_and_batch()
    eager, nested = copy.deepcopy(model), copy.deepcopy(model)
    checkpoint_nested(nested)
    assert torch.equal(training_step(eager, cross_entropy, batch)(),
                       training_step(nested, cross_entropy, batch, keep_buffers=True)())
    for (name, a), b in zip(eager.named_parameters(), nested.parameters()):
        assert torch.equal(a.grad, b.grad), name
    for (name, a), b in zip(eager.named_buffers(), nested.buffers()):
        assert torch.equal(a, b), name


def test_nested_checkpointing_is_the_reference_where_per_block_does_not_fit():
    torch.manual_seed(0)
    model, batch = wide_blocks(), (torch.randn(64, 16), torch.randn(64, 16))
    nested = step_total(model, mse, batch, checkpoint_nested)
    assert nested < step_total(model, mse, batch, checkpoint_blocks)    # the model is built so that it saves memory
    chosen = reference_step(model, mse, batch, "cpu", MemoryLimit(limit_bytes=nested), 0, reduction=None)
    assert (chosen.kind, chosen.rtol, chosen.atol, chosen.device) == (NESTED_CHECKPOINT, 0.0, 0.0, None)


def test_the_host_is_the_last_reference_and_can_be_refused():
    model, batch = convnet_and_batch()
    limit = least_in_device_total(model, cross_entropy, batch) - 1
    chosen = reference_step(model, cross_entropy, batch, "cpu", MemoryLimit(limit_bytes=limit), 0, "mean")
    assert (chosen.kind, chosen.rtol, chosen.atol) == (HOST, 0.0, 0.0)     # BatchNorm: no micro-batches before it
    eager = copy.deepcopy(model)
    assert torch.equal(chosen.step(), training_step(eager, cross_entropy, batch)())   # eager's step, bit for bit
    for (name, a), b in zip(eager.named_parameters(), chosen.model.parameters()):
        assert torch.equal(a.grad, b.grad), name
    fits_one = MemoryLimit(limit_bytes=limit + 1)                              # one in-device reference fits
    assert reference_step(model, cross_entropy, batch, "cpu", fits_one, 0, "mean").kind != HOST
    with pytest.raises(NoFittingReference, match=r"eager: .* per-block checkpoint: .* nested checkpoint: .*"
                                                 r"host_reference = true under \[validate\]"):
        reference_step(model, cross_entropy, batch, "cpu", MemoryLimit(limit_bytes=limit, host_reference=False), 0,
                       "mean")


def test_a_host_reference_for_a_gpu_runs_on_the_cpu_with_the_cross_device_tolerance(monkeypatch):
    """Perturbs the device: the model and batch are on the CPU, the reference is asked for `cuda:0`, and a meter
    stub refuses every in-device reference as a GPU's limit would."""
    import memplan.tasks.fit.reference as fitting

    class Refusing:
        def __init__(self, *args, **kwargs):
            pass

        def __enter__(self):
            raise DeviceMemoryExceeded("the step would exceed the device memory limit; refused")

        def __exit__(self, *exc):
            return False

    monkeypatch.setattr(fitting, "PeakMeter", Refusing)
    model, batch = convnet_and_batch()
    chosen = reference_step(model, cross_entropy, batch, "cuda:0", MemoryLimit(limit_bytes=1), 0, "mean")
    assert (chosen.kind, chosen.rtol, chosen.atol) == (HOST, HOST_RTOL, HOST_ATOL)
    assert next(chosen.model.parameters()).device.type == "cpu"


def test_host_reference_must_be_a_boolean():
    from memplan.tasks.config import ConfigError, parse_config

    data = {"models": [{"name": "m", "factory": "torch.nn:Linear", "kwargs": {"in_features": 4, "out_features": 3},
                        "loss": "mse", "inputs": [{"shape": [4]}, {"shape": [3]}]}],
            "plans": [{"solver": "checkpoint-all", "budgets": [1.0]}]}
    assert parse_config(data).validation.host_reference is True
    assert parse_config(data | {"validate": {"host_reference": False}}).validation.host_reference is False
    with pytest.raises(ConfigError, match="host_reference"):
        parse_config(data | {"validate": {"host_reference": "sometimes"}})


@pytest.mark.parametrize("host", [True, False])
def test_a_batchnorm_step_no_device_reference_fits_is_validated_on_the_host_and_published(tmp_path, harness, host):
    from memplan.flows.plan import PipelineFailed, run_plan
    from memplan.runtime.format.plan import Plan

    model, batch = convnet_and_batch()
    resident = UNLIMITED.module_resident_bytes(model, batch)
    limit = least_in_device_total(model, cross_entropy, batch) - 1
    assert step_total(model, cross_entropy, batch) > limit * 1.2
    with pytest.raises(DeviceMemoryExceeded):                               # eager itself is refused
        with PeakMeter("cpu", limit_bytes=limit, resident_bytes=resident):
            cross_entropy(copy.deepcopy(model), *batch).backward()

    shutil.copy(BLOCKS, tmp_path / "fit_blocks.py")
    config = tmp_path / "pipeline.toml"
    config.write_text(PIPELINE.format(limit=limit, batch=BATCH, side=SIDE, budget=(limit - resident) * 4 // 5,
                                      validate="" if host else "host_reference = false"))
    if not host:                                            # the cell fails at its reference: nothing validated
        with pytest.raises(PipelineFailed, match=r"failed in its reference stage: NoFittingReference: .*nested "
                                                 r"checkpoint: .* set host_reference = true under"):
            run_plan(config)
        return
    outcome, = run_plan(config)
    assert outcome["status"] == "published", outcome["message"]
    assert outcome["reference"] == HOST
    plan = Plan.load(next((tmp_path / "plans").glob("convnet-b16-*.json")))
    assert plan.predicted["peak_bytes"] + plan.predicted["constant_bytes"] <= limit
