import itertools

import numpy as np
import pytest
import scipy.sparse as sp

import memplan.tasks.solve.core.milp as milp
from memplan.tasks.solve.core.milp import (GUROBI_SIZE_LIMIT, MilpModel, MilpOptions, gurobi_license, gurobi_size, relative_gap,
                              solve_lp_sweep, solve_milp)

WEIGHTS = np.array([12, 7, 11, 8, 9, 6, 5, 14])
VALUES = np.array([24, 13, 23, 15, 16, 11, 9, 30])
CAPACITY = 31


def _knapsack(capacity: int = CAPACITY) -> MilpModel:
    """max values @ x s.t. weights @ x <= capacity, x binary (as a minimization of -values)."""
    n = len(WEIGHTS)
    return MilpModel(c=-VALUES.astype(float), A=sp.csr_matrix(WEIGHTS[None, :].astype(float)),
                     row_lower=np.array([-np.inf]), row_upper=np.array([float(capacity)]),
                     col_lower=np.zeros(n), col_upper=np.ones(n), integrality=np.ones(n, bool))


def _brute_force() -> int:
    return max(int(VALUES @ np.array(x)) for x in itertools.product((0, 1), repeat=len(WEIGHTS))
               if WEIGHTS @ np.array(x) <= CAPACITY)


def test_highs_finds_the_brute_force_optimum():
    result = solve_milp(_knapsack(), MilpOptions(backend="highs"))
    assert result.status == "optimal" and result.objective == -_brute_force()
    assert WEIGHTS @ np.round(result.x) <= CAPACITY and result.gap == 0.0
    assert (result.num_variables, result.num_constraints, result.num_nonzeros) == (8, 1, 8)
    assert result.progress and result.progress[-1].incumbent == result.objective


def test_a_solve_with_other_threads_than_the_first_still_solves():
    """HiGHS keeps the scheduler of a thread's first run; a later run asking for other threads once failed
    (status "Not Set", no solution), which made a 1-thread solve after any default one return nothing."""
    assert solve_milp(_knapsack(), MilpOptions(backend="highs")).status == "optimal"
    for threads in (1, 2, 1):
        result = solve_milp(_knapsack(), MilpOptions(backend="highs", threads=threads))
        assert result.status == "optimal" and result.objective == -_brute_force(), threads


def test_lp_relaxation_bounds_the_optimum():
    result = solve_milp(_knapsack(), MilpOptions(backend="highs", relax=True))
    assert result.status == "optimal" and result.bound == result.objective < -_brute_force()
    assert np.any((result.x > 1e-6) & (result.x < 1 - 1e-6))


def test_objective_scale_is_applied_to_results():
    model = _knapsack()
    model.objective_scale = 10.0
    result = solve_milp(model, MilpOptions(backend="highs"))
    assert result.objective == -10 * _brute_force() and result.bound == result.objective


def test_infeasible_model():
    model = _knapsack()
    model.col_lower[:] = 1.0
    result = solve_milp(model, MilpOptions(backend="highs"))
    assert result.status == "infeasible" and result.x is None and not result.feasible


def test_mip_start_is_the_first_incumbent():
    start = np.zeros(len(WEIGHTS))
    start[[0, 1]] = 1.0
    result = solve_milp(_knapsack(), MilpOptions(backend="highs", mip_start=start))
    assert result.progress[0].incumbent <= -(VALUES[0] + VALUES[1])
    assert result.objective == -_brute_force()


def _licensed_gurobi() -> str:
    """The license kind, skipping the test when gurobipy is missing or has no license."""
    pytest.importorskip("gurobipy")
    kind = gurobi_license().kind
    if kind == "unavailable":
        pytest.skip(gurobi_license().reason)
    return kind


def _pairs(n_pairs: int, ranged: bool = False) -> tuple[MilpModel, float]:
    """2 * n_pairs binaries, x[2i] + x[2i+1] <= 1, maximizing sum_j (j + 1) x[j]: the optimum takes
    the odd-indexed one of each pair, -(2 + 4 + ... + 2 n_pairs) in closed form. `ranged` makes each
    row 0 <= ... <= 1 (two Gurobi constraints)."""
    n = 2 * n_pairs
    A = sp.kron(sp.eye(n_pairs), np.ones((1, 2)), format="csr")
    lower = np.zeros(n_pairs) if ranged else np.full(n_pairs, -np.inf)
    model = MilpModel(c=-np.arange(1.0, n + 1), A=A, row_lower=lower, row_upper=np.ones(n_pairs),
                      col_lower=np.zeros(n), col_upper=np.ones(n), integrality=np.ones(n, bool))
    return model, -float(n_pairs * (n_pairs + 1))


