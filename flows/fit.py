"""The `fit` flow: the largest batch size (or sequence length) of a model that fits the device memory limit,
for eager PyTorch, per-block checkpointing and memplan within a predicted overhead (tasks/fit/search.py),
memplan's answer validated (tasks/validate/stage.py, against a reference that fits: tasks/fit/reference.py), a
plot of peak memory against the size under `<cache_dir>/reports/`, and both left as Prefect artifacts.
`run_fit` is the entry point of the CLI and the tests; `memplan deploy` makes a `fit/<class>` deployment of
`fit_flow` per device class (its parameters are plain values: `fit_parameters`)."""

from __future__ import annotations

import base64
import time
from pathlib import Path
from typing import Any, Callable

from prefect import flow
from pydantic import BaseModel

from memplan.flows.report import artifact_key
from memplan.flows.run_events import announce_scheduled_state
from memplan.flows.worker_watch import die_with_worker
from memplan.tasks.config import MAX_OVERHEAD, PipelineConfig, load_config
from memplan.tasks.fit.search import Dimension, FitError, FitSearch, at_size, search_fit, sequence_inputs
from memplan.tasks.fit.reference import NoFittingReference
from memplan.tasks.fit.memory_limit import memory_limit
from memplan.tasks.records import Validated

MIB = 2**20
MAX_SIZE = 1 << 20
"""The largest `--max-size`: a search past a million samples (or tokens) a step is a typo."""


class FitAnswer(BaseModel):
    """The searches and the validation of memplan's answer."""

    search: FitSearch
    validation: Validated | None          # None: no reference step fits the limit (`why_not`)
    why_not: str = ""
    plot: str
    plan_path: str | None = None          # the plan validated: the answer's, or the rung its measured walk chose
    walk: str = ""                        # what that walk validated (flows/fit_refine.py)

    @property
    def validated(self) -> bool:
        return self.validation is not None and self.validation.passed

    @property
    def verdict(self) -> str:
        """'validated against <reference>' with the measured overhead's verdict against the limit, or why not."""
        if self.validated:
            from memplan.flows.report import limit_verdict

            limited = limit_verdict(self.validation.limited_overhead(), self.validation.limited_interval(),
                                    self.search.max_overhead)
            against = "no recomputation" if self.validation.overhead_vs_no_recompute is not None else "eager"
            return f"validated against {self.validation.reference}; overhead against {against}: {limited}"
        return "NOT validated: " + (self.why_not or "; ".join(self.validation.reasons))


def check_fit_settings(config: PipelineConfig, model: str | None, max_overhead: float, max_size: int,
                       solver: str, dimension: Dimension = "batch", batch_size: int | None = None
                       ) -> tuple[str, int | None]:
    """The model's name and the batch size of a sequence search (None for a batch search), once the settings
    are known good (before anything is traced)."""
    from memplan.tasks.solve import SOLVERS

    names = [m.name for m in config.models]
    if model is None:
        if len(names) > 1:
            raise FitError(f"the pipeline file declares {len(names)} models ({', '.join(names)}); name one: `memplan fit "
                           f"--model NAME`, or for a deployment run `prefect deployment run fit/<class> --param "
                           f"model=NAME` (or fit_parameters = {{ model = \"NAME\" }} in its [[deploy.classes]]).")
        model = names[0]
    if model not in names:
        raise FitError(f"unknown model {model!r}; the pipeline file declares {', '.join(names)}: pass one of them "
                       f"with --model.")
    if not 0 <= max_overhead <= MAX_OVERHEAD:
        raise FitError(f"--max-overhead {max_overhead:g} is not in [0, {MAX_OVERHEAD:g}]; give the predicted step-time "
                       f"overhead allowed over eager as a fraction, e.g. --max-overhead 0.10 (10% slower).")
    if not 1 <= max_size <= MAX_SIZE:
        raise FitError(f"--max-size {max_size} is not in [1, {MAX_SIZE:,}]; give the largest batch size (or sequence "
                       f"length) to try.")
    if solver not in SOLVERS:
        raise FitError(f"unknown solver {solver!r}; fast ones for a search: dtr, ap-greedy, acg (all: memplan solve "
                       f"--help).")
    if config.device_memory is None:
        raise FitError("memplan fit needs a device memory limit: set device_memory in pipeline.toml (e.g. "
                       "device_memory = \"16 GiB\", or \"device\" on a GPU) or pass --device-memory.")
    spec = next(m for m in config.models if m.name == model)
    if dimension == "batch":
        if batch_size is not None:
            raise FitError("--batch applies to a sequence search (--sequence); a batch search varies the batch size.")
        return model, None
    if not sequence_inputs(spec):
        raise FitError(f"model {model!r} declares no sequence input (an integer input with a per-sample shape, such as "
                       f"token ids: shape = [128], dtype = \"int64\"); search its batch size instead (without --sequence).")
    batch_size = spec.batch_sizes[0] if batch_size is None else batch_size
    if not 1 <= batch_size <= MAX_SIZE:
        raise FitError(f"--batch {batch_size} is not in [1, {MAX_SIZE:,}]; give the batch size of the sequence search.")
    return model, batch_size


