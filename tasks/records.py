"""The typed records that travel between the pipeline's stages (torch-free pydantic models).

Each stage returns one record: trace a `Traced`, profile a `Profiled`, reference a `Referenced`, solve a
`Solved`, validate a `Validated`, publish a `Published`; where a stage raised for a cell, that cell gets a
`StageError` instead and the run goes on with the others (flows/plan.py). Prefect persists them as JSON
(flows/steps.py, never pickles) and gives them back typed; the run's outcome table (flows/report.py) is built from
them.
"""

from __future__ import annotations

from typing import Any, Callable, Literal, TypeVar

from pydantic import BaseModel, ConfigDict


class Record(BaseModel):
    """A stage result: immutable, JSON in and out."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    def to_json(self) -> dict[str, Any]:
        return self.model_dump(mode="json")

    @classmethod
    def from_json(cls, data: Any) -> "Record":
        return cls.model_validate(data)


class Traced(Record):
    """A stored operator graph and the numbers a report needs about it; `form`: the plans it is captured for
    ("policy": as eager PyTorch runs the step, `runtime.policy.apply.capture_eager`)."""

    path: str
    fingerprint: str
    model: str
    batch_size: int
    nodes: int
    values: int
    constant_bytes: int
    form: Literal["executor", "policy"] = "executor"


class Profiled(Record):
    """One profiling run written to the store: its id, device key, graph and rows, and its Parquet file."""

    run_id: str
    device: str
    fingerprint: str
    rows: int
    path: str


EAGER = "eager"
"""The reference kind of eager PyTorch's own step (tasks/fit/reference.py lists the others)."""


class Referenced(Record):
    """The reference step of one model x batch x device x seed (eager PyTorch unless `kind` says otherwise:
    under a device memory limit, the first reference that fits it, tasks/fit/reference.py): its loss,
    gradients and buffers after one step, and with `optimizer` the parameters after that optimizer's update
    (for plans with the optimizer inside the step), in the safetensors file `path` (`absent`: the gradients
    that do not exist), its measured peak and its median step time. `rtol` / `atol`: the least tolerance a
    comparison with it needs (micro-batches round differently). `float64_tensors`: how many of its tensors the file
    also holds the float64 step's distance to (tasks/validate/reference.py; 0: none, plans are judged by rtol / atol alone),
    and `float64_skipped` why there is no float64 step where it could not run."""

    kind: str
    optimizer: str | None = None
    rtol: float = 0.0
    atol: float = 0.0
    path: str
    model: str
    batch_size: int
    device: str
    device_name: str
    seed: int
    loss: float
    peak_bytes: int
    step_ms: float
    tensors: int
    absent: list[str]
    float64_tensors: int = 0
    float64_skipped: str | None = None


class Candidate(Record):
    """One rung of a `max_overhead` cell's ladder (tasks/validate/overhead.py): a schedule the budget search found,
    written as a plan, with its budget, predicted peak and predicted overhead over the no-recomputation schedule."""

    plan_path: str
    plan_id: str
    budget_bytes: int
    predicted_peak_bytes: int
    predicted_overhead: float


class Solved(Record):
    """A solver's answer for one matrix cell, with the numbers the report needs. A `max_overhead` cell also
    carries its `candidates` (the ladder, most memory first, the predicted choice among them) and the
    no-recomputation plan its measured overhead is taken against (`no_recompute_path`, none in the policy
    form, whose no-recomputation step is eager PyTorch's). A compiled policy cell's `measured_search` says what its
    search by peaks under torch.compile measured and chose (tasks/compiled/policy_cell.py; empty where none ran)."""

    solver: str
    status: str
    feasible: bool
    budget_bytes: int
    checkpoint_all_peak_bytes: int
    checkpoint_all_cost: float
    predicted_peak_bytes: int | None
    arena_bytes: int | None
    objective: float | None
    gap: float | None
    solve_seconds: float
    backend: str | None
    min_budget_lower_bound: int | None
    smallest_feasible_budget: int | None
    message: str
    plan_path: str | None
    plan_id: str | None
    profile_run_id: str | None
    max_overhead: float | None = None
    candidates: list[Candidate] = []
    no_recompute_path: str | None = None
    no_recompute_id: str | None = None
    measured_search: str = ""