def test_auto_solves_a_small_model_with_gurobi():
    _licensed_gurobi()
    for backend in ("auto", "gurobi"):
        result = solve_milp(_knapsack(), MilpOptions(backend=backend))
        assert result.backend == "gurobi" and result.status == "optimal"
        assert result.objective == pytest.approx(-_brute_force()) and WEIGHTS @ np.round(result.x) <= CAPACITY


def test_the_size_limit_is_checked_on_variables_and_constraints_as_gurobi_builds_them():
    at_limit, optimum = _pairs(GUROBI_SIZE_LIMIT // 2)
    assert gurobi_size(at_limit) == (GUROBI_SIZE_LIMIT, GUROBI_SIZE_LIMIT // 2)
    ranged, _ = _pairs(GUROBI_SIZE_LIMIT // 2 + 1, ranged=True)
    assert gurobi_size(ranged) == (GUROBI_SIZE_LIMIT + 2, GUROBI_SIZE_LIMIT + 2)
    if _licensed_gurobi() == "size-limited":  # exactly at the limit is allowed
        result = solve_milp(at_limit, MilpOptions(backend="auto"))
        assert result.backend == "gurobi" and result.objective == pytest.approx(optimum)


def test_auto_takes_highs_above_the_license_limit(caplog, monkeypatch):
    model, optimum = _pairs(1500)                              # 3000 variables, 1500 constraints
    monkeypatch.setattr(milp, "_LOGGED", set())
    with caplog.at_level("INFO", logger="memplan.solve"):
        result = solve_milp(model, MilpOptions(backend="auto"))
    assert result.status == "optimal" and result.objective == pytest.approx(optimum)
    assert result.backend == ("gurobi" if gurobi_license().kind == "full" else "highs")
    if gurobi_license().kind == "size-limited":
        assert any("3000 variables" in r.message and str(GUROBI_SIZE_LIMIT) in r.message for r in caplog.records)


def test_forcing_gurobi_above_the_license_limit_raises():
    if _licensed_gurobi() != "size-limited":
        pytest.skip("the Gurobi license is not size-limited")
    model, _ = _pairs(1500)
    with pytest.raises(RuntimeError, match=r"3000 variables.*size-limited to 2000.*backend 'highs'.*full Gurobi"):
        solve_milp(model, MilpOptions(backend="gurobi"))


def test_unknown_backend_is_refused():
    with pytest.raises(ValueError, match="backend 'cplex' is unknown"):
        solve_milp(_knapsack(), MilpOptions(backend="cplex"))


def test_relative_gap():
    assert relative_gap(105.0, 100.0) == pytest.approx(5 / 105)
    assert relative_gap(0.0, 0.0) == 0.0
    assert relative_gap(None, 1.0) is None and relative_gap(1.0, None) is None


def _fractional_knapsack(capacity: float) -> float:
    """The LP optimum of the knapsack in closed form: items by value density, the last one split."""
    total, room = 0.0, capacity
    for i in np.argsort(-VALUES / WEIGHTS, kind="stable"):
        take = min(1.0, room / WEIGHTS[i])
        total, room = total + take * VALUES[i], room - take * WEIGHTS[i]
        if room <= 0:
            break
    return total


def test_lp_sweep_solves_each_scaled_budget_like_a_fresh_lp():
    model = _knapsack()
    model.budget_rows = np.array([0])                          # the capacity row is the budget
    scales = [1.0, 0.7, 0.4, 0.1]
    results = list(solve_lp_sweep(model, scales, MilpOptions()))
    assert [r.status for r in results] == ["optimal"] * len(scales)
    for scale, result in zip(scales, results):
        assert result.objective == pytest.approx(-_fractional_knapsack(scale * CAPACITY), rel=1e-9)
        assert WEIGHTS @ result.x <= scale * CAPACITY + 1e-9


def test_lp_sweep_reports_infeasible_budgets_and_stops_at_its_time_limit():
    model = _knapsack()
    model.col_lower = np.full(len(VALUES), 0.25)               # every item at least a quarter in
    model.budget_rows = np.array([0])
    needed = 0.25 * WEIGHTS.sum() / CAPACITY
    statuses = [r.status for r in solve_lp_sweep(model, [1.0, needed * 0.9], MilpOptions())]
    assert statuses == ["optimal", "infeasible"]
    assert list(solve_lp_sweep(model, [1.0, 0.5], MilpOptions(time_limit=0.0))) == []


def test_without_gurobi_auto_takes_highs_and_gurobi_raises(monkeypatch):
    missing = milp.GurobiLicense("unavailable", "gurobipy is not installed")
    monkeypatch.setattr(milp, "gurobi_license", lambda: missing)
    assert solve_milp(_knapsack(), MilpOptions(backend="auto")).backend == "highs"
    with pytest.raises(RuntimeError, match="gurobipy is not installed"):
        solve_milp(_knapsack(), MilpOptions(backend="gurobi"))
