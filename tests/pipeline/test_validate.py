"""Validation logic: tensor comparison and the peak check (running plans is covered by the flow tests)."""

from __future__ import annotations

import pytest
import torch

from memplan.tasks.validate.reference import step_state
from memplan.tasks.validate.stage import compare_tensors, peak_problem


def test_equal_tensors_pass_and_are_counted():
    a = {"loss": torch.tensor(1.5), "grad:w": torch.ones(3, 3), "buffer:steps": torch.tensor(4)}
    problems, worst, compared = compare_tensors(a, {k: v.clone() for k, v in a.items()}, rtol=0, atol=0)
    assert (problems, worst, compared) == ([], 0.0, 3)


def test_tolerance_is_atol_plus_rtol_times_eager():
    want = {"grad:w": torch.tensor([100.0, 1.0])}
    inside = {"grad:w": torch.tensor([100.0 + 0.0105, 1.0])}     # |diff| <= 1e-3 + 1e-4 * 100
    outside = {"grad:w": torch.tensor([100.0, 1.0 + 0.0012])}    # |diff| >  1e-3 + 1e-4 * 1
    assert compare_tensors(want, inside, rtol=1e-4, atol=1e-3)[0] == []
    problems, worst, _ = compare_tensors(want, outside, rtol=1e-4, atol=1e-3)
    assert problems == ["grad:w differs from eager by up to 0.0012 (rtol 0.0001, atol 0.001)"]
    assert abs(worst - 0.0012) < 1e-6


def test_missing_extra_and_misshapen_tensors_are_reported():
    want = {"grad:a": torch.zeros(2), "grad:b": None, "grad:c": torch.zeros(2), "grad:d": torch.zeros(2)}
    got = {"grad:a": None, "grad:b": torch.zeros(2), "grad:c": torch.zeros(3), "grad:d": torch.zeros(2, dtype=torch.float64)}
    problems, _, compared = compare_tensors(want, got, rtol=1, atol=1)
    assert compared == 0
    assert problems == [
        "grad:a is missing in the plan's step",
        "grad:b is unexpected in the plan's step",
        "grad:c has shape (3,) torch.float32, eager (2,) torch.float32",
        "grad:d has shape (2,) torch.float64, eager (2,) torch.float32",
    ]


def test_integer_tensors_must_match_exactly():
    problems, _, _ = compare_tensors({"buffer:n": torch.tensor(3)}, {"buffer:n": torch.tensor(4)}, rtol=1, atol=1)
    assert problems == ["buffer:n differs from eager"]


def test_peak_check_allows_the_stated_slack_only():
    assert peak_problem(1050, 1000, 0.05) is None
    assert peak_problem(1051, 1000, 0.05) == "measured peak 1,051 B exceeds the budget 1,000 B by 5.1% (allowed 5.0%)"
    assert peak_problem(1000, 1000, 0.0) is None


def test_step_state_holds_loss_gradients_and_buffers():
    model = torch.nn.BatchNorm1d(3)
    x = torch.randn(4, 3)
    loss = model(x).pow(2).sum()
    loss.backward()
    state = step_state(model, loss)
    assert set(state) == {"loss", "grad:weight", "grad:bias", "buffer:running_mean", "buffer:running_var",
                          "buffer:num_batches_tracked"}
    assert torch.equal(state["grad:bias"], model.bias.grad) and state["grad:bias"] is not model.bias.grad
    assert int(state["buffer:num_batches_tracked"]) == 1


