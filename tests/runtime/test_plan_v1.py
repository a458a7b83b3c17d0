"""Plans written by memplan 0.1 (format version 1) still load and run."""

import json

from memplan.runtime.format.jsonio import sha256_hex
from memplan.runtime.format.plan import Plan


def write_v1_plan(path, fingerprint, schedule):
    """A plan file exactly as memplan 0.1's `Plan.save` wrote it: version 1, no addresses."""
    body = {"format": "memplan-plan", "version": 1, "fingerprint": fingerprint, "schedule": schedule,
            "predicted": {"peak_bytes": 1, "constant_bytes": 1, "compute_cost": 1.0, "time_ms": None},
            "provenance": {"solver": "checkmate", "budget_bytes": 1, "backend": "highs", "gap": 0.0,
                           "profile_run_id": None, "device": "cpu", "created_at": "2026-11-20T10:00:00+00:00",
                           "memplan_version": "0.1.0"}}
    path.write_text(json.dumps({**body, "checksum": sha256_hex(body)}, indent=1))
    return path


def plan_nodes(schedule):
    return [s["compute"] for s in schedule if "compute" in s]


def test_a_version_1_recomputation_plan_trains_like_eager(tmp_path, captured, helpers):
    model, loss_fn, batch, graph = captured("mlp")
    schedule = helpers.recompute_schedule(graph, helpers.chen_sqrt_n_drop(graph))
    path = write_v1_plan(tmp_path / "old.json", graph.fingerprint, schedule)
    assert any("free" in s for s in schedule) and len(plan_nodes(schedule)) > len(graph.nodes)  # recomputes
    plan = Plan.load(path)
    trained = helpers.train_plan(model, loss_fn, batch, str(path), graph=graph)
    helpers.assert_same_step(trained, helpers.train_eager(model, loss_fn, batch))
    helpers.assert_peak_matches(trained.peak, helpers.simulated_peak(graph, plan.schedule))
