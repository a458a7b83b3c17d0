"""MILP backends: a model as sparse matrices, solved by HiGHS or Gurobi.

`solve_milp(model, options)` minimizes `c @ x + offset` subject to `row_lower <= A @ x <= row_upper`,
`col_lower <= x <= col_upper` and integrality. `result.backend` names the backend that ran.

Backends: "highs" always uses HiGHS; "gurobi" always uses Gurobi and raises RuntimeError when it
cannot take the model; "auto" (the default) uses Gurobi whenever the license present allows the
model, else HiGHS (logging why, once). `gurobi_license()` probes the license once per process:
"full" (no size limit), "size-limited" (the restricted license pip installs with gurobipy: at most
2000 variables and at most 2000 linear constraints, each checked on its own, any number of nonzeros;
a larger model fails with error 10010 at optimize) or "unavailable" (gurobipy missing or no license).
Gurobi sees a ranged row (finite `row_lower < row_upper`) as two constraints, so the size is counted
as Gurobi builds it (`gurobi_size`).

`solve_lp_sweep(model, scales, options)` solves the LP relaxation under a sequence of budgets with
HiGHS, each from the previous basis. Progress (incumbent, bound, gap over time) is logged to the
`memplan.solve` logger while solving and returned with the result.
"""
from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Iterator, Sequence

import numpy as np
import scipy.sparse as sp

log = logging.getLogger("memplan.solve")

BACKENDS = ("auto", "highs", "gurobi")
GUROBI_SIZE_LIMITED = 10010  # Gurobi's error number for a model too large for the license
GUROBI_SIZE_LIMIT = 2000  # variables, and separately linear constraints, a size-limited license allows
_LOGGED: set[str] = set()


@dataclass
class MilpModel:
    """min c @ x + offset s.t. row_lower <= A x <= row_upper, col_lower <= x <= col_upper,
    x[j] integer where integrality[j]. The solver sees c as given; objectives, bounds and progress
    are reported multiplied by `objective_scale` (build models with costs near 1 for numerics).
    `budget_rows` and `budget_cols` index the rows and columns whose upper bound is the memory budget
    (`solve_lp_sweep` scales them)."""

    c: np.ndarray
    A: sp.csr_matrix
    row_lower: np.ndarray
    row_upper: np.ndarray
    col_lower: np.ndarray
    col_upper: np.ndarray
    integrality: np.ndarray
    offset: float = 0.0
    objective_scale: float = 1.0
    budget_rows: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32))
    budget_cols: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32))

    @property
    def num_variables(self) -> int:
        return len(self.c)

    @property
    def num_constraints(self) -> int:
        return self.A.shape[0]

    @property
    def num_nonzeros(self) -> int:
        return self.A.nnz


@dataclass
class MilpOptions:
    """`gap`: relative optimality gap at which to stop; `mip_start`: a full assignment to try first;
    `relax`: solve the LP relaxation instead; `lp_method`: HiGHS `solver` option for LPs."""

    backend: str = "auto"
    time_limit: float | None = None
    gap: float = 1e-4
    threads: int | None = None
    mip_start: np.ndarray | None = None
    relax: bool = False
    lp_method: str = "choose"
    quiet: bool = True


@dataclass
class Progress:
    seconds: float
    incumbent: float | None
    bound: float | None

    @property
    def gap(self) -> float | None:
        return relative_gap(self.incumbent, self.bound)


