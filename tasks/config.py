"""The `pipeline.toml` schema: typed sections with their defaults documented next to each field.

`load_config(path)` parses the file and returns a `PipelineConfig`; any problem (malformed TOML, an
unknown key, a bad value, an unknown solver) raises `ConfigError` with one paragraph naming the file,
the key path, the bad value and what is allowed. `expand_matrix(config)` turns the declared matrix
(models x batch sizes x plans x budgets) into the list of `Case`s the pipeline runs.
"""

from __future__ import annotations

import hashlib
import json
import re
import tomllib
from dataclasses import dataclass
from decimal import Decimal
from fractions import Fraction
from pathlib import Path
from typing import Annotated, Any, Literal, get_args, get_origin

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, field_validator, model_validator

from tasks.solve.core.solution import DEFAULT_BACKEND, DEFAULT_GAP, DEFAULT_TIME_LIMIT_S, Gap, TimeLimit

DTYPES = ("float32", "float64", "float16", "bfloat16", "int64", "int32", "int16", "int8", "uint8", "bool")
NAMED_LOSSES = ("cross_entropy", "mse", "causal_lm", "sum")
TRANSFORMERS_AUTO_CLASSES = (
    "AutoModelForCausalLM",
    "AutoModelForMaskedLM",
    "AutoModelForSequenceClassification",
    "AutoModel",
)
IMPORT_PATH = re.compile(r"^[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*:[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*$")
DEVICE = re.compile(r"^(auto|cpu|cuda|cuda:\d+)$")
_UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 2**10, "mib": 2**20, "gib": 2**30}
_BYTES = re.compile(r"^\s*(\d+(?:\.\d*)?(?:[eE]\d{1,4})?)\s*([A-Za-z]+)\s*$")     # exponents of 4 digits at most: sizes are exact
_PERCENT = re.compile(r"^\s*(\d+(?:\.\d*)?)\s*%\s*$")


class MemplanError(Exception):
    """A user-facing failure: the message is one paragraph naming the cause and the fix."""


class ConfigError(MemplanError):
    """`pipeline.toml` cannot be read or does not match the schema."""


class Section(BaseModel):
    """A TOML table: unknown keys are refused with the list of allowed keys."""

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=False, allow_inf_nan=False)

    @classmethod
    def toml_keys(cls) -> list[str]:
        """The TOML keys this table accepts."""
        return [field.alias or name for name, field in cls.model_fields.items()]


@dataclass(frozen=True)
class Budget:
    """A memory budget: absolute bytes, a fraction of the checkpoint-all peak (no recomputation), or
    `max_overhead`: the least memory whose schedule's predicted cost is at most (1 + max_overhead) times
    the checkpoint-all schedule's (found by a search over budgets, `tasks.solve_stage.least_memory_within`)."""

    bytes: int | None = None
    fraction: float | None = None
    max_overhead: float | None = None

    @property
    def label(self) -> str:
        """Readable form used in plan aliases: `60pct`, `1610612736B` or `ovh10pct`."""
        if self.max_overhead is not None:
            return f"ovh{self.max_overhead * 100:g}pct"
        if self.fraction is not None:
            return f"{self.fraction * 100:g}pct"
        return f"{self.bytes}B"

    def resolve(self, checkpoint_all_peak_bytes: int) -> int:
        """Budget in bytes given the peak of the eager schedule that keeps every activation (an overhead
        limit starts its search there)."""
        if self.max_overhead is not None:
            return int(checkpoint_all_peak_bytes)
        if self.fraction is not None:
            return int(self.fraction * checkpoint_all_peak_bytes)
        return int(self.bytes)


MAX_BUDGET_BYTES = 2**63 - 1
"""The largest budget in bytes: plans and the plans index store budgets as signed 64-bit integers."""


def parse_budget(value: Any) -> Budget:
    """Parse `2000000000` (bytes), `0.6` or `"60%"` (fraction of checkpoint-all), `"1.5 GiB"`."""
    if isinstance(value, bool):
        raise ValueError(_budget_help(value))
    if isinstance(value, int):
        if not 0 < value <= MAX_BUDGET_BYTES:
            raise ValueError(_budget_help(value))
        return Budget(bytes=value)
    if isinstance(value, float):
        if not 0.0 < value <= 1.0:
            raise ValueError(_budget_help(value))
        return Budget(fraction=value)
    if isinstance(value, str):
        if m := _PERCENT.match(value):
            fraction = float(m.group(1)) / 100
            if 0.0 < fraction <= 1.0:
                return Budget(fraction=fraction)
        elif (m := _BYTES.match(value)) and m.group(2).lower() in _UNITS:
            nbytes = Fraction(Decimal(m.group(1))) * _UNITS[m.group(2).lower()]    # exact, unlike a float
            if 1 <= nbytes <= MAX_BUDGET_BYTES:             # "0.5 B" would be a 0-byte budget
                return Budget(bytes=int(nbytes))
    raise ValueError(_budget_help(value))


