"""The device memory limit (`device_memory`): its config errors, the CPU meter refusing a step past it, and a
step that eager PyTorch cannot fit being planned, validated against a reference that fits (per-block
checkpointing) and published by the `plan` flow."""

from __future__ import annotations

import copy
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from memplan.runtime.measure.meter import DeviceMemoryExceeded, PeakMeter
from memplan.tasks.config import ConfigError, parse_config
from memplan.tasks.fit.memory_limit import MemoryLimit, memory_limit

BLOCKS = Path(__file__).with_name("fit_blocks.py")
BATCH, WIDTH = 256, 32

PIPELINE = '''
device = "cpu"
device_memory = {limit}

[[models]]
name = "blocks"
factory = "fit_blocks:blocks"
loss = "mse"
batch_sizes = [{batch}]
inputs = [{{ shape = [{width}] }}, {{ shape = [{width}] }}]

[profile]
warmup = 0
repeats = 1

[[plans]]
solver = "dtr"
max_overhead = 1.0

[validate]
steps = 1
max_steps = 1
warmup = 0
'''


def mse(model, x, y):
    return F.mse_loss(model(x), y)


def blocks_and_batch():
    from tests.pipeline.fit_blocks import blocks

    torch.manual_seed(0)
    return blocks(WIDTH), (torch.randn(BATCH, WIDTH), torch.randn(BATCH, WIDTH))


def eager_total_bytes(model, batch, limit: MemoryLimit) -> int:
    """The eager step's measured peak plus the resident bytes under `limit`'s optimizer."""
    model = copy.deepcopy(model)
    with PeakMeter("cpu") as meter:
        mse(model, *batch).backward()
    return meter.peak_bytes + limit.module_resident_bytes(model, batch)


def config_with(**keys):
    data = {"models": [{"name": "m", "factory": "torch.nn:Linear", "kwargs": {"in_features": 4, "out_features": 3},
                        "loss": "mse", "inputs": [{"shape": [4]}, {"shape": [3]}]}],
            "plans": [{"solver": "checkpoint-all", "budgets": [1.0]}]}
    return parse_config(data | keys)


def test_device_memory_takes_sizes_and_device():
    assert config_with(device_memory="16 GiB").device_memory == 16 * 2**30
    assert config_with(device_memory=2**20).device_memory == 2**20
    assert config_with(device="cpu", device_memory=1000).device_memory == 1000      # on CPU: any size
    assert config_with(device_memory="device").device_memory == "device"
    assert config_with().device_memory is None


@pytest.mark.parametrize("value", [-5, 0, "60%", 0.5, "lots", True, "1e30 GiB"])
def test_bad_device_memory_names_the_key_and_the_fix(value):
    with pytest.raises(ConfigError, match=r"key device_memory = .*'16 GiB'.*\"device\""):
        config_with(device_memory=value)


def test_unknown_optimizer_lists_the_known_ones():
    with pytest.raises(ConfigError, match=r"key optimizer = 'lion'.*'sgd', 'sgd-momentum', 'adam' or 'adamw'"):
        config_with(optimizer="lion")


def test_device_memory_from_the_gpu_is_refused_on_cpu():
    with pytest.raises(Exception, match=r"device_memory = \"device\".*cpu.*\"16 GiB\""):
        memory_limit(config_with(device_memory="device"), "cpu")


def test_optimizer_state_counts_per_parameter():
    model, batch = blocks_and_batch()
    params = sum(p.numel() * 4 for p in model.parameters())
    inputs = sum(t.numel() * 4 for t in batch)
    for optimizer, states in [("sgd", 0), ("sgd-momentum", 1), ("adamw", 2)]:
        limit = MemoryLimit(limit_bytes=1, optimizer=optimizer)
        assert limit.module_resident_bytes(model, batch) == (1 + states) * params + inputs