def test_a_plan_with_addresses_is_validated_in_arena_mode_too(tmp_path):
    """Arena mode runs on its own copy of the model, compared with eager before any timed step moves its
    BatchNorm statistics; it reports its peak (the allocator's: its kernels' scratch included, which the
    graph's profile prices as workspace) and places every copy of the in-place nodes."""
    import numpy as np

    from memplan import runtime
    from memplan.runtime.execute.arena import in_place_nodes
    from memplan.runtime.format.plan import Plan
    from memplan.tasks.config import ModelConfig, ValidateConfig
    from memplan.tasks.models import build_batch, build_loss, build_model
    from memplan.tasks.solve.core.addresses import greedy_addresses
    from memplan.tasks.solve.core.problem import Problem
    from memplan.tasks.profile.stage import ProfileSettings, profile_graph
    from memplan.tasks.solve.core.simulator import default_schedule, simulate
    from memplan.tasks.validate.reference import measure_reference
    from memplan.tasks.store.query import load_costs
    from memplan.tasks.validate.stage import validate_plan

    spec = ModelConfig(name="r18", torchvision="resnet18", kwargs={"num_classes": 4},
                       inputs=[{"shape": [3, 32, 32]}, {"shape": [], "dtype": "int64", "high": 4}])
    graph = runtime.capture(build_model(spec, 0), build_loss(spec), build_batch(spec, 2, 0, "cpu"))
    profile_graph(graph, "cpu", ProfileSettings(warmup=0, repeats=1, rounds=1), root=tmp_path, progress=False)
    problem = Problem.from_graph(graph, load_costs(graph.fingerprint, "cpu", tmp_path))
    schedule = default_schedule(problem)
    nodes = in_place_nodes(graph, "cpu")
    addresses = greedy_addresses(problem, simulate(problem, schedule), np.array([n in nodes for _, n in schedule]))
    plan = Plan(graph.fingerprint, schedule, addresses, provenance={"budget_bytes": 10**9})
    reference = measure_reference(spec, 2, "cpu", 0, tmp_path / "reference.safetensors")
    validation = validate_plan(plan, spec, 2, "cpu", 0, ValidateConfig(steps=2, max_steps=2, warmup=1), reference)
    assert validation.passed, validation.reasons
    assert validation.arena_bytes_not_placed == 0 and validation.arena_step_ms > 0
    assert validation.arena_peak_bytes == simulate(problem, schedule, addresses).arena_peak_bytes


def test_a_tensor_only_the_plan_produces_is_reported():
    loss = torch.tensor(1.0)
    problems, _, compared = compare_tensors({"loss": loss}, {"loss": loss, "grad:new": torch.zeros(2)}, rtol=0, atol=0)
    assert problems == ["grad:new is unexpected in the plan's step"] and compared == 1


def test_the_largest_difference_is_measured_in_float64():
    """float32 would round 1 - 1e-8 to 1; the reported error is the exact difference of the two values."""
    tiny = torch.tensor([1e-8])
    _, worst, _ = compare_tensors({"g": torch.tensor([1.0])}, {"g": tiny}, rtol=0, atol=0)
    assert worst == 1.0 - float(tiny) < 1.0


def test_step_state_is_a_detached_copy():
    model = torch.nn.BatchNorm1d(3)
    model.bias.requires_grad_(False)
    loss = model(torch.randn(4, 3)).pow(2).sum()
    loss.backward()
    state = step_state(model, loss)
    assert state["grad:bias"] is None and not state["loss"].requires_grad
    mean = state["buffer:running_mean"].clone()
    model.running_mean.add_(1.0)
    model.weight.grad.add_(1.0)
    assert torch.equal(state["buffer:running_mean"], mean) and not torch.equal(state["grad:weight"], model.weight.grad)


def test_median_interval_is_the_binomial_order_statistic_interval():
    """Coverage of [x_(k), x_(n+1-k)] is P(k <= #samples below the median <= n - k), computed here by brute
    force over all 2^n patterns of samples below or above the median (each with probability 1/2): the chosen
    k is the largest whose coverage reaches 95%, and a sample whose whole range falls short gives None."""
    from itertools import product

    from memplan.tasks.validate.step_timing import median_interval

    def coverage(n: int, rank: int) -> float:
        return sum(rank <= sum(p) <= n - rank for p in product((0, 1), repeat=n)) / 2**n

    for n in range(1, 15):
        samples = [float(10 * i) for i in range(n)][::-1]          # unsorted on purpose
        interval = median_interval(samples)
        if coverage(n, 1) < 0.95:
            assert interval is None, n
            continue
        k = int(interval[0] / 10) + 1
        assert interval[1] == 10 * (n - k)
        assert coverage(n, k) >= 0.95 and coverage(n, k + 1) < 0.95, (n, k)
    assert median_interval([3.0] * 10) == (3.0, 3.0)
    assert median_interval([1.0, 2.0, 3.0, 4.0, 5.0]) is None and median_interval([]) is None


