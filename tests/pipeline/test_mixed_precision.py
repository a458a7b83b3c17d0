"""Mixed precision through the pipeline's stages: a tiny GPT-2 whose `[[models]]` entry says `autocast`
(bfloat16 or float16) or `dtype` (the same two) is traced, profiled and planned in the dtypes its step runs
in, and its plan validates against eager PyTorch in the same precision: gradients equal, measured peak
equal to the predicted one. The policy form trains under autocast float16 with a GradScaler like eager."""

from __future__ import annotations

import copy

import pytest
import torch

from memplan import runtime
from memplan.runtime.measure.meter import PeakMeter
from memplan.runtime.format.plan import graph_provenance
from memplan.runtime.policy.apply import capture_eager
from memplan.runtime.policy.form import Regions, decisions, policy_schedule
from memplan.tasks.config import ModelConfig, ValidateConfig
from memplan.tasks.models import build_batch, build_loss, build_model
from memplan.tasks.profile.stage import ProfileSettings, measure_graph
from memplan.tasks.solve import solve
from memplan.tasks.solve.core.problem import Problem
from memplan.tasks.solve.core.simulator import default_schedule, simulate
from memplan.tasks.trace import capture_model
from memplan.tasks.validate.stage import step_tolerance

GPT2 = dict(n_layer=2, n_embd=64, n_head=2, vocab_size=128, n_positions=32, bos_token_id=0, eos_token_id=0,
            activation_function="gelu_pytorch_tanh", resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
FAST = ValidateConfig(warmup=0, steps=1, max_steps=1)


def spec(**precision) -> ModelConfig:
    return ModelConfig(name="gpt2-mp", transformers="gpt2", kwargs=GPT2, loss="causal_lm",
                       inputs=[{"shape": [32], "dtype": "int64", "high": 128}], **precision)


def profiled(graph) -> Problem:
    rows = measure_graph(graph, "cpu", ProfileSettings(warmup=0, repeats=1, rounds=1, threads=1), model="mp",
                         progress=False)
    return Problem.from_graph(graph, {r["node_id"]: (r["time_ms"], r["workspace_bytes"])
                                      for r in rows if r["impl"] == "default"})


def float_dtypes(graph) -> set[torch.dtype]:
    return {m.meta["val"].dtype for m in graph.program.gm.graph.nodes
            if isinstance(m.meta.get("val"), torch.Tensor) and m.meta["val"].is_floating_point()}


@pytest.mark.parametrize("precision, low", [({"autocast": "bfloat16"}, torch.bfloat16),
                                            ({"autocast": "float16"}, torch.float16),
                                            ({"dtype": "bfloat16"}, torch.bfloat16),
                                            ({"dtype": "float16"}, torch.float16)])
def test_low_precision_plan_validates_at_its_predicted_peak(precision, low):
    from memplan.tasks.validate.stage import validate_alone

    model = spec(**precision)
    graph = capture_model(model, 4, "cpu", seed=0)
    assert low in float_dtypes(graph)                          # traced (and so profiled) in the step's dtypes
    problem = profiled(graph)
    full = simulate(problem, default_schedule(problem)).peak_bytes
    solution = solve(problem, "dtr", int(0.7 * full))
    assert solution.feasible, solution.message
    plan = solution.to_plan(problem)
    plan.provenance.update(graph_provenance(graph), budget_bytes=int(0.7 * full))
    validated = validate_alone(plan, model, 4, "cpu", 0, FAST, graph=graph)
    assert validated.passed, validated.reasons
    assert validated.max_abs_error == 0                          # same kernels in the same precision
    assert validated.measured_peak_bytes == validated.predicted_peak_bytes < validated.eager_peak_bytes


def test_low_precision_widens_the_tolerance_to_torch_testings():
    settings = ValidateConfig()
    assert step_tolerance(spec(), settings) == (settings.rtol, settings.atol)
    assert step_tolerance(spec(autocast="bfloat16"), settings) == (1.6e-2, 1e-5)
    assert step_tolerance(spec(dtype="float16"), settings) == (1e-3, 1e-5)
    assert step_tolerance(spec(dtype="float16", autocast="bfloat16"), settings) == (1.6e-2, 1e-5)
    assert step_tolerance(spec(autocast="float16"), ValidateConfig(rtol=0.1)) == (0.1, 1e-5)


def test_bfloat16_parameters_and_autocast_batches():
    model = build_model(spec(dtype="bfloat16"), seed=0)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    autocast = spec(autocast="bfloat16")
    loss = build_loss(autocast)(build_model(autocast, 0), *build_batch(autocast, 2, 0))
    assert loss.dtype == torch.float32 and loss.isfinite()       # the LM loss is computed in float32 by autocast


def test_policy_form_under_float16_autocast_with_a_grad_scaler_trains_like_eager():
    model_spec = spec(autocast="float16")
    model, loss_fn, batch = build_model(model_spec, 0), build_loss(model_spec), build_batch(model_spec, 4, 0)
    model.config.use_cache, model.config._attn_implementation = False, "eager"
    graph = capture_eager(model, loss_fn, batch)
    assert torch.float16 in float_dtypes(graph)
    problem = Problem.from_graph(graph)
    regions = Regions.of_graph(graph)
    budget = simulate(problem, policy_schedule(regions, {r: frozenset() for r in regions.members})).peak_bytes
    plan = solve(problem, "selective-policy", budget).to_plan(problem)
    plan.provenance.update(graph_provenance(graph))
    assert decisions(regions, plan.schedule)                                  # something is recomputed

    def train(m):
        optimizer, scaler = torch.optim.AdamW(m.parameters(), lr=1e-2), torch.amp.GradScaler("cpu")
        peaks = []
        for _ in range(3):
            optimizer.zero_grad(set_to_none=True)
            with PeakMeter("cpu", allocator=True) as meter:
                scaler.scale(loss_fn(m, *batch)).backward()
            peaks.append(meter.peak_bytes)
            scaler.step(optimizer)
            scaler.update()
        return {k: p.detach().clone() for k, p in m.named_parameters()}, peaks[-1], scaler.get_scale()

    eager, eager_peak, eager_scale = train(copy.deepcopy(model))
    planned, peak, scale = train(runtime.apply(plan, copy.deepcopy(model), loss_fn, batch, graph=graph))
    assert scale == eager_scale
    for k in eager:
        torch.testing.assert_close(planned[k], eager[k], rtol=0, atol=0, msg=lambda m: f"parameter {k}: {m}")
    assert peak < eager_peak
