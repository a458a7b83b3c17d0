"""The pipeline matrix: models x batch sizes x plans x budgets as the list of `Case`s a run solves."""

from __future__ import annotations

from dataclasses import dataclass

from memplan.tasks.config.errors import ConfigError
from memplan.tasks.config.schema import PipelineConfig
from memplan.tasks.config.sections import ModelConfig, PlanConfig, PlanForm
from memplan.tasks.config.values import Budget

@dataclass(frozen=True)
class Case:
    """One cell of the matrix: a model at a batch size, solved by one solver at one budget."""

    model: ModelConfig
    batch_size: int
    plan: PlanConfig
    budget: Budget

    @property
    def alias(self) -> str:
        """Readable plan name, e.g. `resnet18-b8-checkmate-60pct`; a plan whose form is not its solver's default
        (`PlanConfig.default_form`) names it: `gpt2-b8-selective-policy-executor-60pct`; so do the optimizer
        inside the step (`-in-step`) and DistributedDataParallel's buckets (`-ddp25mb`)."""
        form = "" if self.plan.form in (None, self.plan.default_form) else f"-{self.plan.form}"
        form += "-in-step" if self.plan.optimizer_in_step else ""
        form += f"-ddp{self.plan.ddp_bucket_mb:g}mb" if self.plan.ddp_bucket_mb is not None else ""
        return f"{self.model.name}-b{self.batch_size}-{self.plan.solver}{form}-{self.budget.label}"


def expand_matrix(config: PipelineConfig) -> list[Case]:
    """All (model, batch size, plan, budget) combinations, in declaration order, without duplicates; two
    [[plans]] tables that differ but would make plans of the same name are refused."""
    cases: dict[str, Case] = {}
    for model, batch_size in config.model_batches():
        for plan in config.plans:
            if plan.models is not None and model.name not in plan.models:
                continue
            for budget in plan.cell_budgets:
                case = Case(model, batch_size, plan, budget)
                known = cases.setdefault(case.alias, case)
                if known.plan != plan:
                    raise ConfigError(
                        f"[[plans]] tables {config.plans.index(known.plan) + 1} and {config.plans.index(plan) + 1} "
                        f"(solver {plan.solver!r}) both make plan {case.alias!r} but differ in other keys "
                        f"({', '.join(_differing(known.plan, plan))}), so one would be dropped; make them one table, "
                        f"or give them different budgets or models.")
    return list(cases.values())


def _differing(a: PlanConfig, b: PlanConfig) -> list[str]:
    """The keys whose values differ between two [[plans]] tables."""
    first, second = a.model_dump(), b.model_dump()
    return [key for key in first if first[key] != second.get(key)]


def graph_forms(model: str, batch_size: int, cases: list[Case]) -> list[PlanForm]:
    """The forms whose graphs a model at a batch size is traced and profiled for: those of its cases' plans,
    executor first (the policy form's graph is `runtime.policy.apply.capture_eager`'s); the executor's alone when
    no plan applies to it; none when only compiled-form plans do (they plan torch.compile's own graph:
    tasks/compiled/plans.py)."""
    forms = {c.plan.plan_form for c in cases if (c.model.name, c.batch_size) == (model, batch_size)}
    return [form for form in ("executor", "policy") if form in forms] or ([] if forms else ["executor"])
