import json
import re
from datetime import datetime, timezone

import pytest

from typer.testing import CliRunner

from memplan.flows.cli import app
from memplan.runtime.tracing.facts import graph_facts
from memplan.runtime.format.graph import Node, OpGraph, Value
from memplan.runtime.format.plan import Plan
from memplan.tasks.solve.core.problem import Problem
from memplan.tasks.solve.core.simulator import simulate
from memplan.tasks.store.profiles import ENV_VAR, new_run_id, write_run
from memplan.tasks.store.schema import SCHEMA_VERSION

REPORT_KEYS = {"feasible", "objective", "predicted_peak_bytes", "bound", "gap", "status", "solve_seconds", "backend",
               "num_variables", "num_constraints"}


def _chain_graph() -> OpGraph:
    values = [Value(0, 64, (16,), "float32", "input", "x", None), Value(1, 64, (16,), "float32", "param", "w", None)]
    nodes = []
    for i in range(4):
        values.append(Value(2 + i, 64, (16,), "float32", "output" if i == 3 else "activation", f"a{i}", i))
        nodes.append(Node(i, f"mul{i}", ("aten.mul.Tensor",), "loss" if i == 3 else "forward",
                          (0 if i == 0 else 1 + i, 1), (2 + i,)))
    graph = OpGraph(values, nodes, [5], {"model": "chain"})
    graph.meta.update(graph_facts(graph))      # as runtime.capture records them
    return graph


def _profile(graph: OpGraph) -> list[dict]:
    run_id = new_run_id()
    return [dict(schema_version=SCHEMA_VERSION, run_id=run_id, created_at=datetime(2026, 1, 1, tzinfo=timezone.utc),
                 fingerprint=graph.fingerprint, model="chain", graph_nodes=4, device="cpu", device_type="cpu",
                 node_id=i, phase=n.phase, impl="default", time_ms=0.5 * (i + 1), output_bytes=64, workspace_bytes=8)
            for i, n in enumerate(graph.nodes)]