@dataclass
class MilpResult:
    """`status`: "optimal" (proved within the gap), "time_limit" (stopped early, `x` is the incumbent
    or None), "infeasible", or "failed" (`message` says why). `bound` is a lower bound on the optimum."""

    status: str
    x: np.ndarray | None
    objective: float | None
    bound: float | None
    backend: str
    num_variables: int
    num_constraints: int
    num_nonzeros: int
    solve_seconds: float
    progress: list[Progress] = field(default_factory=list)
    message: str = ""

    @property
    def feasible(self) -> bool:
        return self.x is not None

    @property
    def gap(self) -> float | None:
        return relative_gap(self.objective, self.bound)

    def seconds_to_gap(self, gap: float) -> float | None:
        """First time the logged incumbent was proven within `gap` of the bound (or of the final bound)."""
        for p in self.progress:
            reached = p.gap                                  # None without a finite incumbent and bound
            if reached is not None and reached <= gap:
                return p.seconds
        return self.solve_seconds if self.status == "optimal" and (self.gap or 0.0) <= gap else None

    @property
    def seconds_to_first_feasible(self) -> float | None:
        return next((p.seconds for p in self.progress if p.incumbent is not None),
                    self.solve_seconds if self.feasible else None)


def relative_gap(incumbent: float | None, bound: float | None) -> float | None:
    """(incumbent - bound) / |incumbent|, 0 when both are 0; None without an incumbent or bound."""
    if incumbent is None or bound is None or not math.isfinite(incumbent) or not math.isfinite(bound):
        return None
    if incumbent == bound:
        return 0.0
    return max(0.0, (incumbent - bound) / max(abs(incumbent), 1e-12))


def solve_milp(model: MilpModel, options: MilpOptions) -> MilpResult:
    """Solve `model` with the backend `options.backend` names (module docstring)."""
    if options.backend not in BACKENDS:
        raise ValueError(f"backend {options.backend!r} is unknown; choose one of {', '.join(BACKENDS)}.")
    if options.backend != "highs" and _gurobi_takes(model, options.backend):
        try:
            return _solve_gurobi(model, options)
        except _GurobiUnavailable as exc:  # the probe said yes, but the license said no: trust the latter
            if options.backend == "gurobi":
                raise RuntimeError(f"backend 'gurobi' requested but {exc}; use backend 'highs' or 'auto', "
                                   f"or install a full Gurobi license.") from None
            _log_once(f"gurobi failed ({exc}); solving with highs")
    return _solve_highs(model, options)


# -- HiGHS ---------------------------------------------------------------------------------------

def _highs(model: MilpModel, options: MilpOptions):
    """A HiGHS instance holding `model` (its LP relaxation when `options.relax`), options set."""
    import highspy

    h = highspy.Highs()
    h.setOptionValue("output_flag", not options.quiet)
    h.setOptionValue("mip_rel_gap", float(options.gap))
    if options.threads is not None:     # HiGHS sizes one scheduler per calling thread at its first run and refuses
        highspy.Highs.resetThreadScheduler(True)   # ("already initialized") a later run asking for another count
        h.setOptionValue("threads", int(options.threads))
    if options.relax:
        h.setOptionValue("solver", options.lp_method)
    A = model.A.tocsc()
    A.sort_indices()
    integrality = np.zeros(model.num_variables, np.int32) if options.relax else model.integrality.astype(np.int32)
    status = h.passModel(
        model.num_variables, model.num_constraints, A.nnz, int(highspy.MatrixFormat.kColwise),
        int(highspy.ObjSense.kMinimize), float(model.offset), model.c.astype(np.float64),
        _highs_inf(model.col_lower), _highs_inf(model.col_upper), _highs_inf(model.row_lower),
        _highs_inf(model.row_upper), A.indptr.astype(np.int32), A.indices.astype(np.int32),
        A.data.astype(np.float64), integrality)
    if status == highspy.HighsStatus.kError:
        raise ValueError("HiGHS rejected the model (inconsistent bounds or matrix); this is a model-building bug.")
    return h


def _highs_inf(a: np.ndarray) -> np.ndarray:
    import highspy

    return np.nan_to_num(a, neginf=-highspy.kHighsInf, posinf=highspy.kHighsInf)


