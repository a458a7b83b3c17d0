"""transformers.Trainer with the policy form: a tiny GPT-2 with a plan applied trains under Trainer (which
calls `model(**inputs)`) to the parameters Trainer reaches without the plan, with every checkpointed region
mapped onto the captured ops on each step (dropout on: checkpoint redraws the same masks)."""

from __future__ import annotations

import copy

import torch
import transformers

from memplan import runtime
from memplan.runtime.policy import apply as policy
from memplan.runtime.format.plan import graph_provenance
from memplan.runtime.policy.apply import capture_eager
from memplan.runtime.policy.form import Regions, decisions, policy_schedule
from memplan.tasks.solve import solve
from memplan.tasks.solve.core.problem import Problem
from memplan.tasks.solve.core.simulator import default_schedule, simulate


def loss_fn(model, input_ids, attention_mask, labels):
    return model(input_ids=input_ids, attention_mask=attention_mask, labels=labels).loss


def trained(model, examples, out) -> dict[str, torch.Tensor]:
    args = transformers.TrainingArguments(output_dir=str(out), per_device_train_batch_size=8, max_steps=3,
                                          learning_rate=1e-2, save_strategy="no", report_to=[], use_cpu=True,
                                          disable_tqdm=True, logging_strategy="no")
    transformers.Trainer(model=model, args=args, train_dataset=examples).train()
    return {k: p.detach().clone() for k, p in model.named_parameters()}


def test_policy_model_under_trainer_trains_like_trainer_without_the_plan(tmp_path):
    config = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=128, n_positions=32, bos_token_id=0,
                                     eos_token_id=0, use_cache=False, activation_function="gelu_pytorch_tanh")
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config)
    ids = torch.randint(0, 128, (32, 32))
    examples = [{"input_ids": x, "attention_mask": torch.ones_like(x), "labels": x} for x in ids]
    batch = (ids[:8], torch.ones_like(ids[:8]), ids[:8])
    graph = capture_eager(model, loss_fn, batch)
    problem, regions = Problem.from_graph(graph), Regions.of_graph(graph)
    whole = simulate(problem, policy_schedule(regions, {r: frozenset() for r in regions.members})).peak_bytes
    full = simulate(problem, default_schedule(problem)).peak_bytes
    plan = solve(problem, "selective-policy", (whole + full) // 2).to_plan(problem)     # keeps part of a layer
    plan.provenance.update(graph_provenance(graph))
    assert decisions(Regions.of_graph(graph, plan.provenance.get("split", [])), plan.schedule)   # something recomputed

    reference = trained(copy.deepcopy(model), examples, tmp_path / "eager")
    applied = runtime.apply(plan, copy.deepcopy(model), loss_fn, batch, graph=graph)
    checkpointed = trained(applied, examples, tmp_path / "plan")
    keys = [getattr(m, policy._WRAPPED) for m in applied.modules() if getattr(m, policy._WRAPPED, None) in policy._REGIONS]
    assert keys and all(policy._REGIONS[k].forward_pass.at == len(policy._REGIONS[k].ops) for k in keys)
    for k in reference:
        torch.testing.assert_close(checkpointed[k], reference[k], rtol=0, atol=1e-6, msg=lambda m: f"{k}: {m}")
    assert any(not torch.equal(reference[k], p) for k, p in model.named_parameters())   # training moved them