@flow(name="fit", description="The largest batch that fits the device memory limit: eager, per-block "
      "checkpointing and memplan.", persist_result=False, result_serializer="json",
      on_running=[announce_scheduled_state, die_with_worker])
def fit_flow(config_path: str = "pipeline.toml", model: str | None = None, max_overhead: float = 0.10,
             solver: str = "dtr", max_size: int = 4096, dimension: Dimension = "batch", batch_size: int | None = None,
             config: PipelineConfig | None = None) -> dict[str, Any]:
    """Search, validate memplan's answer by measured overhead (flows/fit_refine.py) and leave the table and plot
    as artifacts; returns `FitAnswer` as JSON."""
    from memplan.flows.fit_refine import validate_answer
    from memplan.tasks.models import allow_imports_from, resolve_device

    config = config or load_config(config_path)
    allow_imports_from(Path(config_path).parent)
    name, batch_size = check_fit_settings(config, model, max_overhead, max_size, solver, dimension, batch_size)
    spec = next(m for m in config.models if m.name == name)
    device = resolve_device(config.device)
    limit = memory_limit(config, device)
    say = progress_lines()
    say(f"fit {name}: the largest {dimension} within {limit.limit_bytes / 2**20:,.1f} MiB, up to {max_size}")
    search = search_fit(spec, config, device, limit, solver, max_overhead, max_size, dimension, batch_size, report=say)
    answer = search.point(search.memplan_largest)
    measured, why_not = None, ""
    try:
        entry, batch = at_size(spec, dimension, answer.size, batch_size)
        say(f"validating memplan's answer, {dimension} {answer.size}, by measured overhead")
        measured = validate_answer(answer, entry, batch, device, config.seed, config.validation, limit, max_overhead)
    except NoFittingReference as exc:
        why_not = str(exc)
    plot = fit_plot(search, Path(config.cache_dir) / "reports" / f"{name}-fit-{dimension}.png")
    validation, plan_path, walk = (None, None, "") if measured is None else \
        (measured.validation, measured.plan_path, measured.walk)
    result = FitAnswer(search=search, validation=validation, why_not=why_not, plot=str(plot), plan_path=plan_path,
                       walk=walk)
    create_fit_artifacts(result)
    return result.model_dump(mode="json")


def progress_lines() -> Callable[[str], None]:
    """A progress line printer for `memplan fit` on stderr (a terminal, a file or a pipe), each line stamped with the
    seconds since the search started."""
    from rich.console import Console

    console, start = Console(stderr=True), time.monotonic()

    def say(text: str) -> None:
        console.print(f"[{time.monotonic() - start:7.1f} s] {text}", markup=False, highlight=False, soft_wrap=True)
    return say


def run_fit(config_path: str | Path = "pipeline.toml", model: str | None = None, max_overhead: float = 0.10,
            solver: str = "dtr", max_size: int = 4096, device_memory: Any = None, dimension: Dimension = "batch",
            batch_size: int | None = None) -> FitAnswer:
    """Check the settings, then run `fit_flow` with Prefect's results under `<cache_dir>/prefect` (as
    `flows.plan.run_plan`). `device_memory` (a size, bytes or "device") overrides the file's."""
    from prefect.settings import PREFECT_LOCAL_STORAGE_PATH, PREFECT_RESULTS_DEFAULT_SERIALIZER, temporary_settings

    from memplan.tasks.config import ConfigError, parse_device_memory_text
    from memplan.tasks.models import allow_imports_from, check_model, resolve_device

    config = load_config(config_path)
    if device_memory is not None:
        try:
            limit = parse_device_memory_text(str(device_memory), config.device)
            config = config.model_copy(update={"device_memory": limit})
        except ValueError as exc:
            raise ConfigError(f"--device-memory: {str(exc).replace('device_memory ', '', 1)}.") from None
    allow_imports_from(Path(config_path).parent)
    name, batch_size = check_fit_settings(config, model, max_overhead, max_size, solver, dimension, batch_size)
    check_model(next(m for m in config.models if m.name == name))
    device = resolve_device(config.device)
    if config.device_memory == "device":                  # read once, before anything is allocated
        config = config.model_copy(update={"device_memory": memory_limit(config, device).limit_bytes})
    storage = Path(config.cache_dir).resolve() / "prefect"
    with temporary_settings({PREFECT_LOCAL_STORAGE_PATH: storage, PREFECT_RESULTS_DEFAULT_SERIALIZER: "json"}):
        return FitAnswer.model_validate(fit_flow(str(config_path), name, max_overhead, solver, max_size,
                                                        dimension, batch_size, config))