def _run_highs(h, model: MilpModel, relax: bool, time_limit: float | None,
               progress: list[Progress] | None = None) -> MilpResult:
    """Run `h` (within `time_limit` seconds) and read its result; `progress` holds what callbacks logged."""
    import highspy

    progress = [] if progress is None else progress
    h.setOptionValue("time_limit", float("inf") if time_limit is None else float(time_limit))
    start = time.perf_counter()
    h.run()
    seconds = time.perf_counter() - start
    ms = h.getModelStatus()
    info = h.getInfo()
    inf = highspy.kHighsInf
    scale = model.objective_scale
    has_solution = info.primal_solution_status == highspy.SolutionStatus.kSolutionStatusFeasible
    x = np.array(h.getSolution().col_value) if has_solution else None
    objective = info.objective_function_value * scale if has_solution else None
    if relax:
        bound = objective if ms == highspy.HighsModelStatus.kOptimal else None
    else:
        bound = info.mip_dual_bound * scale if abs(info.mip_dual_bound) < inf else None
    M = highspy.HighsModelStatus
    if ms == M.kOptimal:
        status = "optimal"
    elif ms in (M.kInfeasible, M.kUnboundedOrInfeasible):
        status, x, objective = "infeasible", None, None
    elif ms in (M.kTimeLimit, M.kIterationLimit, M.kSolutionLimit, M.kInterrupt):
        status = "time_limit"
    else:
        status = "failed"
    if objective is not None and (not progress or (progress[-1].incumbent, progress[-1].bound) != (objective, bound)):
        progress.append(Progress(seconds, objective, bound))
    return MilpResult(status, x, objective, bound, "highs", model.num_variables, model.num_constraints,
                      model.num_nonzeros, seconds, progress, h.modelStatusToString(ms))


def _solve_highs(model: MilpModel, options: MilpOptions) -> MilpResult:
    import highspy

    h = _highs(model, options)
    progress: list[Progress] = []
    scale = model.objective_scale
    inf = highspy.kHighsInf
    start = time.perf_counter()

    def record(event) -> None:
        out = event.data_out
        incumbent = out.mip_primal_bound * scale if abs(out.mip_primal_bound) < inf else None
        bound = out.mip_dual_bound * scale if abs(out.mip_dual_bound) < inf else None
        last = progress[-1] if progress else None
        if last is None or (incumbent, bound) != (last.incumbent, last.bound):
            progress.append(Progress(time.perf_counter() - start, incumbent, bound))
            log.info("highs %7.1fs  incumbent %s  bound %s  gap %s", progress[-1].seconds, _fmt(incumbent),
                     _fmt(bound), _fmt(progress[-1].gap))

    if not options.relax:
        h.cbMipImprovingSolution.subscribe(record)
        h.cbMipLogging.subscribe(record)
        h.cbMipInterrupt.subscribe(record)      # also fires during the root node: bound moves while quiet
        if options.mip_start is not None:
            h.setSolution(model.num_variables, np.arange(model.num_variables, dtype=np.int32),
                          np.asarray(options.mip_start, dtype=np.float64))
    return _run_highs(h, model, options.relax, options.time_limit, progress)


def solve_lp_sweep(model: MilpModel, scales: Sequence[float], options: MilpOptions) -> Iterator[MilpResult]:
    """The LP relaxation of `model` with the upper bounds of its budget rows and columns multiplied by
    each of `scales` in turn, by HiGHS. Each LP starts from the previous one's basis: a smaller budget
    leaves it dual feasible, so the dual simplex re-solves it in a fraction of the first LP's time.
    `options.time_limit` bounds the whole sweep (it stops early when the time is up); `options.relax`
    is implied."""
    h = _highs(model, MilpOptions(**{**options.__dict__, "relax": True, "mip_start": None}))
    rows, cols = model.budget_rows.astype(np.int32), model.budget_cols.astype(np.int32)
    deadline = None if options.time_limit is None else time.perf_counter() + options.time_limit
    for scale in scales:
        h.changeRowsBounds(len(rows), rows, _highs_inf(model.row_lower[rows]), _highs_inf(model.row_upper[rows] * scale))
        h.changeColsBounds(len(cols), cols, _highs_inf(model.col_lower[cols]), _highs_inf(model.col_upper[cols] * scale))
        remaining = None if deadline is None else deadline - time.perf_counter()
        if remaining is not None and remaining <= 0:
            return
        yield _run_highs(h, model, True, remaining)


