"""`--json` output is all that stdout carries: what a native library writes to file descriptor 1 during
the command (HiGHS prints its banner there) goes to stderr."""

import json
import subprocess
import sys
import textwrap


def test_a_solver_writing_to_stdout_leaves_solve_json_parseable(benchmark_paths):
    graph = next(p for p in benchmark_paths if p.name.startswith("VGG16") and "train" in p.name)
    code = textwrap.dedent(f"""
        import os
        import memplan.tasks.solve_stage as stage
        from memplan.flows.cli import app

        real = stage.solve_loaded
        def noisy(*args, **kwargs):
            os.write(1, b"Running HiGHS 1.x: Copyright (c) ... banner on fd 1\\n")
            print("a library's print")
            return real(*args, **kwargs)
        stage.solve_loaded = noisy
        app(["solve", "--graph", {str(graph)!r}, "--solver", "checkmate", "--budget", "90%", "--json",
             "--no-progress"])
    """)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["feasible"] and report["solver"] == "checkmate"
    assert "banner on fd 1" in done.stderr and "a library's print" in done.stderr


def test_query_json_writes_non_finite_floats_as_null(tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from memplan.flows.cli import app

    monkeypatch.chdir(tmp_path)
    (tmp_path / "store").mkdir()
    result = CliRunner().invoke(app, ["query", "--store", str(tmp_path / "store"), "--format", "json",
                                      "SELECT 'nan'::DOUBLE AS a, 'inf'::DOUBLE AS b, 1.5 AS c"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout) == [{"a": None, "b": None, "c": 1.5}]
