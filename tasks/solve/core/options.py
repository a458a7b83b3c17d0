"""Solver registry entries and their typed options.

Each solver declares its options as a frozen dataclass whose fields carry a default and a one-line
`help` (field metadata). `parse_options` checks a mapping from `pipeline.toml` (`[[plans]] options`) or
from `memplan solve --option KEY=VALUE` against it, with one error naming the key, the value and what
the solver takes; `describe_options` feeds `memplan solve --help` and docs/solvers.md.
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Literal, Mapping, get_args, get_origin

from pydantic import TypeAdapter, ValidationError

from memplan.tasks.solve.core.problem import Problem
from memplan.tasks.solve.core.solution import Solution, SolveOptions


class OptionError(ValueError):
    """Solver options that the solver does not declare, or of the wrong type."""


@dataclass(frozen=True)
class OptionInfo:
    name: str
    type: str
    default: Any
    help: str


@dataclass(frozen=True)
class SolverSpec:
    """A registered solver: `run(problem, budget_bytes, options) -> Solution`, a one-line `summary`, the
    dataclass of its `options` (None: it takes none), whether it chooses implementation `variants`
    (otherwise it sees `problem.without_variants()`) and whether its answers are checked against the
    cheap solvers' (`portfolio`, for the MILP/LP solvers); whether its schedules are ones selective
    checkpointing runs (`policy_form`, runtime/policy/form.py: its plans may take the policy form,
    `runtime.apply`); `peers`: the solvers it may call (warm starts, blocks), handed to it in
    `SolveOptions.peers`. Calling the spec checks the options first."""

    name: str
    run: Callable[[Problem, int, SolveOptions], Solution]
    summary: str
    options: type | None = None
    variants: bool = False
    portfolio: bool = False
    policy_form: bool = False
    peers: Mapping[str, Callable[..., Any]] = field(default_factory=dict, compare=False, hash=False)

    def __call__(self, problem: Problem, budget_bytes: int, options: SolveOptions | None = None) -> Solution:
        options = options or SolveOptions()
        params = parse_options(self, options.params)
        return self.run(self.problem_for(problem), int(budget_bytes), replace(options, params=params, peers=self.peers))

    def problem_for(self, problem: Problem) -> Problem:
        """What the solver sees: the problem, without variants unless it chooses them."""
        return problem if self.variants else problem.without_variants()


def parse_options(spec: SolverSpec, values: Any, where: str = "options") -> Any:
    """`values` (None, a mapping, or an instance of the spec's options class) as the solver's typed
    options; `where` names the source in errors (e.g. `plans[2].options`, `--option`)."""
    if spec.options is None:
        if values:
            raise OptionError(f"{where or 'options'}: solver {spec.name} takes no options, got {dict(values)!r}; remove them.")
        return None
    if values is None:
        return spec.options()
    if isinstance(values, spec.options):
        return values
    if not isinstance(values, Mapping):
        raise OptionError(f"{where or 'options'} must be a table of option = value, got {values!r:.80}.")
    known = {f.name for f in dataclasses.fields(spec.options)}
    path = (lambda key: f"{where}.{key}" if where else f"option {key}")  # noqa: E731
    for key in values:
        if key not in known:
            raise OptionError(f"{path(key)}: solver {spec.name} has no option {key!r}; it takes "
                              f"{_listing(spec)}.")
    try:
        return TypeAdapter(spec.options).validate_python(dict(values))
    except ValidationError as exc:
        err = exc.errors()[0]
        key = err["loc"][0] if err["loc"] else "?"
        raise OptionError(f"{path(key)} = {values.get(key)!r}: {err['msg']}; solver {spec.name} takes "
                          f"{_listing(spec)}.") from None


def describe_options(spec: SolverSpec) -> list[OptionInfo]:
    """Name, type, default and help of each option of the solver."""
    if spec.options is None:
        return []
    hints = typing.get_type_hints(spec.options)
    return [OptionInfo(f.name, type_name(hints[f.name]), f.default, f.metadata.get("help", ""))
            for f in dataclasses.fields(spec.options)]


def type_name(tp: Any) -> str:
    """A readable type: `'budget' | 'memory'`, `list of float`, `int`."""
    origin = get_origin(tp)
    if origin is Literal:
        return " or ".join(repr(a) for a in get_args(tp))
    args = get_args(tp)
    if origin is tuple and args[-1:] != (Ellipsis,):
        return "[" + ", ".join(type_name(a) for a in args) + "]"
    if origin in (tuple, list):
        return f"list of {type_name(args[0])}"
    return getattr(tp, "__name__", str(tp))


def _listing(spec: SolverSpec) -> str:
    return "; ".join(f"{o.name} ({o.type}, default {o.default!r})" for o in describe_options(spec)) or "no options"