# -- Gurobi --------------------------------------------------------------------------------------

class _GurobiUnavailable(Exception):
    pass


def _log_once(message: str) -> None:
    if message not in _LOGGED:
        _LOGGED.add(message)
        log.info(message)


@dataclass(frozen=True)
class GurobiLicense:
    """What Gurobi allows here: `kind` is "full", "size-limited" (`GUROBI_SIZE_LIMIT` variables and
    as many linear constraints) or "unavailable"; `reason` says why when it is not "full"."""

    kind: str
    reason: str = ""


@lru_cache(maxsize=1)
def gurobi_license() -> GurobiLicense:
    """Probe the Gurobi license once: an empty model one variable above the size limit optimizes
    under a full license and fails with error 10010 under a size-limited one."""
    try:
        import gurobipy as gp
    except ImportError:
        return GurobiLicense("unavailable", "gurobipy is not installed")
    try:
        with gp.Env(params={"OutputFlag": 0}) as env, gp.Model(env=env) as m:
            m.addMVar(GUROBI_SIZE_LIMIT + 1)
            m.optimize()
    except gp.GurobiError as exc:
        if exc.errno == GUROBI_SIZE_LIMITED:
            return GurobiLicense("size-limited", f"the Gurobi license is size-limited to {GUROBI_SIZE_LIMIT} "
                                                 f"variables and {GUROBI_SIZE_LIMIT} linear constraints")
        return GurobiLicense("unavailable", f"no usable Gurobi license (error {exc.errno}: {exc})")
    return GurobiLicense("full")


