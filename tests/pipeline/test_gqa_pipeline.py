"""A Llama-style decoder with grouped-query attention (8 query heads sharing 2 key/value heads, as Llama 3,
Mistral and Qwen use) runs `memplan run` end to end: traced, profiled with every attention variant, planned
with the `math` attention variant on offer, validated against eager and published."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from memplan.flows.cli import app

PIPELINE = '''
device = "cpu"

[[models]]
name = "llama-gqa"
transformers = "llama"
kwargs = { hidden_size = 64, intermediate_size = 128, num_hidden_layers = 2, num_attention_heads = 8, num_key_value_heads = 2, vocab_size = 256, max_position_embeddings = 64 }
loss = "causal_lm"
batch_sizes = [2]
inputs = [{ shape = [32], dtype = "int64", high = 256 }]

[profile]
warmup = 0
repeats = 1

[[plans]]
solver = "dtr"
max_overhead = [0.25]

[[plans]]
solver = "ap-greedy"
max_overhead = [0.25]

[validate]
steps = 1
max_steps = 1
'''


@pytest.fixture(scope="module")
def quiet_prefect():
    with pytest.MonkeyPatch.context() as patch:
        for key in ("PREFECT_LOGGING_LEVEL", "PREFECT_LOGGING_HANDLERS_CONSOLE_LEVEL"):
            patch.delenv(key, raising=False)
        yield


def test_a_grouped_query_attention_decoder_publishes_its_plans(tmp_path, harness, quiet_prefect):
    from memplan.runtime.format.graph import OpGraph
    from memplan.runtime.format.plan import Plan
    from memplan.tasks.publish import read_index
    from memplan.tasks.store.query import connect

    config = tmp_path / "pipeline.toml"
    config.write_text(PIPELINE)
    result = CliRunner(env={"COLUMNS": "250"}).invoke(app, ["run", str(config)])
    assert result.exit_code == 0, result.output
    rows = read_index(tmp_path / "plans")
    assert sorted(r["solver"] for r in rows) == ["ap-greedy", "dtr"]
    (graph_file,) = (tmp_path / ".cache" / "memplan" / "graphs").glob("llama-gqa-b2-*.json")
    attention = [n.id for n in OpGraph.load(graph_file).nodes if "flash_attention" in n.targets[0]]
    assert len(attention) == 4                              # forward and backward of 2 layers
    con = connect(tmp_path / "profiles_db")
    offered = con.execute("SELECT count(*) FROM profiles WHERE impl = 'math' AND unavailable IS NULL").fetchall()
    assert offered == [(4,)]                                # the math variant profiled on every attention node
    for row in rows:
        plan = Plan.load(tmp_path / "plans" / f"{row['alias']}.json")
        assert row["measured_peak_bytes"] <= row["budget_bytes"] * 1.05
        assert plan.provenance["rewrites"] is not None
