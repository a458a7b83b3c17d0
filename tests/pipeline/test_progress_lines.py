"""`memplan run` says what runs where nobody watches a terminal: with stderr a file or a pipe, one line per stage
as it starts and ends (flows/progress.py); on a terminal, a progress bar instead."""

from __future__ import annotations

import re
from types import SimpleNamespace

from memplan.flows.progress import stage_finished, stage_progress, stage_started


def test_a_run_logged_to_a_file_prints_a_line_per_stage_start_and_end(capsys):
    run = SimpleNamespace(name="validate gpt2-tiny b4")
    with stage_progress(3, "starting Prefect"):
        stage_started(None, run, None)
        stage_finished(None, run, SimpleNamespace(name="Completed"))
    stage_started(None, run, None)                         # after the run: nothing
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 2, lines
    assert re.fullmatch(r"\[ *\d+\.\d s\] validate gpt2-tiny b4: started", lines[0])
    assert re.fullmatch(r"\[ *\d+\.\d s\] validate gpt2-tiny b4: completed in \d+\.\d s \(1 of about 3 stages\)",
                        lines[1])


def test_a_long_stage_is_named_again_while_it_runs(capsys, monkeypatch):
    import time

    from memplan.flows import progress

    monkeypatch.setattr(progress, "HEARTBEAT_S", 0.05)
    run = SimpleNamespace(name="compiled plans gpt2-tiny b4 dtr")
    with stage_progress(2, "starting Prefect"):
        stage_started(None, run, None)
        time.sleep(0.3)
        stage_finished(None, run, SimpleNamespace(name="Completed"))
    beats = [line for line in capsys.readouterr().err.splitlines() if "running:" in line]
    assert beats and re.search(r"running: compiled plans gpt2-tiny b4 dtr for \d+ s \(0 of about 2 stages done\)",
                               beats[0]), beats
