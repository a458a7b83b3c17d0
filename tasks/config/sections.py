"""The tables of `pipeline.toml`: models and their inputs, profiling, plans, validation, publishing;
each field's default and meaning next to it."""

from __future__ import annotations

import hashlib
import json
import re
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, field_validator, model_validator

from memplan.runtime.format.forms import PlanForm
from memplan.runtime.variants.offered import BIT_IDENTICAL_RULES
from memplan.tasks.config.values import (Budget, DTYPES, IMPORT_PATH, NAMED_LOSSES,
    TRANSFORMERS_AUTO_CLASSES, parse_budget, parse_max_overhead)
from memplan.tasks.solve.core.optimizer import OPTIMIZERS
from memplan.tasks.solve.core.solution import DEFAULT_BACKEND, DEFAULT_GAP, DEFAULT_TIME_LIMIT_S, Gap, SolveOptions, TimeLimit

class Section(BaseModel):
    """A TOML table: unknown keys are refused with the list of allowed keys, and values are strict: no string
    is read as a boolean or a number, no boolean as a number (an integer is a float's value)."""

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=False, allow_inf_nan=False, strict=True)

    @classmethod
    def toml_keys(cls) -> list[str]:
        """The TOML keys this table accepts."""
        return [field.alias or name for name, field in cls.model_fields.items()]


PRECISION_DEFAULTS = {"dtype": "float32", "autocast": None}
"""The precision keys of `[[models]]` at their defaults (full precision), left out of `content_hash`."""

MAX_NAME = 100
"""The longest model name: plan aliases and graph files are named after it (file names end at 255 bytes)."""


class InputSpec(Section):
    """One tensor of the batch; the batch size is prepended to `shape`."""

    shape: list[int] = Field(description="Per-sample shape (without the batch dimension); [] for a scalar per sample.")
    dtype: Literal[DTYPES] = Field("float32", description="Element type.")
    high: int | None = Field(
        None,
        description="Integer inputs are drawn uniformly from [0, high) (class labels, token ids); "
        "required for integer dtypes. Float inputs are standard normal.",
    )

    @field_validator("shape")
    @classmethod
    def _positive(cls, shape: list[int]) -> list[int]:
        if any(d <= 0 for d in shape):
            raise ValueError(f"every dimension must be a positive integer, got {shape}")
        return shape

    @model_validator(mode="after")
    def _integer_range(self) -> InputSpec:
        integer = self.dtype.startswith(("int", "uint"))
        if integer and (self.high is None or self.high <= 0):
            raise ValueError(f"dtype {self.dtype!r} needs 'high' (a positive integer: values are drawn from [0, high))")
        if not integer and self.high is not None:
            raise ValueError(f"'high' applies to integer dtypes only, not {self.dtype!r}")
        return self


