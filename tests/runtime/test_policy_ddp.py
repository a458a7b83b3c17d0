"""DDP with the policy form: per-rank gradients equal DDP without checkpointing (2 gloo ranks, CPU)."""

import re


def test_policy_model_under_ddp_gets_the_gradients_of_ddp_without_checkpointing(run_ranks):
    out = run_ranks("policy_ddp_worker.py")
    ranks = {r: (float(d), int(n)) for r, d, n in
             re.findall(r"rank (\d) max_abs_diff (\S+) recomputations (\d+)", out)}
    assert set(ranks) == {"0", "1"}, out
    assert all(diff <= 1e-6 and recomputed > 0 for diff, recomputed in ranks.values()), ranks
    assert sorted(re.findall(r"rank (\d) optimizer refused: True", out)) == ["0", "1"], out