def parse_budget_text(text: str) -> Budget:
    """A budget written on the command line, read as the TOML value it would be in pipeline.toml:
    `2000000000` (bytes), `0.8` (fraction), `80%` or `1.5GiB` (a string without quotes)."""
    return parse_budget(_toml_value(text))


def parse_option_text(assignment: str) -> tuple[str, Any]:
    """`KEY=VALUE` from the command line: VALUE read as a TOML value (`mode=memory` and `mode="memory"`
    are the same string, `keep=[1, 2]` a list, `gap=0.1` a float)."""
    key, sep, text = assignment.partition("=")
    if not sep or not key.strip():
        raise ValueError(f"option {assignment!r} is not KEY=VALUE (e.g. --option mode=memory).")
    return key.strip(), _toml_value(text.strip())


def _toml_value(text: str) -> Any:
    """`text` read as a TOML value (`0.8`, `[1, 2]`, `"x"`); text that is not one stays the string."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


MAX_OVERHEAD = 10.0
"""The largest `max_overhead` accepted: a schedule 11 times slower than no recomputation is a typo."""


def parse_max_overhead(value: Any) -> list[float]:
    """`max_overhead = 0.1` or `[0.05, 0.25]`: each a number in [0, 10], one plan each."""
    values = value if isinstance(value, list) else [value]
    if not values or any(isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v <= MAX_OVERHEAD
                         for v in values):                    # NaN fails the comparison too
        raise ValueError(
            "max_overhead must be a number or a non-empty list of numbers in [0, 10], the predicted step-time "
            "overhead allowed over the no-recomputation schedule as a fraction (0.10: at most 10% slower); "
            "write e.g. max_overhead = 0.10 or max_overhead = [0.05, 0.25]")
    return [float(v) for v in values]


def _budget_help(value: Any) -> str:
    return (
        f"budget {value!r} is not understood; write an integer number of bytes (2000000000), a size "
        f"with a unit ('1.5 GiB', '512 MiB'; units {', '.join(_UNITS)}), or a fraction of the "
        "checkpoint-all peak as a float in (0, 1] (0.6) or a percentage ('60%'); byte budgets lie in "
        f"1..{MAX_BUDGET_BYTES}"
    )


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
        description="A named loss (cross_entropy, mse, causal_lm, sum) or an import path "
        "'pkg.module:function' called as loss(model, *batch) -> scalar.",
    )
    inputs: list[InputSpec] = Field(description="The batch tensors, in the order the loss receives them.")
    batch_sizes: list[int] = Field([8], description="Batch sizes to plan for (one graph each).")

    @field_validator("name")
    @classmethod
    def _name(cls, name: str) -> str:
        if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]*", name):
            raise ValueError(f"name {name!r} must be letters, digits, '-', '_' or '.' (it becomes a file name)")
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
        return hashlib.sha256(json.dumps(spec, sort_keys=True, default=str).encode()).hexdigest()


class ProfileConfig(Section):
    """Operator profiling (the costs the solvers minimise)."""

    warmup: int = Field(2, ge=0, description="Untimed runs of each operator before timing.")
    repeats: int = Field(5, ge=1, description="Timed runs of each operator; the store keeps their statistics.")
    retries: int = Field(2, ge=0, description="Prefect retries of a profiling task that raised.")


VariantChoice = Literal["all", "bit-identical", "none"]
"""A plan's `variants` setting: which implementation-variant rules its solver may choose
(`tasks.problems.VARIANT_RULES`)."""


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
    addresses: Literal["none", "greedy", "olla"] = Field(
        "none", description="Plan an arena address for every value copy: 'greedy' (largest first, best gap), "
        "'olla' (OLLA's location ILP, never above greedy's arena; within time_limit_s) or 'none'. Plans with "
        "addresses run in arena mode with runtime.load(..., arena=True).")
    variants: VariantChoice = Field(
        "all", description="Implementation variants the solver may choose (docs/plan-format.md): 'all'; "
        "'bit-identical' (ReLU masks, compact max-pool, in-place ReLU, where the profile found them "
        "bit-identical to the captured op on its device); 'none' (the captured ops only). The others ('output', "
        "'math', 'sigmoid') are within the validation tolerance.")
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
        from tasks.solve import SOLVERS, parse_options

        if solver in SOLVERS:
            parse_options(SOLVERS[solver], options, where="")
        return options

    def solve_settings(self) -> dict[str, Any]:
        """What the solve stage needs, as JSON: the `SolveOptions` keywords, `addresses` and `variants`."""
        return {"backend": self.backend, "time_limit": self.time_limit_s, "gap": self.gap,
                "params": dict(self.options), "addresses": self.addresses, "variants": self.variants}


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
    peak_rtol: float = Field(
        0.05,
        ge=0,
        description="Measured peak (tensor bytes allocated during the step) may exceed the budget by this fraction.",
    )


class PublishConfig(Section):
    """Where validated plans go."""

    dir: str = Field("plans", description="Folder of published plans, their aliases and the Parquet index.")


def _cron(expression: str) -> str:
    from prefect._vendor.croniter import croniter

    if len(expression.split()) != 5 or not croniter.is_valid(expression):
        raise ValueError(f"{expression!r} is not a cron expression; write five fields 'minute hour day month "
                         f"weekday', e.g. '0 3 * * *' (03:00 daily)")
    return expression


Cron = Annotated[str, AfterValidator(_cron)]


class DeviceClassConfig(Section):
    """One GPU class of the fleet: a work queue its hosts' workers poll, and when to profile and plan."""

    name: str = Field(description="The class (and its work queue) name, e.g. 'h100'.")
    device: str | None = Field(None, description="The device key its hosts write into the profile store "
                               "(`memplan query \"SELECT DISTINCT device FROM runs\"`); default: `name`.")
    profile_cron: Cron = Field("0 3 * * *", description="When the `profile` flow runs (cron, in `timezone`).")
    plan_cron: Cron | None = Field(None, description="When the `plan` flow runs (cron); none: planned on demand.")
    timezone: str = Field("UTC", description="IANA time zone of the cron expressions.")
    profile_parameters: dict[str, Any] = Field(
        default_factory=dict, description="Extra parameters of the profile flow's runs, e.g. {reuse = true}.")
    plan_parameters: dict[str, Any] = Field(
        default_factory=dict, description="Extra parameters of the plan flow's runs, e.g. {refresh = true}.")

    @field_validator("name")
    @classmethod
    def _queue_name(cls, name: str) -> str:
        if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]*", name):
            raise ValueError(f"name {name!r} must be letters, digits, '-', '_' or '.' (it names a work queue)")
        return name

    @field_validator("timezone")
    @classmethod
    def _timezone(cls, zone: str) -> str:
        from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

        try:
            ZoneInfo(zone)
        except (ZoneInfoNotFoundError, ValueError):
            raise ValueError(f"time zone {zone!r} is unknown; use an IANA name such as 'UTC' or 'Europe/Paris'") from None
        return zone

    @field_validator("profile_parameters", "plan_parameters")
    @classmethod
    def _parameters(cls, parameters: dict[str, Any], info) -> dict[str, Any]:
        allowed = {"profile_parameters": ("reuse",), "plan_parameters": ("refresh",)}[info.field_name]
        unknown = sorted(set(parameters) - set(allowed))
        if unknown:
            raise ValueError(f"unknown flow parameter(s) {unknown}; allowed: {', '.join(allowed)} (config_path "
                             f"is set by `memplan deploy`)")
        return parameters

    @property
    def device_key(self) -> str:
        return self.device or self.name

    def max_age_s(self, now=None) -> float:
        """The longest time between two scheduled profile runs (cron), the age at which a profile is late."""
        from datetime import datetime, timezone
        from zoneinfo import ZoneInfo

        from prefect._vendor.croniter import croniter

        start = (now or datetime.now(timezone.utc)).astimezone(ZoneInfo(self.timezone))
        it = croniter(self.profile_cron, start)
        times = [it.get_prev(datetime) for _ in range(8)]
        return max((a - b).total_seconds() for a, b in zip(times, times[1:]))