def test_the_meter_refuses_a_step_past_the_limit_and_allows_one_within():
    model, batch = blocks_and_batch()
    limit = MemoryLimit(limit_bytes=10**12, optimizer="adamw")
    total = eager_total_bytes(model, batch, limit)
    resident = limit.module_resident_bytes(model, batch)
    refused, allowed = copy.deepcopy(model), copy.deepcopy(model)
    with pytest.raises(torch.OutOfMemoryError, match=r"exceed the device memory limit"):
        with PeakMeter("cpu", limit_bytes=total - 1, resident_bytes=resident):
            mse(refused, *batch).backward()
    with PeakMeter("cpu", limit_bytes=total, resident_bytes=resident) as meter:
        mse(allowed, *batch).backward()
    assert meter.peak_bytes + resident == total
    with pytest.raises(DeviceMemoryExceeded, match="before the step"):
        PeakMeter("cpu", limit_bytes=resident - 1, resident_bytes=resident)


def test_a_limit_below_the_resident_bytes_is_refused_before_any_stage(tmp_path):
    """Parameters, buffers, batch and optimizer state alone exceed the limit: no plan can fit, and the run says so
    with the bytes before it traces anything (the models are built on the meta device)."""
    from memplan.flows.plan import run_plan
    from memplan.tasks.config import MemplanError

    (tmp_path / "pipeline.toml").write_text(
        'device = "cpu"\ndevice_memory = "50 KiB"\noptimizer = "adamw"\ncache_dir = "cache"\n\n[[models]]\nname = "wide"\n'
        'factory = "torch.nn:Linear"\nkwargs = { in_features = 256, out_features = 256 }\nloss = "mse"\n'
        'batch_sizes = [8]\ninputs = [{ shape = [256] }, { shape = [256] }]\n\n[[plans]]\nsolver = "dtr"\n'
        'budgets = [0.8]\n')
    resident = 3 * (256 * 256 + 256) * 4 + 2 * 8 * 256 * 4                  # weights, two AdamW states, batch
    with pytest.raises(MemplanError, match=rf"device_memory = 51,200 B is less than model 'wide' at batch 8 keeps "
                                           rf"resident .*: {resident:,} B .*adamw, 2 tensors per parameter"):
        run_plan(tmp_path / "pipeline.toml")
    assert not (tmp_path / "cache").exists()


def test_a_step_eager_cannot_fit_is_planned_validated_against_checkpointing_and_published(tmp_path, harness):
    from memplan.flows.plan import run_plan
    from memplan.runtime.format.plan import Plan
    from memplan.tasks.fit.reference import PER_BLOCK_CHECKPOINT

    model, batch = blocks_and_batch()
    unlimited = MemoryLimit(limit_bytes=10**12)
    limit = eager_total_bytes(model, batch, unlimited) * 2 // 3            # eager needs 1.5x the limit
    eager = copy.deepcopy(model)
    with pytest.raises(DeviceMemoryExceeded):                               # eager itself is refused
        with PeakMeter("cpu", limit_bytes=limit, resident_bytes=unlimited.module_resident_bytes(model, batch)):
            mse(eager, *batch).backward()

    shutil.copy(BLOCKS, tmp_path / "fit_blocks.py")
    config = tmp_path / "pipeline.toml"
    config.write_text(PIPELINE.format(limit=limit, batch=BATCH, width=WIDTH))
    outcome, = run_plan(config)
    assert outcome["status"] == "published", outcome["message"]
    assert outcome["reference"] == PER_BLOCK_CHECKPOINT
    plan = Plan.load(next((tmp_path / "plans").glob("blocks-b256-*.json")))
    assert plan.predicted["peak_bytes"] + plan.predicted["constant_bytes"] <= limit