def test_json_report_and_plan_for_a_benchmark_graph(tmp_path, benchmark_paths):
    path = next(p for p in benchmark_paths if p.name.startswith("VGG16") and "train" in p.name)
    out = tmp_path / "plan.json"
    result = CliRunner().invoke(app, ["solve", "--graph", str(path), "--solver", "checkmate", "--budget", "90%",
                                      "--json", "--out", str(out), "--no-progress"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert REPORT_KEYS <= set(report) and report["feasible"] and report["status"] == "optimal"
    assert report["predicted_peak_bytes"] <= report["budget_bytes"] == int(0.9 * report["checkpoint_all_peak_bytes"])
    plan = Plan.load(out)
    sim = simulate(Problem.from_node_link(path), plan.schedule)
    assert sim.peak_bytes == plan.predicted["peak_bytes"] == report["predicted_peak_bytes"]
    assert sim.compute_cost == report["objective"] == plan.predicted["compute_cost"]
    assert plan.provenance["solver"] == "checkmate" and plan.provenance["budget_bytes"] == report["budget_bytes"]


def test_memplan_graph_takes_costs_from_the_profile_store(tmp_path, monkeypatch):
    monkeypatch.setenv(ENV_VAR, str(tmp_path / "profiles_db"))
    monkeypatch.chdir(tmp_path)              # no ./pipeline.toml here, whose store would come first
    graph = _chain_graph()
    graph.save(tmp_path / "g.json")
    args = ["solve", "--graph", str(tmp_path / "g.json"), "--solver", "checkpoint-all", "--budget", "1.0", "--json"]
    missing = CliRunner().invoke(app, args)
    assert missing.exit_code == 1 and "No complete profile" in missing.output
    write_run(_profile(graph))
    result = CliRunner().invoke(app, args + ["--out", str(tmp_path / "p.json")])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["objective"] == 0.5 + 1.0 + 1.5 + 2.0
    # workspace 8 while a node runs: its input and output (64 each) are live; the loss stays to the end
    assert report["predicted_peak_bytes"] == 2 * 64 + 8
    assert Plan.load(tmp_path / "p.json").fingerprint == graph.fingerprint


def test_bad_solver_and_budget_are_usage_errors(benchmark_paths):
    path = str(benchmark_paths[0])
    wrong = CliRunner().invoke(app, ["solve", "--graph", path, "--solver", "magic", "--budget", "0.8"])
    assert wrong.exit_code == 2 and "unknown solver 'magic'" in wrong.output
    bad = CliRunner().invoke(app, ["solve", "--graph", path, "--solver", "checkmate", "--budget", "lots"])
    assert bad.exit_code == 2 and "--budget" in bad.output
    backend = CliRunner().invoke(app, ["solve", "--graph", path, "--solver", "checkmate", "--budget", "0.8",
                                       "--backend", "cplex"])
    assert backend.exit_code == 2 and "unknown backend 'cplex'" in backend.output
    variants = CliRunner().invoke(app, ["solve", "--graph", path, "--solver", "dtr", "--budget", "0.8",
                                        "--variants", "exact"])
    assert variants.exit_code == 2 and "'exact'; choose all, bit-identical, none" in _flat(variants.output)


def _flat(text: str) -> str:
    """CLI output without rich's box drawing and line wrapping."""
    return " ".join(re.sub("[│╭╮╰╯─]", " ", text).split())


def _vgg(benchmark_paths):
    return next(p for p in benchmark_paths if p.name.startswith("VGG16") and "train" in p.name)


def test_solver_options_come_from_the_command_line(tmp_path, benchmark_paths):
    base = ["solve", "--graph", str(_vgg(benchmark_paths)), "--solver", "acg", "--budget", "100%", "--json",
            "--no-progress"]
    memory = json.loads(CliRunner().invoke(app, base + ["--option", "mode=memory"]).stdout)
    budget = json.loads(CliRunner().invoke(app, base + ["--option", 'mode="budget"']).stdout)
    assert "eq. (2) memory" in memory["message"] and "checkpoint sets simulated" in budget["message"]
    bad = CliRunner().invoke(app, base + ["--option", "mode=fast"])
    assert bad.exit_code == 2 and "mode = 'fast'" in _flat(bad.output) and "'budget' or 'memory'" in _flat(bad.output)
    unknown = CliRunner().invoke(app, base + ["--option", "speed=1"])
    assert unknown.exit_code == 2 and "has no option 'speed'" in _flat(unknown.output)


def test_budget_text_reads_like_pipeline_toml(benchmark_paths):
    def budget(text):
        args = ["solve", "--graph", str(_vgg(benchmark_paths)), "--solver", "checkpoint-all", "--budget", text,
                "--json", "--no-progress"]
        return json.loads(CliRunner().invoke(app, args).stdout)["budget_bytes"]

    assert budget("0.8") == budget("80%") == budget('"80%"')
    assert budget("123456789") == 123456789 and budget("1.5GiB") == budget("1.5 GiB") == int(1.5 * 2**30)
    bad = CliRunner().invoke(app, ["solve", "--graph", str(_vgg(benchmark_paths)), "--solver", "acg", "--budget", "1.5"])
    assert bad.exit_code == 2 and "budget 1.5 is not understood" in _flat(bad.output)


def test_greedy_addresses_are_written_and_reported(tmp_path, benchmark_paths):
    out = tmp_path / "plan.json"
    args = ["solve", "--graph", str(_vgg(benchmark_paths)), "--solver", "checkmate", "--budget", "90%",
            "--addresses", "greedy", "--json", "--out", str(out), "--no-progress"]
    report = json.loads(CliRunner().invoke(app, args).stdout)
    plan = Plan.load(out)
    problem = Problem.from_node_link(_vgg(benchmark_paths))
    sim = simulate(problem, plan.schedule, plan.addresses)       # checked: no live copies overlap
    assert plan.addresses and report["arena_bytes"] == plan.predicted["arena_bytes"] == sim.arena_bytes


def test_cli_and_pipeline_share_the_solve_defaults():
    import typer

    from memplan.tasks.config import PlanConfig
    from memplan.tasks.solve.core.solution import SolveOptions

    params = {p.name: p.default for p in typer.main.get_command(app).commands["solve"].params}
    shared = SolveOptions()
    fields = PlanConfig.model_fields
    assert params["backend"] == shared.backend == fields["backend"].default == "auto"
    assert params["gap"] == shared.gap == fields["gap"].default
    assert params["time_limit"] == shared.time_limit == fields["time_limit_s"].default
    assert params["variants"] == fields["variants"].default == "all"


def test_no_schedule_exits_1_in_every_mode_and_still_prints_the_report(benchmark_paths):
    args = ["solve", "--graph", str(_vgg(benchmark_paths)), "--solver", "ap-greedy", "--budget", "0.1", "--no-progress"]
    as_json = CliRunner().invoke(app, args + ["--json"])
    assert as_json.exit_code == 1 and json.loads(as_json.stdout)["feasible"] is False
    assert "found no schedule" in _flat(as_json.stderr)
    table = CliRunner().invoke(app, args)
    assert table.exit_code == 1 and "feasible" in table.stdout


@pytest.mark.parametrize("extra, fragment", [
    (["--time-limit", "-5"], "-5.0 is refused: input should be greater than 0"),
    (["--time-limit", "0"], "0.0 is refused: input should be greater than 0"),
    (["--time-limit", "nan"], "nan is refused: input should be a finite number"),
    (["--gap", "5"], "5.0 is refused: input should be less than 1"),
    (["--threads", "-3"], "-3 is refused: input should be greater than or equal to 1"),
    (["--option", "mode=memory", "--option", "mode=budget"], "option mode given more than once"),
])
def test_the_cli_refuses_what_pipeline_toml_refuses_before_any_work(benchmark_paths, monkeypatch, extra, fragment):
    from memplan.tasks import problems
    def no_work(*args, **kwargs):
        raise AssertionError("the graph was loaded before the arguments were checked")

    monkeypatch.setattr(problems, "load_problem", no_work)
    path = next(p for p in benchmark_paths if p.name.startswith("VGG16") and "train" in p.name)
    result = CliRunner().invoke(app, ["solve", "--graph", str(path), "--solver", "acg", "--budget", "90%", *extra])
    assert result.exit_code == 2, result.output
    assert fragment in " ".join(result.output.replace("│", " ").split()), result.output
    assert "Traceback" not in result.output