class DeployConfig(Section):
    """Prefect deployments of the `profile` and `plan` flows on a fleet (`memplan deploy`, docs/fleet.md)."""

    work_pool: str = Field("memplan", description="The process work pool the fleet's workers poll.")
    directory: str | None = Field(None, description="The project folder on every worker host (holding this "
                                  "pipeline.toml); default: this file's folder, so hosts share it (e.g. an NFS mount).")
    classes: list[DeviceClassConfig] = Field(description="The GPU classes ([[deploy.classes]] tables), one work queue each.")

    @model_validator(mode="after")
    def _distinct(self) -> DeployConfig:
        names = [c.name for c in self.classes]
        if not names:
            raise ValueError("'classes' is empty; declare at least one [[deploy.classes]] table")
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise ValueError(f"device class {duplicates[0]!r} is declared twice; class names must be unique")
        return self


class RunConfig(Section):
    """How the `plan` flow runs its solve and validate cells."""

    task_runner: Literal["threads", "dask"] = Field(
        "threads", description="'threads': a thread pool in the flow's process; 'dask': a Dask cluster through "
        "prefect-dask (`dask_address`, or a local cluster of `dask_workers` processes).")
    dask_address: str | None = Field(None, description="Address of an existing Dask scheduler, e.g. "
                                     "'tcp://10.0.0.5:8786'; none: start a local cluster for the run.")
    dask_workers: int = Field(2, ge=1, description="Worker processes of the local Dask cluster (one thread each).")

    @model_validator(mode="after")
    def _dask_only(self) -> RunConfig:
        if self.dask_address is not None and self.task_runner != "dask":
            raise ValueError("dask_address applies with task_runner = 'dask' only")
        return self


