"""`memplan fit`: the batch search on exact small cases, its clear errors, and the whole command on a tiny
model of repeated blocks under a limit that eager PyTorch fits at some batch B: memplan answers more than
B, validated, and its plan runs with `runtime.load` under the enforced limit."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from memplan.flows.cli import app
from memplan.runtime.measure.meter import PeakMeter
from memplan.tasks.fit.search import FitError, SizePoint, largest_fitting, search_fit

runner = CliRunner(env={"COLUMNS": "250"})
BLOCKS = Path(__file__).with_name("fit_blocks.py")
WIDTH, DEPTH = 16, 4

PIPELINE = '''
device = "cpu"
{limit}

[[models]]
name = "blocks"
factory = "fit_blocks:blocks"
kwargs = {{ width = {width}, depth = {depth} }}
loss = "mse"
inputs = [{{ shape = [{width}] }}, {{ shape = [{width}] }}]

[profile]
warmup = 0
repeats = 1

[[plans]]
solver = "dtr"
max_overhead = 0.1

[validate]
steps = 1
max_steps = 1
warmup = 0
'''


@pytest.mark.parametrize("largest, cap", [(0, 64), (1, 64), (5, 64), (37, 64), (64, 64), (100, 64), (3, 3)])
def test_largest_fitting_finds_the_threshold(largest, cap):
    tried = []

    def fits(batch):
        tried.append(batch)
        return batch <= largest

    assert largest_fitting(fits, cap) == min(largest, cap)
    assert max(tried) <= cap and len(tried) <= 2 * cap.bit_length() + 1


def fake_point(batch: int) -> SizePoint:
    """Resident 100 B; per sample eager 10 B, per-block checkpoint 6 B, memplan 4 B."""
    return SizePoint(size=batch, batch_size=batch, resident_bytes=100, eager_peak_bytes=10 * batch, checkpoint_peak_bytes=6 * batch,
                      memplan_peak_bytes=4 * batch, memplan_overhead=0.05, plan_path=f"b{batch}.json")


def test_search_gives_each_schedule_its_largest_batch(config_data):
    from memplan.tasks.config import parse_config
    from memplan.tasks.fit.memory_limit import MemoryLimit

    config = parse_config(config_data, solvers=["checkmate", "chen-sqrt-n"])
    lines: list[str] = []
    search = search_fit(config.models[1], config, "cpu", MemoryLimit(limit_bytes=1000), "dtr", 0.1, 4096, evaluate=fake_point,
                        report=lines.append)
    assert (search.eager_largest, search.checkpoint_largest, search.memplan_largest) == (90, 150, 225)
    assert [p.size for p in search.points] == sorted(p.size for p in search.points)
    assert len(lines) == len(search.points)                          # a progress line per size evaluated
    at_225 = next(line for line in lines if line.startswith("batch 225:"))
    assert "eager 0.0 MiB (over)" in at_225 and "memplan 0.0 MiB (fits)" in at_225     # 1,100 and 1,000 B of 1,000


def test_a_limit_below_batch_1_says_what_takes_the_memory(config_data):
    from memplan.tasks.config import parse_config
    from memplan.tasks.fit.memory_limit import MemoryLimit

    config = parse_config(config_data, solvers=["checkmate", "chen-sqrt-n"])
    with pytest.raises(FitError, match=r"'mlp' does not fit device_memory = 103 B even at batch 1: .* take 100 B and "
                                       r"the step at least 4 B more"):
        search_fit(config.models[1], config, "cpu", MemoryLimit(limit_bytes=103), "dtr", 0.1, 4096, evaluate=fake_point)


@pytest.mark.parametrize("arguments, message", [
    (["--model", "gpt3"], "unknown model 'gpt3'; the pipeline file declares blocks"),
    (["--max-overhead", "-0.5"], "--max-overhead -0.5 is not in [0, 10]"),
    (["--max-overhead", "1e9"], "is not in [0, 10]"),
    (["--max-size", "0"], "--max-size 0 is not in [1, 1,048,576]"),
    (["--sequence"], "model 'blocks' declares no sequence input"),
    (["--batch", "8"], "--batch applies to a sequence search (--sequence)"),
    (["--device-memory", "-5"], "--device-memory: -5 is not a size"),
    (["--device-memory", "lots"], "--device-memory: 'lots' is not a size"),
    (["--device-memory", "device"], "reads the GPU's free memory"),
    (["--solver", "nope"], "unknown solver 'nope'"),
    ([], "memplan fit needs a device memory limit: set device_memory"),
])
def test_bad_input_gets_a_clear_error_before_any_work(tmp_path, arguments, message):
    shutil.copy(BLOCKS, tmp_path / "fit_blocks.py")
    config = tmp_path / "pipeline.toml"
    config.write_text(PIPELINE.format(limit="", width=WIDTH, depth=DEPTH))
    if arguments and arguments[0] != "--device-memory":
        arguments = [*arguments, "--device-memory", "1 MiB"]
    result = runner.invoke(app, ["fit", str(config), *arguments])
    assert result.exit_code == 1
    assert message in " ".join(result.output.split()), result.output
    assert "Traceback" not in result.output
    assert not (tmp_path / ".cache").exists()


def test_a_limit_too_small_for_batch_1_is_explained(tmp_path, harness):
    shutil.copy(BLOCKS, tmp_path / "fit_blocks.py")
    config = tmp_path / "pipeline.toml"
    config.write_text(PIPELINE.format(limit='device_memory = "40 KiB"', width=WIDTH, depth=DEPTH))
    result = runner.invoke(app, ["fit", str(config), "--max-size", "4"])
    assert result.exit_code == 1
    assert "does not fit device_memory = 40,960 B even at batch 1" in " ".join(result.output.split())


def test_memplan_fits_a_larger_batch_than_eager_and_its_plan_runs_under_the_limit(tmp_path, harness):
    import torch.nn.functional as F

    import memplan
    from memplan import runtime
    from memplan.flows.fit import markdown_fit
    from memplan.runtime.measure.meter import PeakMeter
    from tests.pipeline.fit_blocks import blocks

    def loss_fn(model, x, y):
        return F.mse_loss(model(x), y)

    eager_fits = 64                                                # a limit eager PyTorch fits at batch 64
    model = blocks(WIDTH, DEPTH)
    params = sum(p.numel() * 4 for p in model.parameters())
    x, y = torch.randn(eager_fits, WIDTH), torch.randn(eager_fits, WIDTH)
    with PeakMeter("cpu") as meter:
        loss_fn(model, x, y).backward()
    limit = meter.peak_bytes + params + x.numel() * 4 + y.numel() * 4
    shutil.copy(BLOCKS, tmp_path / "fit_blocks.py")
    config = tmp_path / "pipeline.toml"
    config.write_text(PIPELINE.format(limit=f"device_memory = {limit}", width=WIDTH, depth=DEPTH))

    answer = memplan.fit(config, max_overhead=10.0, max_size=256)       # `memplan fit` as a call
    search = answer.search
    assert answer.validated, answer.verdict
    assert eager_fits - 2 <= search.eager_largest < search.memplan_largest       # the simulator predicts eager's peak
    point = search.point(search.memplan_largest)
    assert point.total(point.memplan_peak_bytes) <= limit
    assert Path(answer.plot).is_file() and Path(answer.plot).read_bytes().startswith(b"\x89PNG")
    markdown = markdown_fit(answer)
    assert f"eager {search.eager_largest}, per-block checkpoint {search.checkpoint_largest}" in markdown
    assert f"| {search.memplan_largest} |" in markdown and "validated against" in markdown
    validation = answer.validation                  # timed beside the answer's no-recomputation plan
    assert validation.overhead_vs_no_recompute is not None and Path(point.no_recompute_path).is_file()
    assert answer.plan_path in {c.plan_path for c in point.candidates}
    assert "overhead against no recomputation: within the limit" in markdown          # +1000%: never over

    model = blocks(WIDTH, DEPTH)
    batch = (torch.randn(search.memplan_largest, WIDTH), torch.randn(search.memplan_largest, WIDTH))
    step = runtime.load(answer.plan_path, model, loss_fn)
    step(*batch)                                                   # the first call captures the model
    model.zero_grad(set_to_none=True)
    with PeakMeter("cpu", limit_bytes=limit, resident_bytes=params + sum(t.numel() * 4 for t in batch)):
        step(*batch)
    assert all(p.grad is not None for p in model.parameters())


SEQUENCE_PIPELINE = '''
device = "cpu"
device_memory = {limit}

[[models]]
name = "tokens"
factory = "fit_blocks:token_blocks"
loss = "sum"
batch_sizes = [2]
inputs = [{{ shape = [8], dtype = "int64", high = 64 }}]

[profile]
warmup = 0
repeats = 1

[[plans]]
solver = "dtr"
max_overhead = 0.1

[validate]
steps = 1
max_steps = 1
warmup = 0
'''


def test_the_sequence_search_varies_the_token_inputs_length_at_the_batch(tmp_path, harness):
    from memplan.flows.fit import run_fit
    from memplan.runtime.format.plan import Plan
    from tests.pipeline.fit_blocks import token_blocks

    eager_fits, batch = 32, 2                                      # a limit eager fits at 32 tokens
    model = token_blocks()
    tokens = torch.randint(0, 64, (batch, eager_fits))
    with PeakMeter("cpu") as meter:
        model(tokens).sum().backward()
    limit = meter.peak_bytes + sum(p.numel() * 4 for p in model.parameters()) + tokens.numel() * 8
    shutil.copy(BLOCKS, tmp_path / "fit_blocks.py")
    config = tmp_path / "pipeline.toml"
    config.write_text(SEQUENCE_PIPELINE.format(limit=limit))

    answer = run_fit(config, max_overhead=10.0, max_size=128, dimension="sequence")
    search = answer.search
    assert answer.validated, answer.verdict
    assert (search.dimension, search.batch_size) == ("sequence", batch)
    assert eager_fits - 2 <= search.eager_largest < search.memplan_largest
    point = search.point(search.memplan_largest)
    assert point.batch_size == batch and point.total(point.memplan_peak_bytes) <= limit
    assert Path(point.plan_path).name.startswith(f"tokens-b{batch}-s{search.memplan_largest}-dtr-")
    assert Plan.load(point.plan_path).provenance["batch"][0]["shape"] == [batch, search.memplan_largest]
