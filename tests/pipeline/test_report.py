"""Run reports: the markdown table, the plot, cache keys and the no-plan message."""

from __future__ import annotations

from memplan.flows.report import Outcome, artifact_key, markdown_table, memory_overhead_plot
from memplan.flows.steps import content_key
from memplan.tasks.records import Solved

PUBLISHED = Outcome("m-b8-checkmate-90pct", "m", 8, "checkmate", "90pct", "published", budget_bytes=90 * 2**20,
                    checkpoint_all_peak_bytes=100 * 2**20, predicted_peak_bytes=80 * 2**20,
                    measured_peak_bytes=81 * 2**20, eager_peak_bytes=100 * 2**20, predicted_overhead=0.1,
                    overhead=0.125, plan_id="ab" * 32)
REJECTED = Outcome("m-b8-chen-90pct", "m", 8, "chen", "90pct", "rejected", budget_bytes=90 * 2**20,
                   message="plan m-b8-chen-90pct failed validation on cpu: loss differs | badly.")


def test_markdown_table_has_one_row_per_cell_with_mib_and_percentages():
    lines = markdown_table([PUBLISHED, REJECTED]).splitlines()
    assert len(lines) == 4
    assert lines[2] == ("| m-b8-checkmate-90pct | checkmate | executor | 90pct | 90.0 (90% of eager) | 80.0 | 81.0 | 100.0 | +10% "
                        "| not measurable here (under 6 rounds) |  | published |")
    assert lines[3].endswith("| rejected: plan m-b8-chen-90pct failed validation on cpu: loss differs / badly. |")


def test_a_budget_shows_its_fraction_of_eager_only_where_eager_was_measured():
    from dataclasses import replace

    from memplan.flows.report import budget_text

    assert budget_text(replace(PUBLISHED, budget_bytes=38 * 2**20, eager_peak_bytes=76 * 2**20)) == "38.0 (50% of eager)"
    assert budget_text(REJECTED) == "90.0"


def test_an_overhead_with_its_interval_shows_the_larger_half_of_it():
    from dataclasses import replace

    measured = replace(PUBLISHED, overhead_interval=[0.10, 0.16])
    assert markdown_table([measured]).splitlines()[2].endswith("| +10% | +12% ±4% |  | published |")


def test_a_max_overhead_plan_shows_its_overhead_against_no_recomputation_and_its_walk():
    from dataclasses import replace

    walked = replace(PUBLISHED, overhead_interval=[0.10, 0.16], overhead_vs_no_recompute=0.05,
                     overhead_vs_no_recompute_interval=[0.03, 0.08], message="measured walk: published the predicted choice")
    assert markdown_table([walked]).splitlines()[2].endswith(
        "| +12% ±4% | +5% ±3% | published: measured walk: published the predicted choice |")


def test_plot_is_a_png(tmp_path):
    from dataclasses import replace

    measured = replace(PUBLISHED, alias="m-b8-checkmate-80pct", budget="80pct", overhead_interval=[0.10, 0.16])
    png = memory_overhead_plot([PUBLISHED, measured, REJECTED], "m", tmp_path / "m.png")
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_artifact_keys_are_lowercase_dashes():
    assert artifact_key("memplan", "GPT2_tiny.v1", "plot") == "memplan-gpt2-tiny-v1-plot"


def test_content_key_depends_on_every_part_and_nothing_else():
    from memplan.tasks.config import Budget

    key = content_key("solve", "fp", {"gap": 0.01, "backend": "highs"}, Budget(fraction=0.9))
    assert key == content_key("solve", "fp", {"backend": "highs", "gap": 0.01}, Budget(fraction=0.9))
    assert key != content_key("solve", "fp", {"gap": 0.02, "backend": "highs"}, Budget(fraction=0.9))
    assert key != content_key("solve", "fp", {"gap": 0.01, "backend": "highs"}, Budget(fraction=0.8))
    assert key.startswith("solve-") and len(key) == 6 + 64