class PipelineConfig(Section):
    """The whole `pipeline.toml`."""

    device: str = Field("auto", description="'auto' (CUDA when present, else CPU), 'cpu', 'cuda' or 'cuda:N'.")
    seed: int = Field(0, description="Seed of the random weights and batches.")
    store: str = Field("profiles_db", description="Profile store: a folder (relative paths: from the file's folder) "
                       "or an object-store URL such as 's3://bucket/prefix' (docs/fleet.md).")
    cache_dir: str = Field(".cache/memplan", description="Traced graphs, solutions, reports and Prefect results.")
    models: list[ModelConfig] = Field(min_length=1, description="The models to plan for ([[models]] tables).")
    profile: ProfileConfig = Field(default_factory=ProfileConfig, description="[profile] table.")
    plans: list[PlanConfig] = Field(description="Solvers and budgets ([[plans]] tables).")
    validate_: ValidateConfig = Field(default_factory=ValidateConfig, alias="validate", description="[validate] table.")
    publish: PublishConfig = Field(default_factory=PublishConfig, description="[publish] table.")
    run: RunConfig = Field(default_factory=RunConfig, description="[run] table.")
    deploy: DeployConfig | None = Field(None, description="[deploy] table (fleets only: `memplan deploy`).")

    @field_validator("device")
    @classmethod
    def _device(cls, device: str) -> str:
        if not DEVICE.match(device):
            raise ValueError(f"device {device!r} is not one of 'auto', 'cpu', 'cuda', 'cuda:N'")
        return device

    @model_validator(mode="after")
    def _cross_references(self) -> PipelineConfig:
        names = [m.name for m in self.models]
        if not names:
            raise ValueError("'models' is empty; declare at least one [[models]] table")
        if not self.plans:
            raise ValueError("'plans' is empty; declare at least one [[plans]] table")
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise ValueError(f"model name {duplicates[0]!r} is used twice; model names must be unique")
        for i, plan in enumerate(self.plans):
            for name in plan.models or []:
                if name not in names:
                    raise ValueError(f"plans[{i}].models names {name!r}, which is not a model; models: {', '.join(names)}")
        return self

    def relative_to(self, folder: str | Path) -> PipelineConfig:
        """This config with the relative `store`, `cache_dir` and `publish.dir` taken inside `folder`, as
        absolute paths (cached results naming them stay valid from any working folder)."""

        def inside(path: str) -> str:
            return path if "://" in path else str(Path(folder).resolve() / Path(path).expanduser())

        publish = self.publish.model_copy(update={"dir": inside(self.publish.dir)})
        return self.model_copy(update={"store": inside(self.store), "cache_dir": inside(self.cache_dir), "publish": publish})

    @property
    def validation(self) -> ValidateConfig:
        """The `[validate]` section (`validate` itself is a pydantic method name)."""
        return self.validate_