def size_name(search: FitSearch) -> str:
    """What the search varied: "batch size", or "sequence length at batch N"."""
    return "batch size" if search.dimension == "batch" else f"sequence length at batch {search.batch_size}"


def fit_rows(search: FitSearch) -> list[dict[str, Any]]:
    """One row per batch size evaluated: each schedule's predicted total (resident + step peak) and memplan's overhead."""
    rows = []
    for p in search.points:
        totals = {kind: p.total(peak) for kind, peak in (("eager", p.eager_peak_bytes),
                  ("checkpoint", p.checkpoint_peak_bytes), ("memplan", p.memplan_peak_bytes))}
        rows.append(dict(size=p.size, **totals, overhead=p.memplan_overhead,
                         fits={k for k, v in totals.items() if v is not None and v <= search.limit_bytes}))
    return rows


def measured_text(answer: FitAnswer, size: int) -> str:
    """The validated plan's measured overhead at the answer's `size` (against its no-recomputation plan, where it
    was timed beside it), with its interval; "-" at other sizes."""
    from memplan.flows.report import overhead_text

    validation = answer.validation
    if size != answer.search.memplan_largest or validation is None:
        return "-"
    return overhead_text(validation.limited_overhead(), validation.limited_interval()) or "-"


def markdown_fit(answer: FitAnswer) -> str:
    """The searches as a markdown table, with the answers and the validation."""
    search = answer.search

    def mib(x: int | None) -> str:
        return "-" if x is None else f"{x / MIB:.2f}"

    lines = [f"# memplan fit: {search.model} in {search.limit_bytes / MIB:.2f} MiB ({search.optimizer})", "",
             f"Largest {size_name(search)}: eager {search.eager_largest}, per-block checkpoint "
             f"{search.checkpoint_largest}, memplan ({search.solver}, predicted overhead at most "
             f"{search.max_overhead:.0%}) {search.memplan_largest}, "
             f"{answer.verdict}." + (f" Measured walk: {answer.walk}." if answer.walk else ""), "",
             f"| {size_name(search)} | eager MiB | per-block checkpoint MiB | memplan MiB | memplan overhead "
             "(predicted) | measured | fits |",
             "|---|---|---|---|---|---|---|"]
    for row in fit_rows(search):
        overhead = "-" if row["overhead"] is None else f"{row['overhead']:+.1%}"
        lines.append(f"| {row['size']} | {mib(row['eager'])} | {mib(row['checkpoint'])} | {mib(row['memplan'])} | "
                     f"{overhead} | {measured_text(answer, row['size'])} | {', '.join(sorted(row['fits'])) or 'none'} |")
    return "\n".join(lines) + "\n"


def fit_plot(search: FitSearch, path: Path) -> Path:
    """PNG of predicted peak memory (resident + step) against batch size, per schedule, with the limit."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4), dpi=100)
    rows = fit_rows(search)
    for kind, label in (("eager", "eager PyTorch"), ("checkpoint", "per-block checkpoint"),
                        ("memplan", f"memplan ({search.solver}, <= +{search.max_overhead:.0%})")):
        points = [(r["size"], r[kind] / MIB) for r in rows if r[kind] is not None]
        ax.plot([b for b, _ in points], [m for _, m in points], marker="o", label=label)
    ax.axhline(search.limit_bytes / MIB, color="red", linestyle="--", label="device memory limit")
    ax.set_xscale("log", base=2)
    ax.xaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
    ax.set_xlabel(size_name(search))
    ax.set_ylabel("predicted peak incl. resident (MiB)")
    ax.set_title(f"{search.model}: peak memory against {size_name(search)}")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    fig.savefig(partial, format="png")
    plt.close(fig)
    partial.replace(path)
    return path


def create_fit_artifacts(answer: FitAnswer) -> None:
    """The markdown table and the plot as Prefect artifacts."""
    from prefect.artifacts import create_image_artifact, create_markdown_artifact

    search, plot = answer.search, Path(answer.plot)
    create_markdown_artifact(markdown=markdown_fit(answer), key=artifact_key("memplan-fit", search.model),
                             description=f"{search.model}: the largest batch that fits the device memory limit.")
    data = base64.b64encode(plot.read_bytes()).decode()
    create_image_artifact(image_url=f"data:image/png;base64,{data}", key=artifact_key("memplan-fit", search.model, "plot"),
                          description=f"{search.model}: peak memory against batch size ({plot})")