class _FakeClock:
    """A clock that each step advances by its next duration (seconds)."""

    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def step(self, durations):
        it = iter(durations)

        def run():
            self.now += next(it)
        return run


def test_timing_stops_at_steps_on_a_quiet_host_and_goes_on_to_max_steps_on_a_noisy_one():
    from torch import nn

    from memplan.tasks.validate.step_timing import paired_step_times

    model = nn.Linear(1, 1)
    clock = _FakeClock()
    quiet = [(model, clock.step([0.1] * 100)), (model, clock.step([0.11] * 100))]
    times = paired_step_times(quiet, "cpu", warmup=1, steps=8, max_steps=30, precision=0.02, clock=clock)
    assert [len(t) for t in times] == [8, 8]
    assert times[1] == [pytest.approx(110.0)] * 8
    times = paired_step_times(quiet, "cpu", warmup=0, steps=2, max_steps=30, precision=0.02, clock=clock)
    assert [len(t) for t in times] == [6, 6]          # the first round count with a 95% interval of the median

    clock = _FakeClock()
    plan = [0.11 if i % 2 else 0.16 for i in range(100)]          # ratios 1.1 and 1.6 by turns
    noisy = [(model, clock.step([0.1] * 100)), (model, clock.step(plan))]
    times = paired_step_times(noisy, "cpu", warmup=2, steps=5, max_steps=30, precision=0.02, clock=clock)
    assert [len(t) for t in times] == [30, 30]
    assert times[1][:2] == [pytest.approx(160.0), pytest.approx(110.0)]   # the 2 warm-up rounds are not timed

    clock = _FakeClock()
    settling = [0.2, 0.11, 0.2, 0.11] + [0.11] * 96              # two slow rounds, then quiet
    times = paired_step_times([(model, clock.step([0.1] * 100)), (model, clock.step(settling))], "cpu",
                              warmup=0, steps=5, max_steps=30, precision=0.02, clock=clock)
    assert 5 < len(times[0]) < 30 and len(times[0]) == len(times[1])


def test_a_plan_recomputing_dropout_is_validated_bit_for_bit(tmp_path):
    """A transformers model keeps its default dropout (0.1): validation seeds the eager step and the plan's
    alike, and a plan that recomputes dropout outputs (from their kept masks) or masks (replaying the
    generator) reproduces eager's loss and gradients exactly."""
    from memplan import runtime
    from memplan.runtime.format.plan import Plan
    from memplan.tasks.config import ModelConfig, ValidateConfig
    from memplan.tasks.models import build_batch, build_loss, build_model
    from memplan.tasks.profile.stage import ProfileSettings, profile_graph
    from memplan.tasks.solve import solve
    from memplan.tasks.solve.core.problem import Problem
    from memplan.tasks.solve.core.simulator import default_schedule, simulate
    from memplan.tasks.solve.core.solution import SolveOptions
    from memplan.tasks.validate.reference import measure_reference
    from memplan.tasks.store.query import load_costs
    from memplan.tasks.validate.stage import validate_plan

    spec = ModelConfig(name="gpt2-dropout", transformers="gpt2", loss="causal_lm",
                       kwargs={"n_layer": 2, "n_embd": 32, "n_head": 2, "vocab_size": 50, "n_positions": 16,
                               "bos_token_id": 0, "eos_token_id": 0, "attn_implementation": "eager"},
                       inputs=[{"shape": [16], "dtype": "int64", "high": 50}])
    graph = runtime.capture(build_model(spec, 0), build_loss(spec), build_batch(spec, 2, 0, "cpu"))
    draws = {n.id for n in graph.nodes if n.targets[0] == "memplan.dropout_mask.default"}
    products = {n.id for n in graph.nodes if n.targets[0] == "memplan.dropout_apply.default"}
    profile_graph(graph, "cpu", ProfileSettings(warmup=0, repeats=1, rounds=1), root=tmp_path, progress=False)
    problem = Problem.from_graph(graph, load_costs(graph.fingerprint, "cpu", tmp_path))
    budget = int(0.9 * simulate(problem, default_schedule(problem)).peak_bytes)
    plan = solve(problem, "ap-greedy", budget, SolveOptions(portfolio=False)).to_plan(problem)
    recomputed = {n for n in plan.compute_steps() if plan.compute_steps().count(n) > 1}
    assert recomputed & draws and recomputed & products
    settings = ValidateConfig(steps=2, max_steps=2, warmup=1)
    reference = measure_reference(spec, 2, "cpu", 0, tmp_path / "reference.safetensors")
    validation = validate_plan(Plan.load(plan.to_json()), spec, 2, "cpu", 0, settings, reference)
    assert validation.passed, validation.reasons
    assert validation.max_abs_error == 0.0 and validation.tensors_compared > 10