def test_per_block_checkpointing_gives_eager_gradients_and_batchnorm_buffers_bit_for_bit():
    from torch import nn

    from memplan.tasks.fit.reference import checkpoint_blocks, training_step

    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Tanh()) for _ in range(3)])
    batch = (torch.randn(16, 8), torch.randn(16, 8))
    eager, checkpointed = copy.deepcopy(model), copy.deepcopy(model)
    checkpoint_blocks(checkpointed)
    assert torch.equal(training_step(eager, mse, batch)(), training_step(checkpointed, mse, batch, keep_buffers=True)())
    for (name, a), b in zip(eager.named_parameters(), checkpointed.parameters()):
        assert torch.equal(a.grad, b.grad), name
    for (name, a), b in zip(eager.named_buffers(), checkpointed.buffers()):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_micro_batches_give_the_full_batch_gradient_within_their_tolerance(reduction):
    from memplan.tasks.fit.reference import MICRO_BATCH_ATOL, MICRO_BATCH_RTOL, training_step

    def loss_fn(model, x, y):
        return F.mse_loss(model(x), y, reduction=reduction)

    model, batch = blocks_and_batch()
    whole, parts = copy.deepcopy(model), copy.deepcopy(model)
    assert torch.allclose(training_step(whole, loss_fn, batch)(), training_step(parts, loss_fn, batch, 3, reduction)(),
                          rtol=MICRO_BATCH_RTOL, atol=MICRO_BATCH_ATOL)
    for (name, a), b in zip(whole.named_parameters(), parts.parameters()):
        assert torch.allclose(a.grad, b.grad, rtol=MICRO_BATCH_RTOL, atol=MICRO_BATCH_ATOL), name


def test_the_reference_is_the_first_step_that_fits():
    from torch import nn

    from memplan.tasks.fit.reference import EAGER, NoFittingReference, PER_BLOCK_CHECKPOINT, checkpoint_blocks, \
        reference_step, training_step

    model, batch = blocks_and_batch()
    unlimited = MemoryLimit(limit_bytes=10**12)
    eager_total = eager_total_bytes(model, batch, unlimited)

    def kind(limit: int, reduction: str | None = "mean", of=model) -> str:
        return reference_step(of, mse, batch, "cpu", MemoryLimit(limit_bytes=limit, host_reference=False), 0,
                              reduction).kind

    assert kind(eager_total) == EAGER
    assert kind(eager_total - 1) == PER_BLOCK_CHECKPOINT
    checkpointed = copy.deepcopy(model)
    checkpoint_blocks(checkpointed)
    step = training_step(checkpointed, mse, batch, keep_buffers=True)
    with PeakMeter("cpu") as meter:
        step()
    tight = unlimited.module_resident_bytes(model, batch) + meter.peak_bytes - 1   # per-block checkpointing misses
    assert kind(tight).endswith("micro-batches (per-block checkpoint)")
    with pytest.raises(NoFittingReference, match="no reference step fits .* eager: .* per-block checkpoint: .* nested "):
        kind(tight, reduction=None)                           # a loss of unknown reduction: no micro-batches
    with_norm = nn.Sequential(*[nn.Sequential(*block, nn.BatchNorm1d(WIDTH)) for block in model])
    with pytest.raises(NoFittingReference):                   # BatchNorm: no micro-batches either
        kind(tight, of=with_norm)


def test_a_plan_past_the_limit_fails_validation_against_a_reference_that_fits():
    from memplan.runtime.format.plan import default_plan
    from memplan.tasks.config import ModelConfig, ValidateConfig
    from memplan.tasks.fit.reference import PER_BLOCK_CHECKPOINT
    from memplan.tasks.trace import capture_model
    from memplan.tasks.validate.stage import validate_alone

    spec = ModelConfig(name="blocks", factory="tests.pipeline.fit_blocks:blocks", kwargs={"width": WIDTH}, loss="mse",
                       inputs=[{"shape": [WIDTH]}, {"shape": [WIDTH]}])
    graph = capture_model(spec, BATCH, "cpu", 0)
    plan = default_plan(graph)                                  # no recomputation: eager's memory
    plan.provenance["budget_bytes"] = 10**12
    model, batch = blocks_and_batch()
    limit = MemoryLimit(limit_bytes=eager_total_bytes(model, batch, MemoryLimit(limit_bytes=1)) * 2 // 3)
    settings = ValidateConfig(steps=1, max_steps=1, warmup=0)
    validation = validate_alone(plan, spec, BATCH, "cpu", 0, settings, graph=graph, limit=limit)
    assert validation.reference == PER_BLOCK_CHECKPOINT and validation.limit_bytes == limit.limit_bytes
    assert not validation.passed
    assert [r for r in validation.reasons if "exceeds the device memory limit" in r], validation.reasons
    assert not [r for r in validation.reasons if "differs" in r], validation.reasons   # same gradients as the reference
