"""The whole `pipeline.toml` (`PipelineConfig`), its loading, and errors that name the file, the key
path, the bad value and what is allowed."""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Annotated, Any, Literal, get_args, get_origin

from pydantic import BeforeValidator, Field, ValidationError, field_validator, model_validator

from memplan.tasks.config.errors import ConfigError
from memplan.tasks.config.fleet import DeployConfig
from memplan.tasks.config.sections import ModelConfig, PlanConfig, ProfileConfig, PublishConfig, Section, ValidateConfig
from memplan.tasks.config.values import DEVICE, check_device_memory, parse_device_memory
from memplan.tasks.solve.core.optimizer import OPTIMIZERS

MAX_SEED = 2**63 - 1
"""The largest `seed`: torch.manual_seed takes 64-bit seeds (a negative one standing for a large one) and the
profile store keeps seeds as signed 64-bit integers."""

class RunConfig(Section):
    """How the `plan` flow runs its solve and validate cells."""

    task_runner: Literal["threads", "dask"] = Field(
        "threads", description="'threads': a thread pool in the flow's process; 'dask': a Dask cluster through "
        "prefect-dask (`dask_address`, or a local cluster of `dask_workers` processes).")
    dask_address: str | None = Field(None, description="Address of an existing Dask scheduler, e.g. "
                                     "'tcp://10.0.0.5:8786'; none: start a local cluster for the run.")
    dask_workers: int = Field(2, ge=1, description="Worker processes of the local Dask cluster (one thread each).")
    dask_dashboard: str | None = Field(None, description="Address of the local cluster's dashboard (task stream, "
                                       "progress), e.g. '127.0.0.1:8787' or ':8787' (all interfaces); none: no dashboard.")

    @model_validator(mode="after")
    def _dask_only(self) -> RunConfig:
        if self.dask_address is not None and self.task_runner != "dask":
            raise ValueError("dask_address applies with task_runner = 'dask' only")
        if self.dask_dashboard is not None and (self.task_runner != "dask" or self.dask_address is not None):
            raise ValueError("dask_dashboard applies to the local cluster (task_runner = 'dask' without dask_address); "
                             "an external scheduler serves its own (`dask scheduler --dashboard-address :8787`)")
        return self


class PipelineConfig(Section):
    """The whole `pipeline.toml`."""

    device: str = Field("auto", description="'auto' (CUDA when present, else CPU), 'cpu', 'cuda' or 'cuda:N'.")
    device_memory: Annotated[int | Literal["device"] | None, BeforeValidator(parse_device_memory)] = Field(
        None, description="The device's memory a training step may use: bytes or a size ('16 GiB'), or 'device' "
        "(what the GPU has free, torch.cuda.mem_get_info; an error on CPU). A plan must fit it with the "
        "parameters, buffers, batch, gradients and optimizer state; on CPU the meter enforces it (docs/fit.md). "
        "None: no limit.")
    optimizer: Literal[tuple(OPTIMIZERS)] = Field(  # type: ignore[valid-type]
        "sgd", description="The optimizer the training job runs: "
        + "; ".join(f"'{k}': {m.help}" for k, m in OPTIMIZERS.items()) + ". Its state (per parameter: "
        + ", ".join(f"{k} {m.state}" for k, m in OPTIMIZERS.items()) + " tensors of the parameter's size) counts "
        "against device_memory, and plans with optimizer_in_step = true run it inside the step.")
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

    @field_validator("device_memory")
    @classmethod
    def _device_memory(cls, value: int | str | None, info) -> int | str | None:
        return check_device_memory(value, info.data.get("device", "auto"))

    @field_validator("seed")
    @classmethod
    def _seed(cls, seed: int) -> int:
        if not 0 <= seed <= MAX_SEED:
            raise ValueError(f"seed {seed} is outside 0 to 2**63 - 1 ({MAX_SEED:,}): torch.manual_seed takes 64-bit "
                             f"seeds and the profile store keeps them as signed 64-bit integers; give a seed in that "
                             f"range, e.g. seed = 0")
        return seed

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

    def model_batches(self, model: str | None = None, batch: int | None = None) -> list[tuple[ModelConfig, int]]:
        """The (model entry, batch size) pairs the file declares, in declaration order: each graph the run
        traces and profiles. `model` / `batch`, when given, keep only that model's / batch size's."""
        return [(m, b) for m in self.models for b in m.batch_sizes if model in (None, m.name) and batch in (None, b)]

    @property
    def validation(self) -> ValidateConfig:
        """The `[validate]` section (`validate` itself is a pydantic method name)."""
        return self.validate_


def registered_solvers() -> list[str]:
    """Names in the solver registry `tasks.solve.SOLVERS`."""
    from memplan.tasks.solve import SOLVERS

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


def _short(value: Any, limit: int = 80) -> str:
    """`repr(value)`, cut to `limit` characters (a 5,000-character value is named, not printed)."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit - 5]}...{text[-1]} ({len(text)} characters)"


_TYPE_FIXES = {
    "bool_type": "not a boolean; write true or false, without quotes",
    "int_type": "not an integer; write a whole number without quotes, e.g. 8",
    "float_type": "not a number; write a number without quotes, e.g. 0.5",
    "string_type": "not a string; write it in quotes",
}
"""What the strict tables refuse (no string is read as a boolean or number, no boolean as a number), and the fix."""


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
        elif err["type"] in _TYPE_FIXES:
            message = _TYPE_FIXES[err["type"]]
        else:
            message = err["msg"]
        where = f"key {path}" if path else "top level"
        value = "" if err["type"] == "missing" or isinstance(err["input"], dict) else f" = {_short(err['input'])}"
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
