"""A plan's form: how a training job runs it (docs/training.md, "Which call fits your loop"). Torch-free."""

from __future__ import annotations

from typing import Literal

PlanForm = Literal["executor", "policy", "compiled"]
"""How a plan runs: "executor" (`runtime.load`, on the graph memplan's executor runs), "policy" (selective
checkpointing in the user's own loop, `runtime.apply`, on `runtime.policy.apply.capture_eager`'s graph) or "compiled"
(`runtime.load` compiles the step with inductor under the plan's decisions, on torch.compile's joint graph)."""

EXECUTOR: PlanForm = "executor"
POLICY: PlanForm = "policy"
COMPILED: PlanForm = "compiled"
