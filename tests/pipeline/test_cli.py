"""The `memplan` commands: fast help, clear one-paragraph errors with exit status 1, plans listing."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from typer.testing import CliRunner

from memplan.flows.cli import app

runner = CliRunner(env={"COLUMNS": "250"})
GOOD = textwrap.dedent('''
    device = "cpu"
    [[models]]
    name = "mlp"
    factory = "torch.nn:Linear"
    kwargs = { in_features = 4, out_features = 3 }
    inputs = [{ shape = [4] }, { shape = [], dtype = "int64", high = 3 }]
    [[plans]]
    solver = "checkmate"
    budgets = ["90%"]
''')


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "pipeline.toml"
    path.write_text(text)
    return path


def test_help_lists_the_commands_without_importing_torch():
    code = "import sys; from memplan.flows.cli import app; print('torch' in sys.modules, 'prefect' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "False"]
    result = runner.invoke(app, ["--help"])
    assert result.exit_code == 0
    for command in ("run", "trace", "profile", "validate", "publish", "plans"):
        assert command in result.output


def _commands(group, path=()):
    """(argv, click command) of every command and sub-command of `group`, depth first."""
    import typer.main

    click_group = typer.main.get_command(group) if not path else group
    yield list(path), click_group
    for name, command in getattr(click_group, "commands", {}).items():
        yield from _commands(command, (*path, name))


def test_help_texts_print_bracketed_words_as_typed():
    """Help texts name TOML tables and defaults in brackets ("[deploy]", "[default: ...]"); rich markup
    would swallow them unless escaped. Every bracketed word of every command's and parameter's help must
    appear in its --help output."""
    import re

    seen = 0
    for argv, command in _commands(app):
        texts = [command.help or ""] + [getattr(p, "help", None) or "" for p in command.params]
        words = {w.replace("\\", "") for t in texts for w in re.findall(r"\\?\[[a-z][^\]]*\]", t)}
        if not words:
            continue
        result = runner.invoke(app, [*argv, "--help"])
        assert result.exit_code == 0, result.output
        flat = re.sub(r"[\s│]+", "", result.output)
        for word in words:
            seen += 1
            assert re.sub(r"\s+", "", word) in flat, (argv, word, result.output)
    assert seen >= 4


@pytest.mark.parametrize(
    "text, fragment",
    [
        ("[[models]\nname = 'x'\n", "is not valid TOML"),
        (GOOD.replace('device = "cpu"', 'device = "cpu"\nsolvers = 3'), "key solvers = 3: unknown key; allowed keys in the top level"),
        (GOOD.replace('solver = "checkmate"', 'solver = "chekmate"'), "unknown solver 'chekmate'; registered solvers: "),
        (GOOD.replace('"torch.nn:Linear"', '"nowhere.models:mlp"'), "cannot import module 'nowhere.models'"),
        (GOOD.replace('budgets = ["90%"]', 'budgets = ["lots"]'), "plans[0].budgets[0] = 'lots'"),
    ],
)
@pytest.mark.parametrize("command", ["run", "trace", "profile"])
def test_bad_pipeline_files_exit_1_with_the_cause(tmp_path, text, fragment, command):
    result = runner.invoke(app, [command, str(write(tmp_path, text))])
    assert result.exit_code == 1, result.output
    assert fragment in result.output
    assert "Traceback" not in result.output
    assert not (tmp_path / "plans").exists() and not (tmp_path / "profiles_db").exists()


def test_missing_file_exits_1(tmp_path):
    result = runner.invoke(app, ["run", str(tmp_path / "nope.toml")])
    assert result.exit_code == 1 and "no such file" in result.output


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="needs a host without CUDA")
@pytest.mark.parametrize("command", ["run", "trace", "profile"])
def test_missing_gpu_exits_1(tmp_path, command):
    result = runner.invoke(app, [command, str(write(tmp_path, GOOD.replace('"cpu"', '"cuda"')))])
    assert result.exit_code == 1
    assert "device = 'cuda' in pipeline.toml, but torch" in result.output and "sees no CUDA GPU" in result.output


def test_plans_list_and_show(tmp_path, make_plan, make_validation):
    from memplan.tasks.publish import plan_id, publish

    plan = make_plan()
    publish(plan, make_validation(plan), tmp_path, alias="toy-b4-checkmate-200B", model="toy", batch_size=4, budget="200B")
    listed = runner.invoke(app, ["plans", "list", "--dir", str(tmp_path)])
    assert listed.exit_code == 0
    assert plan_id(plan)[:12] in listed.output and "toy-b4-checkmate-200B" in listed.output
    shown = runner.invoke(app, ["plans", "show", "toy-b4-checkmate-200B", "--dir", str(tmp_path)])
    assert shown.exit_code == 0
    assert "6 steps: 5 computes of 4 nodes (1 recomputations)" in shown.output
    assert "index.measured_peak_bytes" in shown.output
    missing = runner.invoke(app, ["plans", "show", "nothing", "--dir", str(tmp_path)])
    assert missing.exit_code == 1 and "no plan 'nothing'" in missing.output


def test_plans_show_reads_nothing_outside_the_plans_folder(tmp_path, make_plan):
    plans = tmp_path / "plans"
    plans.mkdir()
    make_plan().save(tmp_path / "outside.json")
    for name in ("../outside", str(tmp_path / "outside"), "sub/../../outside"):
        shown = runner.invoke(app, ["plans", "show", name, "--dir", str(plans)])
        assert shown.exit_code == 1 and "not a plan id or alias" in shown.output, name
        assert "Traceback" not in shown.output


def test_trace_command_writes_the_graph(tmp_path):
    result = runner.invoke(app, ["trace", str(write(tmp_path, GOOD))])
    assert result.exit_code == 0, result.output
    (graph,) = (tmp_path / ".cache" / "memplan" / "graphs").glob("mlp-b8-*.json")
    from memplan.runtime.format.graph import OpGraph

    assert OpGraph.load(graph).fingerprint[:16] in result.output


def test_a_corrupt_index_file_is_skipped_with_a_warning_and_rewritten_by_the_next_publish(tmp_path, make_plan,
                                                                                          make_validation):
    import os
    import stat

    from memplan.tasks.publish import plan_id, publish

    plan, args = make_plan(), dict(alias="toy-b4-checkmate-200B", model="toy", batch_size=4, budget="200B")
    publish(plan, make_validation(plan), tmp_path, **args)
    row = tmp_path / "index" / f"{plan_id(plan)}.parquet"
    umask = os.umask(0)
    os.umask(umask)
    assert stat.S_IMODE(row.stat().st_mode) == 0o666 & ~umask                # readable like the plans
    row.write_bytes(b"PAR1 truncated")
    listed = runner.invoke(app, ["plans", "list", "--dir", str(tmp_path)])
    assert listed.exit_code == 0 and "Skipping plans index file" in listed.output and "Traceback" not in listed.output
    shown = runner.invoke(app, ["plans", "show", "toy-b4-checkmate-200B", "--dir", str(tmp_path)])
    assert shown.exit_code == 0 and "index.measured_peak_bytes" not in shown.output
    assert publish(plan, make_validation(plan), tmp_path, **args).changed                 # the row is rewritten
    again = runner.invoke(app, ["plans", "list", "--dir", str(tmp_path)])
    assert again.exit_code == 0 and "Skipping" not in again.output and plan_id(plan)[:12] in again.output


def test_plans_list_takes_the_plans_folder_a_config_and_a_format(tmp_path, make_plan, make_validation):
    import json

    import pyarrow.parquet as pq

    from memplan.tasks.publish import plan_id, publish

    plan, published = make_plan(), tmp_path / "published"
    publish(plan, make_validation(plan), published, alias="toy-b4-checkmate-200B", model="toy", batch_size=4,
            budget="200B")
    as_json = runner.invoke(app, ["plans", "list", "--plans", str(published), "--format", "json"])
    assert as_json.exit_code == 0, as_json.output
    (row,) = json.loads(as_json.stdout)
    assert (row["plan_id"], row["alias"], row["budget_bytes"], row["form"]) == (plan_id(plan), "toy-b4-checkmate-200B",
                                                                               200, "executor")
    as_csv = runner.invoke(app, ["plans", "list", "--plans", str(published), "-f", "csv", "--model", "toy"])
    header, line = as_csv.stdout.splitlines()
    assert header.startswith("plan_id,alias,model,batch_size,") and line.startswith(f"{plan_id(plan)},toy-b4-")
    config = write(tmp_path, GOOD + '[publish]\ndir = "published"\n')
    by_config = runner.invoke(app, ["plans", "list", "--config", str(config), "-f", "json"])
    assert by_config.exit_code == 0 and json.loads(by_config.stdout) == [row]
    assert f"plans {published} (publish.dir of {config})" in by_config.stderr
    assert json.loads(runner.invoke(app, ["plans", "list", "--plans", str(published), "-f", "json",
                                          "--model", "other"]).stdout) == []
    table = runner.invoke(app, ["plans", "list", "--plans", str(published)])
    assert table.exit_code == 0 and "toy-b4-checkmate-200B" in table.stdout and "To train with them" in table.stdout
    out = tmp_path / "plans.parquet"
    assert runner.invoke(app, ["plans", "list", "--plans", str(published), "-f", "parquet", "-o", str(out)]).exit_code == 0
    assert pq.read_table(out).column("plan_id").to_pylist() == [plan_id(plan)]
    shown = runner.invoke(app, ["plans", "show", "toy-b4-checkmate-200B", "--plans", str(published)])
    assert shown.exit_code == 0 and "index.measured_peak_bytes" in shown.output


@pytest.mark.parametrize("args, message", [
    (["-f", "parquet"], "--format parquet needs --output FILE"),
    (["-o", "x.csv"], "--output writes csv, json or parquet; choose one with --format"),
    (["-f", "yaml"], "'yaml' is not one of"),
])
def test_plans_list_refuses_bad_format_options_before_reading(tmp_path, args, message):
    result = runner.invoke(app, ["plans", "list", "--plans", str(tmp_path), *args])
    assert result.exit_code == 2 and message in " ".join(result.output.split()), result.output