class ModelConfig(Section):
    """One model: where it comes from, its loss and its inputs."""

    name: str = Field(description="Label used in plan names and the plans index; unique in the file.")
    torchvision: str | None = Field(None, description="A torchvision.models name, e.g. 'resnet18' (random weights).")
    transformers: str | None = Field(
        None, description="A transformers model type, e.g. 'gpt2', built from a config (no download)."
    )
    factory: str | None = Field(None, description="Import path 'pkg.module:function' returning an nn.Module.")
    kwargs: dict[str, Any] = Field(
        default_factory=dict,
        description="Keyword arguments for the torchvision builder, the transformers config, or the factory.",
    )
    auto_class: Literal[TRANSFORMERS_AUTO_CLASSES] = Field(
        "AutoModelForCausalLM", description="transformers only: the Auto class built from the config."
    )
    loss: str = Field(
        "cross_entropy",
        description="A named loss (cross_entropy, mse, causal_lm, labels, sum) or an import path "
        "'pkg.module:function' called as loss(model, *batch) -> scalar.",
    )
    inputs: list[InputSpec] = Field(description="The batch tensors, in the order the loss receives them.")
    batch_sizes: list[int] = Field([8], description="Batch sizes to plan for (one graph each).")
    dtype: Literal["float32", "bfloat16", "float16"] = Field(
        "float32", description="The parameters' and floating buffers' dtype (`model.to(dtype)` after building)."
    )
    autocast: Literal["bfloat16", "float16"] | None = Field(
        None, description="Run the loss (forward and loss) under `torch.autocast(device, dtype=autocast)`."
    )

    @field_validator("name")
    @classmethod
    def _name(cls, name: str) -> str:
        if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]*", name):
            raise ValueError(f"name {name!r} must be letters, digits, '-', '_' or '.' (it becomes a file name)")
        if len(name) > MAX_NAME:
            raise ValueError(f"name {name[:40]!r}... is {len(name)} characters long; give at most {MAX_NAME} (it "
                             f"becomes part of file names)")
        return name

    @field_validator("factory")
    @classmethod
    def _factory(cls, path: str | None) -> str | None:
        if path is not None and not IMPORT_PATH.match(path):
            raise ValueError(f"factory {path!r} is not an import path; write 'package.module:function'")
        return path

    @field_validator("loss")
    @classmethod
    def _loss(cls, loss: str) -> str:
        if loss not in NAMED_LOSSES and not IMPORT_PATH.match(loss):
            raise ValueError(
                f"loss {loss!r} is neither a named loss ({', '.join(NAMED_LOSSES)}) nor an import path "
                "'package.module:function'"
            )
        return loss

    @field_validator("batch_sizes")
    @classmethod
    def _batch_sizes(cls, sizes: list[int]) -> list[int]:
        if not sizes or any(b <= 0 for b in sizes):
            raise ValueError(f"batch_sizes must be a non-empty list of positive integers, got {sizes}")
        return sizes

    @model_validator(mode="after")
    def _one_source(self) -> ModelConfig:
        sources = [k for k in ("torchvision", "transformers", "factory") if getattr(self, k) is not None]
        if len(sources) != 1:
            raise ValueError(
                f"model {self.name!r} needs exactly one of 'torchvision', 'transformers' or 'factory', "
                f"got {sources or 'none'}"
            )
        if not self.inputs:
            raise ValueError(f"model {self.name!r} needs at least one entry in 'inputs'")
        return self

    @property
    def source(self) -> tuple[str, str]:
        """(kind, name): ('torchvision', 'resnet18'), ('transformers', 'gpt2') or ('factory', 'pkg.m:f')."""
        for kind in ("torchvision", "transformers", "factory"):
            if getattr(self, kind) is not None:
                return kind, getattr(self, kind)
        raise AssertionError("validated: exactly one source")

    def content_hash(self, batch_size: int) -> str:
        """SHA-256 of everything that determines the traced graph of this model at `batch_size`."""
        spec = self.model_dump(exclude={"name", "batch_sizes"}) | {"batch_size": batch_size}
        for key, default in PRECISION_DEFAULTS.items():    # files without them keep their cache keys
            if spec[key] == default:
                del spec[key]
        return hashlib.sha256(json.dumps(spec, sort_keys=True, default=str).encode()).hexdigest()


class ProfileConfig(Section):
    """Operator profiling (the costs the solvers minimise)."""

    warmup: int = Field(2, ge=0, description="Untimed runs of each operator before timing.")
    repeats: int = Field(5, ge=1, description="Timed runs of each operator; the store keeps their statistics.")
    retries: int = Field(2, ge=0, description="Prefect retries of a profiling task that raised.")


VARIANT_RULES: dict[str, tuple[str, ...] | None] = {"all": None, "bit-identical": BIT_IDENTICAL_RULES, "none": ()}
"""The implementation-variant rules (runtime.variants.offered) a solver may choose from, by the name a plan's `variants`
setting gives: every rule; those whose code gives ATen's bits; none (the captured ops only)."""

VariantChoice = Literal[tuple(VARIANT_RULES)]  # type: ignore[valid-type]
"""A plan's `variants` setting: which implementation-variant rules its solver may choose (the names of
`VARIANT_RULES`)."""

OptimizerChoice = Literal[("none", *OPTIMIZERS)]  # type: ignore[valid-type]
"""A plan's `optimizer` setting: none, or the optimizer it runs inside the step (`tasks.solve.core.optimizer`)."""

Addresses = Literal["none", "greedy", "olla"]
"""A plan's `addresses` setting: how its value copies get arena offsets (`tasks.solve_stage.solve_loaded`)."""



