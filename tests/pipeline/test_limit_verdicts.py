"""A `max_overhead` plan outside the plan flow: which no-recomputation plan it is measured against
(`tasks.validate.overhead.no_recompute_beside`) and the verdict against its limit (`flows.report.limit_verdict`)."""

from __future__ import annotations

import pytest

from memplan.flows.report import limit_verdict
from memplan.tasks.validate.overhead import no_recompute_beside, no_recompute_path


def test_the_no_recompute_plan_lies_beside_the_cell_plan_and_its_rungs(tmp_path):
    assert no_recompute_path(tmp_path / "m-b4-dtr-ovh10pct-ab12.json") == str(tmp_path / "m-b4-dtr-ovh10pct-ab12-no-recompute.json")
    assert no_recompute_path(tmp_path / "m-b4-dtr-ovh10pct-ab12-rung3.json") == \
        str(tmp_path / "m-b4-dtr-ovh10pct-ab12-no-recompute.json")


def eager_order(plan):
    """`plan` (the toy plan, which recomputes node 1) with every node computed once, in order."""
    from memplan.runtime.format.plan import Plan

    return Plan(plan.fingerprint, [{"compute": n} for n in range(4)], provenance=dict(plan.provenance))


def test_a_matching_no_recompute_plan_is_used(tmp_path, make_plan):
    plan = make_plan()
    plan.provenance["max_overhead"] = 0.1
    eager_order(plan).save(tmp_path / "cell-no-recompute.json")
    found, why = no_recompute_beside(tmp_path / "cell-rung2.json", plan)
    assert found is not None and found.compute_steps() == [0, 1, 2, 3] and why == "cell-no-recompute.json"


@pytest.mark.parametrize("change, reason", [
    (lambda p: setattr(p, "fingerprint", "another"), "is of another graph"),
    (lambda p: setattr(p, "schedule", p.schedule + [{"compute": 1}]), "recomputes"),
    (lambda p: p.provenance.update(optimizer_in_step="adam"), "has another optimizer_in_step"),
])
def test_a_no_recompute_plan_that_does_not_match_is_refused(tmp_path, make_plan, change, reason):
    plan = make_plan()
    other = eager_order(plan)
    change(other)
    other.save(tmp_path / "cell-no-recompute.json")
    found, why = no_recompute_beside(tmp_path / "cell.json", plan)
    assert found is None and reason in why


def test_without_a_readable_no_recompute_plan_only_eager_is_measured(tmp_path, make_plan):
    plan = make_plan()
    found, why = no_recompute_beside(tmp_path / "cell.json", plan)
    assert found is None and "there is no no-recomputation plan beside it" in why and "cell-no-recompute.json" in why
    (tmp_path / "cell-no-recompute.json").write_text("{not json")
    found, why = no_recompute_beside(tmp_path / "cell.json", plan)
    assert found is None and "cannot be read" in why
    plan.provenance["form"] = "policy"
    found, why = no_recompute_beside(tmp_path / "cell.json", plan)
    assert found is None and "eager PyTorch's own" in why


@pytest.mark.parametrize("overhead, interval, expected", [
    (0.04, [0.01, 0.07], "within the limit (+4.0% <= +10%)"),
    (0.08, [0.05, 0.13], "within the limit (+8.0% <= +10%); its 95% interval reaches +13.0%"),
    (0.12, [0.11, 0.14], "OVER the limit (+12.0% > +10%), beyond its 95% interval"),
    (0.12, [0.07, 0.16], "OVER the limit (+12.0% > +10%), though its 95% interval reaches down to +7.0%"),
    (0.12, None, "OVER the limit (+12.0% > +10%); no interval (under 6 rounds)"),
    (0.10, None, "within the limit (+10.0% <= +10%)"),
])
def test_limit_verdict(overhead, interval, expected):
    assert limit_verdict(overhead, interval, 0.10) == expected