def _solved(fields: dict) -> Solved:
    """An infeasible cell's `Solved` record with `fields`."""
    return Solved(solver="checkmate", feasible=False, checkpoint_all_cost=1.0, predicted_peak_bytes=None, arena_bytes=None,
                  objective=None, gap=None, solve_seconds=0.0, backend=None, plan_path=None, plan_id=None, profile_run_id=None, **fields)


def test_no_plan_messages_say_what_to_change():
    from memplan.flows.plan import KnownFloor, infeasible_message
    from memplan.tasks.config import Budget, Case, parse_config

    config = parse_config({"models": [{"name": "m", "factory": "torch.nn:Linear", "inputs": [{"shape": [4]}]}],
                           "plans": [{"solver": "checkmate", "budgets": [0.5], "time_limit_s": 2}]}, solvers=["checkmate"])
    case = Case(config.models[0], 8, config.plans[0], Budget(fraction=0.5))
    solved = {"budget_bytes": 500, "checkpoint_all_peak_bytes": 1000, "status": "no_solution",
              "message": "time limit reached without an incumbent", "min_budget_lower_bound": 300,
              "smallest_feasible_budget": 1000}
    assert infeasible_message(case, _solved(solved), KnownFloor(700, "the peak of m-b8-dtr-ovh5pct's schedule")) == (
        "m-b8-checkmate-50pct: solver checkmate found no schedule within 500 B (50pct; the checkpoint-all peak "
        "is 1,000 B), status no_solution (time limit reached without an incumbent); no schedule fits below 300 B, "
        "and the least feasible budget this run knows is 700 B (the peak of m-b8-dtr-ovh5pct's schedule); raise "
        "time_limit_s (now 2 s) or the budget."
    )
    proved = solved | {"status": "infeasible", "message": "", "smallest_feasible_budget": None}
    assert infeasible_message(case, _solved(proved)).endswith("no schedule fits below 300 B; raise the budget.")
    greedy = solved | {"message": "no segment size b of 12 checkpoint sets tried fits the budget"}
    assert "time_limit_s" not in infeasible_message(case, _solved(greedy))         # no time limit stopped it
    assert infeasible_message(case, _solved(greedy)).endswith("raise the budget.")


def _measured(ratios: list[float]) -> tuple[float, list[float]]:
    """The overhead and its 95% interval from per-round plan/eager time ratios, as tasks.validate.stage computes them."""
    import statistics

    from memplan.tasks.validate.step_timing import median_interval

    low, high = median_interval(ratios)
    return statistics.median(ratios) - 1, [low - 1, high - 1]


def test_an_overhead_is_printed_only_when_its_interval_is_narrower_than_itself_and_the_noise_limit():
    from memplan.flows.report import overhead_text

    quiet = _measured([1.10, 1.12, 1.11, 1.13, 1.09, 1.12, 1.11, 1.10])
    assert overhead_text(*quiet) == "+11% ±2%"
    busy = _measured([0.6, 2.9, 1.1, 1.9, 0.8, 3.4, 1.5, 0.9])         # a 2-core host shared with other jobs
    assert overhead_text(*busy) == "not measurable here (±210%)"
    spans_zero = _measured([0.97, 1.05, 1.02, 0.99, 1.04, 1.01, 1.03, 0.98])
    assert overhead_text(*spans_zero).startswith("not measurable here (±")
    slow_but_wide = _measured([1.5, 1.9, 1.6, 2.2, 1.7, 2.3, 1.8, 1.55])   # +75%, but within ±55 points
    assert overhead_text(*slow_but_wide) == "not measurable here (±55%)"
    assert overhead_text(0.12, None) == "not measurable here (under 6 rounds)" and overhead_text(None) == ""


def test_an_infeasible_cell_shows_the_least_budget_known_to_fit():
    from memplan.flows.report import status_text

    cell = Outcome("m-b8-acg-93pct", "m", 8, "acg", "93pct", "infeasible", least_feasible_bytes=95 * 2**20,
                   message="m-b8-acg-93pct: solver acg found no schedule")
    assert status_text(cell) == "infeasible here (feasible from 95.0 MiB)"
    assert "| infeasible here (feasible from 95.0 MiB): m-b8-acg-93pct: solver acg found no schedule |" in markdown_table([cell])