class PlanSettings(BaseModel):
    """A plan's solve settings, parsed once from its `[[plans]]` table and handed to the solve stage whole:
    the shared MILP settings, the solver's own `params` (checked against its options at load time),
    `addresses`, `variants`, the `optimizer` run inside the step ("none": after it) and DDP's bucket cap
    `ddp_bucket_mb` (None: not under DistributedDataParallel) and the plan's `form` (the graph it is made on)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    backend: str = DEFAULT_BACKEND
    time_limit: float | None = DEFAULT_TIME_LIMIT_S
    gap: float = DEFAULT_GAP
    params: dict[str, Any] = {}
    addresses: Addresses = "none"
    variants: VariantChoice = "all"
    optimizer: OptimizerChoice = "none"
    ddp_bucket_mb: float | None = None
    form: PlanForm = "executor"

    def solve_options(self) -> SolveOptions:
        """The `SolveOptions` the solver gets."""
        return SolveOptions(backend=self.backend, time_limit=self.time_limit, gap=self.gap, params=dict(self.params))


class PlanConfig(Section):
    """One solver and the budgets to solve it at (each budget is one plan per model and batch size)."""

    solver: str = Field(description="A registered solver name (see `memplan solve --help`).")
    budgets: list[Annotated[Budget, BeforeValidator(parse_budget)]] | None = Field(
        None, description="Bytes (int), a size with a unit ('1.5 GiB'), or a fraction of the checkpoint-all "
        "peak (0.6 or '60%'); one plan each. Give this or `max_overhead`."
    )
    max_overhead: Annotated[list[float], BeforeValidator(parse_max_overhead)] | None = Field(
        None, description="Instead of `budgets`: a predicted-overhead limit (0.10) or a list of them, one plan each: "
        "the least memory whose schedule's predicted cost is at most (1 + max_overhead) x the no-recomputation "
        "schedule's, searched over budgets with this solver."
    )
    backend: Literal["highs", "gurobi", "auto"] = Field(
        DEFAULT_BACKEND, description="MILP backend (MILP solvers only); 'auto' takes Gurobi when the license "
        "present covers the model (the pip license covers up to 2000 variables and constraints), else HiGHS."
    )
    time_limit_s: TimeLimit = Field(DEFAULT_TIME_LIMIT_S, description="Wall-clock limit of one solve, seconds.")
    gap: Gap = Field(DEFAULT_GAP, description="Relative MIP gap at which a MILP solve stops.")
    options: dict[str, Any] = Field(
        default_factory=dict, description="The solver's own options (`memplan solve --help` and docs/solvers.md "
        "list them per solver).")
    addresses: Addresses = Field(
        "none", description="Plan an arena address for every value copy: 'greedy' (largest first, best gap), "
        "'olla' (OLLA's location ILP, never above greedy's arena; within time_limit_s) or 'none'. Plans with "
        "addresses run in arena mode with runtime.load(..., arena=True).")
    variants: VariantChoice = Field(
        "all", description="Implementation variants the solver may choose (docs/plan-format.md): 'all'; "
        "'bit-identical' (ReLU masks, compact max-pool, in-place ReLU, where the profile found them "
        "bit-identical to the captured op on its device); 'none' (the captured ops only). The others ('output', "
        "'math', 'sigmoid') are within the validation tolerance.")
    optimizer_in_step: bool = Field(
        False, description="Plan for the pipeline's `optimizer` inside the step (runtime.load(..., optimizer=opt); a "
        "policy-form plan: runtime.apply(..., optimizer=opt)): "
        "each parameter gradient dies where its parameter is updated, not at the end of the step; the "
        "optimizer's state is reported as predicted.optimizer_state_bytes.")
    ddp_bucket_mb: float | None = Field(
        None, gt=0, description="Plan for runtime.load(plan, DistributedDataParallel(model, bucket_cap_mb=...), ...): "
        "the gradients are all-reduced in buckets of this many MiB (DDP's bucket_cap_mb; its default is 25), each "
        "a flat buffer from its launch to the end of the step, which the predicted peak counts. Omitted: not DDP.")
    form: PlanForm | None = Field(
        None, description="How the plan runs: 'executor' (runtime.load runs the whole step), 'policy' (selective "
        "checkpointing in your own training loop, runtime.apply; made on the step as eager PyTorch runs it; "
        "only solvers whose schedules that runs, e.g. 'selective-policy') or 'compiled' (runtime.load compiles "
        "the step with torch.compile's inductor, which recomputes what the plan chose; budgets are measured "
        "compiled peaks, a fraction is one of inductor's own compiled peak). Omitted: 'policy' for such solvers, "
        "else 'executor'.")
    models: list[str] | None = Field(None, description="Model names this plan applies to; all when omitted.")

    @field_validator("budgets")
    @classmethod
    def _budgets(cls, budgets: list[Budget] | None) -> list[Budget] | None:
        if budgets is not None and not budgets:
            raise ValueError("budgets is empty; list at least one budget")
        return budgets

    @model_validator(mode="after")
    def _budgets_or_overhead(self) -> PlanConfig:
        if (self.budgets is None) == (self.max_overhead is None):
            given = "both 'budgets' and 'max_overhead'" if self.budgets is not None else "neither 'budgets' nor 'max_overhead'"
            raise ValueError(
                f"plan of solver {self.solver!r} gives {given}; give exactly one: budgets = [\"60%\"] (fractions "
                "of the checkpoint-all peak, or bytes) or max_overhead = 0.10 (the least memory within 10% "
                "predicted overhead), in separate [[plans]] tables for both")
        return self

    @model_validator(mode="after")
    def _optimizer_in_step(self) -> PlanConfig:
        if self.optimizer_in_step and self.addresses != "none":
            raise ValueError(f"plan of solver {self.solver!r} sets optimizer_in_step = true with addresses = "
                             f"{self.addresses!r}; arena addresses do not combine with the optimizer inside the "
                             f"step yet: use addresses = \"none\" in this [[plans]] table")
        if self.optimizer_in_step and self.ddp_bucket_mb is not None:
            raise ValueError(f"plan of solver {self.solver!r} sets both optimizer_in_step = true and ddp_bucket_mb; "
                             f"under DistributedDataParallel the executor refuses the optimizer inside the step (an "
                             f"update would run before its gradient's all-reduce completes): drop one of them from "
                             f"this [[plans]] table")
        return self

    @model_validator(mode="after")
    def _policy_form(self) -> PlanConfig:
        if self.plan_form != "policy":
            return self
        form = "sets form = \"policy\"" if self.form else "is in the policy form (its solver's default)"
        if not _solver_runs_policies(self.solver):
            from memplan.tasks.solve import SOLVERS

            able = ", ".join(repr(n) for n, s in SOLVERS.items() if s.policy_form) or "none registered"
            raise ValueError(f"plan of solver {self.solver!r} {form}, but {self.solver!r} makes schedules selective "
                             f"checkpointing cannot run (runtime/policy/form.py); use a solver that makes them ({able}) "
                             f"or form = \"executor\" (runtime.load) in this [[plans]] table")
        refused = [f"{key} = {json.dumps(value)}" for key, value, default in (
            ("addresses", self.addresses, "none"), ("ddp_bucket_mb", self.ddp_bucket_mb, None))
            if value != default]
        if refused:
            raise ValueError(f"plan of solver {self.solver!r} {form} and sets {' and '.join(refused)}, which only the "
                             f"executor form plans (under runtime.apply, DDP buckets the gradients itself and "
                             f"PyTorch's allocator places the tensors): remove {'them' if len(refused) > 1 else 'it'} "
                             f"or set form = \"executor\" in this [[plans]] table")
        return self

    @model_validator(mode="after")
    def _compiled_form(self) -> PlanConfig:
        if self.plan_form != "compiled":
            return self
        refused = [f"{key} = {json.dumps(value)}" for key, value, default in (
            ("addresses", self.addresses, "none"), ("ddp_bucket_mb", self.ddp_bucket_mb, None),
            ("optimizer_in_step", self.optimizer_in_step, False), ("variants", self.variants, "all"),
            ("options", self.options, {})) if value != default]
        if _solver_runs_policies(self.solver):
            refused.insert(0, f"solver = {json.dumps(self.solver)} (it makes selective-checkpointing policies; "
                              f"the compiled form takes a schedule solver such as \"dtr\")")
        if refused:
            raise ValueError(f"plan of solver {self.solver!r} sets form = \"compiled\" and {' and '.join(refused)}, "
                             f"which the compiled form does not take (inductor runs the step, allocates its tensors "
                             f"and fuses its kernels): remove {'them' if len(refused) > 1 else 'it'} from this "
                             f"[[plans]] table, or use form = \"executor\"")
        return self

    @property
    def default_form(self) -> PlanForm:
        """The form a plan of this solver takes without `form`: "policy" for a solver whose schedules selective
        checkpointing runs (`SolverSpec.policy_form`: a user writing `solver = "selective-policy"` expects a
        plan `runtime.apply` runs), else "executor"."""
        return "policy" if _solver_runs_policies(self.solver) else "executor"

    @property
    def plan_form(self) -> PlanForm:
        """The form the plan takes: `form`, else `default_form`."""
        return self.form or self.default_form

    @property
    def cell_budgets(self) -> list[Budget]:
        """One `Budget` per plan cell: the `budgets`, or one overhead limit per `max_overhead` value."""
        if self.max_overhead is not None:
            return [Budget(max_overhead=x) for x in self.max_overhead]
        return list(self.budgets or [])

    @field_validator("solver")
    @classmethod
    def _registered(cls, solver: str, info) -> str:
        registered = (info.context or {}).get("solvers")
        if registered is not None and solver not in registered:
            raise ValueError(f"unknown solver {solver!r}; registered solvers: {', '.join(sorted(registered))}")
        return solver

    @field_validator("options")
    @classmethod
    def _typed_options(cls, options: dict[str, Any], info) -> dict[str, Any]:
        solver = info.data.get("solver")
        registered = (info.context or {}).get("solvers")
        if solver is None or (registered is not None and solver not in registered):
            return options
        from memplan.tasks.solve import SOLVERS, parse_options

        if solver in SOLVERS:
            parse_options(SOLVERS[solver], options, where="")
        return options

    def solve_settings(self, optimizer: str = "none") -> PlanSettings:
        """What the solve stage needs, in one typed object; `optimizer` is the pipeline's, planned inside the
        step when this plan sets `optimizer_in_step`."""
        return PlanSettings(backend=self.backend, time_limit=self.time_limit_s, gap=self.gap, params=dict(self.options),
                            addresses=self.addresses, variants=self.variants,
                            optimizer=optimizer if self.optimizer_in_step else "none",
                            ddp_bucket_mb=self.ddp_bucket_mb, form=self.plan_form)


def _solver_runs_policies(solver: str) -> bool:
    """Whether registered solver `solver` makes policy-form schedules (False for a name not registered)."""
    from memplan.tasks.solve import SOLVERS

    spec = SOLVERS.get(solver)
    return spec is not None and spec.policy_form


class ValidateConfig(Section):
    """What a plan must satisfy before it is published."""

    steps: int = Field(10, ge=1, description="Timed training steps of the plan and of eager PyTorch (median kept).")
    max_steps: int = Field(30, ge=1, description="Timing goes on past `steps`, up to this many steps, until the "
                           "overhead's 95% interval lies within +-`overhead_precision` (a busy host needs more).")
    overhead_precision: float = Field(0.02, gt=0, description="Half-width of the overhead's 95% interval at which "
                                      "timing stops (0.02: +-2 percentage points).")
    warmup: int = Field(1, ge=0, description="Untimed steps before timing.")
    rtol: float = Field(1e-4, ge=0, description="Relative tolerance on loss, gradients and buffer updates.")
    atol: float = Field(1e-5, ge=0, description="Absolute tolerance on loss, gradients and buffer updates.")
    host_reference: bool = Field(True, description="Under `device_memory`, when no reference step fits the limit "
                                 "(eager, checkpointed, micro-batches), validate against eager's step on the host "
                                 "CPU without the limit (docs/fit.md); false: such a plan fails validation.")
    peak_rtol: float = Field(
        0.05,
        ge=0,
        description="Measured peak (tensor bytes allocated during the step) may exceed the budget by this fraction.",
    )
    compile_backend: str = Field("inductor", min_length=1, max_length=100, description=(
        "torch.compile's backend for the compiled check of a policy plan solved with `options = { compiled = true "
        "}`: its peak under torch.compile must be within the budget too (docs/training.md, torch.compile)."))
    compile_probes: int = Field(6, ge=0, le=64, description=(
        "Plans of such a cell (a budget in bytes or as a fraction) measured under torch.compile by the measured search "
        "(tasks/compiled/policy_cell.py), which publishes the cheapest whose compiled peak fits the budget; 0: solve at the "
        "budget and only check."))
    compile_spread: int = Field(6, ge=0, le=64, description=(
        "Then up to this many plans of such a cell solved at budgets spread evenly above the search's, up to 1.6 "
        "times the budget, measured the same way: compiled peaks do not grow with the solve budget everywhere, and a "
        "plan found there costs at most what those below it cost (tasks/compiled/policy_search.py); 0: none."))

    @field_validator("max_steps")
    @classmethod
    def _not_below_steps(cls, max_steps: int, info) -> int:
        steps = info.data.get("steps")
        if steps is not None and max_steps < steps:
            raise ValueError(f"max_steps {max_steps} is below steps = {steps}: timing runs `steps` rounds at least and "
                             f"goes on up to `max_steps`; set max_steps = {steps} or more, or leave it out")
        return max_steps


class PublishConfig(Section):
    """Where validated plans go."""

    dir: str = Field("plans", description="Folder of published plans, their aliases and the Parquet index.")