class Validated(Record):
    """Outcome of running one plan (content address `plan_id`) against eager PyTorch on one device."""

    plan_id: str
    passed: bool
    reasons: list[str]
    device: str
    device_name: str
    budget_bytes: int
    predicted_peak_bytes: int
    measured_peak_bytes: int
    eager_peak_bytes: int
    measured_step_ms: float
    eager_step_ms: float
    overhead: float
    loss: float
    eager_loss: float
    max_abs_error: float
    tensors_compared: int
    arena_peak_bytes: int | None = None
    arena_step_ms: float | None = None
    arena_bytes_not_placed: int | None = None
    overhead_interval: list[float] | None = None
    timed_steps: int | None = None
    reference: str = "eager"               # the step compared with: eager, or per-block checkpoint under a limit
    limit_bytes: int | None = None         # the device memory limit the plan was checked against
    no_recompute_step_ms: float | None = None       # with a no-recomputation plan timed in the same rounds:
    overhead_vs_no_recompute: float | None = None   # the plan's overhead against it (median of per-round ratios)
    overhead_vs_no_recompute_interval: list[float] | None = None
    compiled_peak_bytes: int | None = None          # a compiled policy plan's peak under torch.compile
    float64_tensors: int = 0               # tensors also judged by their distance to the float64 step (tasks/validate/stage.py)

    def limited_overhead(self) -> float:
        """The overhead a `max_overhead` limit is judged on: against the no-recomputation plan where it was
        timed, else against the reference step."""
        return self.overhead if self.overhead_vs_no_recompute is None else self.overhead_vs_no_recompute

    def limited_interval(self) -> list[float] | None:
        """The 95% interval of `limited_overhead`."""
        return self.overhead_interval if self.overhead_vs_no_recompute is None else self.overhead_vs_no_recompute_interval

    def explain(self, name: str, shown: int = 3) -> str:
        """One paragraph saying why plan `name` failed (the first `shown` reasons)."""
        more = len(self.reasons) - shown
        return (f"plan {name} failed validation on {self.device}: " + "; ".join(self.reasons[:shown])
                + (f"; and {more} more" if more > 0 else "") + ".")


MESSAGE_CHARS = 1200
"""The most characters of an error's message a `StageError` keeps, its start and its end (where memplan's messages
say the fix); a CheckpointError lists every tensor."""


class StageError(Record):
    """An error a stage raised for one cell (or for the model and batch size its cells share): the stage, the
    error's type and its message on one line, and the plan it ran, where it ran one (`plan_id`)."""

    stage: str
    error: str
    message: str
    plan_id: str | None = None

    @classmethod
    def of(cls, stage: str, exc: Exception, plan_id: str | None = None) -> "StageError":
        """The record of `exc` raised in `stage`, its message on one line and at most `MESSAGE_CHARS` long."""
        text = " ".join(str(exc).split())
        if len(text) > MESSAGE_CHARS:
            text = f"{text[:MESSAGE_CHARS // 2]} … {text[-MESSAGE_CHARS // 2:]}"
        return cls(stage=stage, error=type(exc).__name__, message=text, plan_id=plan_id)

    def explain(self, name: str) -> str:
        """One paragraph saying that cell `name` failed, in which stage and why (ending in a full stop)."""
        text = f"{name} failed in its {self.stage} stage: {self.error}: {self.message or '(no message)'}"
        return text if text.endswith((".", "!", "?")) else f"{text}."


T = TypeVar("T")


def attempt(stage: str, run: Callable[..., T], *args: Any, plan_id: str | None = None, **kwargs: Any) -> T | StageError:
    """`run(*args, **kwargs)`, or the `StageError` of `stage` for the Exception it raises (KeyboardInterrupt and
    SystemExit are no Exception: they still stop the run)."""
    try:
        return run(*args, **kwargs)
    except Exception as exc:
        return StageError.of(stage, exc, plan_id)


class Published(Record):
    """Result of `publish`: where the plan is and whether this call wrote anything."""

    plan_id: str
    path: str
    alias_path: str
    changed: bool