@dataclass(frozen=True)
class Case:
    """One cell of the matrix: a model at a batch size, solved by one solver at one budget."""

    model: ModelConfig
    batch_size: int
    plan: PlanConfig
    budget: Budget

    @property
    def alias(self) -> str:
        """Readable plan name, e.g. `resnet18-b8-checkmate-60pct`."""
        return f"{self.model.name}-b{self.batch_size}-{self.plan.solver}-{self.budget.label}"


def expand_matrix(config: PipelineConfig) -> list[Case]:
    """All (model, batch size, plan, budget) combinations, in declaration order, without duplicates."""
    cases: dict[str, Case] = {}
    for model in config.models:
        for batch_size in model.batch_sizes:
            for plan in config.plans:
                if plan.models is not None and model.name not in plan.models:
                    continue
                for budget in plan.cell_budgets:
                    case = Case(model, batch_size, plan, budget)
                    cases.setdefault(case.alias, case)
    return list(cases.values())


def registered_solvers() -> list[str]:
    """Names in the solver registry `tasks.solve.SOLVERS`."""
    from tasks.solve import SOLVERS

    return sorted(SOLVERS)


def parse_config(data: dict[str, Any], source: str = "pipeline.toml", solvers: list[str] | None = None) -> PipelineConfig:
    """Validate parsed TOML; `solvers` (default: the registry) are the names a plan may use."""
    solvers = registered_solvers() if solvers is None else solvers
    try:
        return PipelineConfig.model_validate(data, context={"solvers": solvers})
    except ValidationError as exc:
        raise ConfigError(_describe(exc, source)) from None


def load_config(path: str | Path = "pipeline.toml", solvers: list[str] | None = None) -> PipelineConfig:
    """Read and validate `pipeline.toml`; its relative paths are taken from the file's folder."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(
            f"{path}: no such file; pass the path of a pipeline.toml (see docs/config.md for the schema)"
        ) from None
    except IsADirectoryError:
        raise ConfigError(f"{path} is a folder; pass the pipeline.toml file itself (e.g. {path / 'pipeline.toml'})") from None
    except OSError as exc:
        raise ConfigError(f"cannot read {path}: {exc.strerror or exc}; check the path and its permissions") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path} is not UTF-8 text (byte {exc.object[exc.start]:#04x} at offset {exc.start}); "
                          "TOML files are UTF-8: re-save it as UTF-8") from None
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path} is not valid TOML: {exc}; fix the syntax at that position") from None
    return parse_config(data, str(path), solvers).relative_to(path.parent)


def _describe(exc: ValidationError, source: str) -> str:
    """One paragraph: each error as `key.path = value: what is wrong and what is allowed`."""
    parts = []
    for err in exc.errors():
        path = _key_path(err["loc"])
        if err["type"] == "value_error":
            message = str(err["ctx"]["error"]).rstrip(".")
        elif err["type"] == "extra_forbidden":
            section = _section_at(err["loc"][:-1])
            where = _key_path(err["loc"][:-1]) or "the top level"
            message = f"unknown key; allowed keys in {where}: {', '.join(section.toml_keys())}"
        elif err["type"] == "missing":
            message = "required key is missing"
        else:
            message = err["msg"]
        where = f"key {path}" if path else "top level"
        value = "" if err["type"] == "missing" or isinstance(err["input"], dict) else f" = {err['input']!r}"
        parts.append(f"{where}{value}: {message}")
    return f"{source} does not match the pipeline schema (docs/config.md): " + "; ".join(parts) + "."


def _section_at(loc: tuple) -> type[Section]:
    """The table class reached by following a pydantic error location from `PipelineConfig`."""
    section: type[Section] = PipelineConfig
    for part in loc:
        if isinstance(part, int):
            continue
        field = next(f for name, f in section.model_fields.items() if (f.alias or name) == part)
        annotation = field.annotation
        while get_origin(annotation) is not None:
            annotation = next(a for a in get_args(annotation) if a is not type(None))
        section = annotation
    return section


def _key_path(loc: tuple) -> str:
    path = ""
    for part in loc:
        if isinstance(part, int):
            path += f"[{part}]"
        else:
            path += ("." if path else "") + str(part)
    return path