def _gurobi_rows(model: MilpModel) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Masks of the rows Gurobi gets as "=", "<" and ">" constraints (a ranged row is one "<" and one ">")."""
    lo, up = model.row_lower, model.row_upper
    eq = lo == up
    return eq, ~eq & np.isfinite(up), ~eq & np.isfinite(lo)


def gurobi_size(model: MilpModel) -> tuple[int, int]:
    """(variables, linear constraints) of `model` as Gurobi builds it."""
    return model.num_variables, int(sum(mask.sum() for mask in _gurobi_rows(model)))


def _gurobi_takes(model: MilpModel, backend: str) -> bool:
    """Whether `backend` ("auto" or "gurobi") should run Gurobi on `model`. "auto" logs why not (once
    per reason); "gurobi" raises RuntimeError instead."""
    lic = gurobi_license()
    if lic.kind == "full":
        return True
    nvars, ncons = gurobi_size(model)
    if lic.kind == "size-limited" and nvars <= GUROBI_SIZE_LIMIT and ncons <= GUROBI_SIZE_LIMIT:
        return True
    size = f"{nvars} variables and {ncons} linear constraints"
    if backend == "gurobi":
        if lic.kind == "unavailable":
            raise RuntimeError(f"backend 'gurobi' requested but {lic.reason}; use backend 'highs' or 'auto', "
                               f"or install gurobipy with a Gurobi license.")
        raise RuntimeError(
            f"backend 'gurobi' requested, but the model has {size} and {lic.reason} (the license pip "
            f"installs with gurobipy), so Gurobi would refuse it (error {GUROBI_SIZE_LIMITED}). Use backend "
            f"'highs', or 'auto' (Gurobi for models within the limit, HiGHS above it), or install a full "
            f"Gurobi license (academic or commercial, found through GRB_LICENSE_FILE).")
    if lic.kind == "unavailable":
        _log_once(f"gurobi unavailable ({lic.reason}); solving with highs")
    else:
        _log_once(f"model has {size}, above the size-limited Gurobi license's {GUROBI_SIZE_LIMIT} variables "
                  f"and {GUROBI_SIZE_LIMIT} linear constraints; solving with highs")
    return False


def _solve_gurobi(model: MilpModel, options: MilpOptions) -> MilpResult:
    try:
        import gurobipy as gp
        from gurobipy import GRB
    except ImportError:
        raise _GurobiUnavailable("gurobipy is not installed") from None
    try:
        env = gp.Env(params={"OutputFlag": 0 if options.quiet else 1})
        m = gp.Model(env=env)
        vtype = GRB.CONTINUOUS if options.relax else np.where(model.integrality, GRB.INTEGER, GRB.CONTINUOUS)
        x = m.addMVar(model.num_variables, lb=model.col_lower, ub=model.col_upper, obj=model.c, vtype=vtype)
        m.ObjCon = model.offset
        lo, up = model.row_lower, model.row_upper
        A = model.A.tocsr()
        eq, upper, lower = _gurobi_rows(model)
        for mask, sense, rhs in ((eq, "=", up), (upper, "<", up), (lower, ">", lo)):
            if mask.any():
                m.addMConstr(A[mask], x, sense, rhs[mask])
        m.Params.MIPGap = options.gap
        if options.time_limit is not None:
            m.Params.TimeLimit = options.time_limit
        if options.threads is not None:
            m.Params.Threads = options.threads
        if options.mip_start is not None and not options.relax:
            # gurobipy's stub declares MVar.Start a float, but an MVar's attributes are arrays of its shape
            x.Start = options.mip_start  # type: ignore[assignment]
        progress: list[Progress] = []
        start = time.perf_counter()

        def callback(mdl, where):
            if where == GRB.Callback.MIP:
                best, bound = mdl.cbGet(GRB.Callback.MIP_OBJBST), mdl.cbGet(GRB.Callback.MIP_OBJBND)
                incumbent = best * model.objective_scale if best < GRB.INFINITY else None
                bound *= model.objective_scale
                if not progress or (incumbent, bound) != (progress[-1].incumbent, progress[-1].bound):
                    progress.append(Progress(time.perf_counter() - start, incumbent, bound))
                    log.info("gurobi %7.1fs  incumbent %s  bound %s  gap %s", progress[-1].seconds,
                             _fmt(incumbent), _fmt(bound), _fmt(progress[-1].gap))

        m.optimize(callback)
    except gp.GurobiError as exc:
        if exc.errno == GUROBI_SIZE_LIMITED:
            raise _GurobiUnavailable(f"the Gurobi license is size-limited (error {exc.errno})") from None
        if exc.errno in (10009, 10032):  # no license / license expired
            raise _GurobiUnavailable(f"no usable Gurobi license (error {exc.errno})") from None
        raise
    seconds = time.perf_counter() - start
    has_solution = m.SolCount > 0
    sol = np.array(x.X) if has_solution else None
    objective = m.ObjVal * model.objective_scale if has_solution else None
    bound = m.ObjBound * model.objective_scale if not options.relax and m.Status in (GRB.OPTIMAL, GRB.TIME_LIMIT) else (
        objective if m.Status == GRB.OPTIMAL else None)
    if m.Status == GRB.OPTIMAL:
        status = "optimal"
    elif m.Status in (GRB.INFEASIBLE, GRB.INF_OR_UNBD):
        status, sol, objective = "infeasible", None, None
    elif m.Status in (GRB.TIME_LIMIT, GRB.INTERRUPTED, GRB.NODE_LIMIT, GRB.SOLUTION_LIMIT):
        status = "time_limit"
    else:
        status = "failed"
    if objective is not None:
        progress.append(Progress(seconds, objective, bound))
    return MilpResult(status, sol, objective, bound, "gurobi", model.num_variables, model.num_constraints,
                      model.num_nonzeros, seconds, progress, f"gurobi status {m.Status}")


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.6g}"
