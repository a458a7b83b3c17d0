"""Helpers shared by the pipeline tests: a small valid config, a tiny plan and a validation record."""

from __future__ import annotations

import copy
from typing import Any

import pytest

CONFIG: dict[str, Any] = {
    "models": [
        {
            "name": "resnet18",
            "torchvision": "resnet18",
            "kwargs": {"num_classes": 10},
            "batch_sizes": [8, 16],
            "inputs": [{"shape": [3, 64, 64]}, {"shape": [], "dtype": "int64", "high": 10}],
        },
        {
            "name": "mlp",
            "factory": "torch.nn:Linear",
            "kwargs": {"in_features": 4, "out_features": 3},
            "loss": "mse",
            "inputs": [{"shape": [4]}, {"shape": [3]}],
        },
    ],
    "plans": [
        {"solver": "checkmate", "budgets": ["70%", 0.5]},
        {"solver": "chen-sqrt-n", "budgets": ["1 GiB"], "models": ["mlp"]},
    ],
}


@pytest.fixture
def config_data() -> dict[str, Any]:
    """A fresh deep copy of a valid parsed pipeline.toml (safe to mutate)."""
    return copy.deepcopy(CONFIG)


@pytest.fixture
def toy_graph():
    """The `_toy_graph()` operator graph."""
    return _toy_graph()


@pytest.fixture
def make_plan():
    """Factory of plans for the toy graph (see `_toy_plan`)."""
    return _toy_plan


@pytest.fixture
def make_validation():
    """Factory of validation records (see `_validation`)."""
    return _validation


def _toy_graph():
    """Operator graph of y = relu(x @ w), loss sum(y), gradient of w: 4 nodes, 6 values."""
    from memplan.runtime.format.graph import Node, OpGraph, Value

    def value(i, kind, name, producer, nbytes=64, shape=(4, 4)):
        return Value(i, nbytes, shape, "float32", kind, name, producer)

    values = [value(0, "input", "x", None), value(1, "param", "w", None), value(2, "activation", "mm", 0),
              value(3, "activation", "relu", 1), value(4, "output", "loss", 2, 4, ()), value(5, "gradient", "w.grad", 3)]
    nodes = [Node(0, "mm", ("aten.mm.default",), "forward", (0, 1), (2,)),
             Node(1, "relu", ("aten.relu.default",), "forward", (2,), (3,)),
             Node(2, "sum", ("aten.sum.default",), "loss", (3,), (4,)),
             Node(3, "mm_1", ("aten.mm.default",), "backward", (0, 3), (5,))]
    return OpGraph(values, nodes, [4, 5])


def _toy_plan(created_at: str = "2026-01-01T00:00:00+00:00", budget_bytes: int = 200):
    """A plan for `_toy_graph()` that frees relu after the loss and recomputes it for the backward."""
    from memplan.runtime.format.plan import Plan

    return Plan(
        _toy_graph().fingerprint,
        [{"compute": 0}, {"compute": 1}, {"compute": 2}, {"free": 3}, {"compute": 1}, {"compute": 3}],
        predicted={"peak_bytes": 196, "constant_bytes": 128, "compute_cost": 5.0, "time_ms": None},
        provenance={"solver": "checkmate", "budget_bytes": budget_bytes, "backend": "highs", "gap": 0.0,
                    "device": "cpu", "created_at": created_at, "memplan_version": "0.1.0"},
    )


def _validation(of: Any, passed: bool = True, **changes: Any):
    """A `Validated` record as `validate_plan` returns it for the plan `of`."""
    from memplan.runtime.format.plan import plan_id
    from memplan.tasks.records import Validated

    fields = dict(plan_id=plan_id(of), passed=passed, reasons=[] if passed else ["grad:w differs from eager by up to 0.5 (rtol 0.0001, atol 1e-05)"],
                  device="cpu", device_name="cpu", budget_bytes=200, predicted_peak_bytes=196,
                  measured_peak_bytes=190, eager_peak_bytes=260, measured_step_ms=2.0, eager_step_ms=1.6,
                  overhead=0.25, loss=1.0, eager_loss=1.0, max_abs_error=0.0, tensors_compared=2)
    return Validated(**(fields | changes))