@pytest.mark.parametrize("optimizer", ["sgd-momentum", "adamw"])
def test_a_plan_with_the_optimizer_inside_the_step_is_solved_and_validated_on_parameters(optimizer, tmp_path):
    """The solve stage with the plan setting `optimizer` plans the gradients' early deaths (with SGD, a lower predicted
    peak than the same cell without it; AdamW's update scratch can outweigh them on so small a model) and records
    the optimizer; validation then runs eager loss.backward();
    opt.step() beside runtime.load(..., optimizer=opt), compares the parameters after the step (the gradients
    are freed in the step) and finds the measured peak within the budget: the prediction, within 0.1%. GPT-2 ties its token embedding and
    output weights: the graph has a gradient per name, summed for one update after the last of them."""
    from memplan import runtime
    from memplan.runtime.format.plan import Plan
    from memplan.tasks.config import Budget, ModelConfig, PlanSettings, ValidateConfig
    from memplan.tasks.models import build_batch, build_loss, build_model
    from memplan.tasks.profile.stage import ProfileSettings, profile_graph
    from memplan.tasks.solve_stage import solve_case
    from memplan.tasks.validate.stage import validate_alone

    spec = ModelConfig(name="gpt2-tiny", transformers="gpt2", loss="causal_lm",
                       kwargs={"n_layer": 2, "n_embd": 32, "n_head": 2, "vocab_size": 50, "n_positions": 16,
                               "bos_token_id": 0, "eos_token_id": 0, "resid_pdrop": 0.0, "embd_pdrop": 0.0,
                               "attn_pdrop": 0.0},
                       inputs=[{"shape": [16], "dtype": "int64", "high": 50}])
    model = build_model(spec, 0)
    graph = runtime.capture(model, build_loss(spec), build_batch(spec, 2, 0, "cpu"))
    graph.save(tmp_path / "graph.json")
    profile_graph(graph, "cpu", ProfileSettings(warmup=0, repeats=1, rounds=1), root=tmp_path, progress=False)
    cells = {name: solve_case(tmp_path / "graph.json", "ap-greedy", Budget(max_overhead=0.25),
                              PlanSettings(optimizer=name), "cpu", str(tmp_path), str(tmp_path / f"{name}.json"))
             for name in ("none", optimizer)}
    if optimizer == "sgd-momentum":            # no update scratch: the gradients' early deaths only save memory
        assert cells[optimizer].predicted_peak_bytes < cells["none"].predicted_peak_bytes
    plan = Plan.load(tmp_path / f"{optimizer}.json")
    assert plan.provenance["optimizer_in_step"] == optimizer and "optimizer_in_step" not in \
        Plan.load(tmp_path / "none.json").provenance
    assert plan.predicted["optimizer_state_bytes"] == (1 if optimizer == "sgd-momentum" else 2) * sum(
        p.numel() * 4 for p in model.parameters())
    validation = validate_alone(plan, spec, 2, "cpu", 0, ValidateConfig(steps=2, max_steps=2), graph=graph)
    assert validation.passed, validation.reasons
    parameters = len(list(model.parameters()))
    assert validation.tensors_compared >= 1 + parameters                       # the loss and every parameter
    # the allocator also sees kernels' few-byte scalars, which the memory model leaves out
    assert abs(validation.measured_peak_bytes / plan.predicted["peak_bytes"] - 1) <= 0.001
    assert plan.predicted["peak_bytes"] < validation.eager_peak_bytes
