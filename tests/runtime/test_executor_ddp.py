"""The executor under DistributedDataParallel: per-rank gradients equal plain DDP's (2 gloo ranks, CPU, in
tests/runtime/executor_ddp_worker.py), the buckets follow the planned backward, and what it cannot run is
refused in one paragraph."""

import re


def test_executor_under_ddp_gets_the_gradients_of_plain_ddp_and_the_predicted_peak(run_ranks):
    out = run_ranks("executor_ddp_worker.py")
    ranks = {r: (float(d), int(n), int(b), float(u), int(m), int(p)) for r, d, n, b, u, m, p in re.findall(
        r"rank (\d) max_abs_diff (\S+) recomputations (\d+) buckets (\d+) unreduced_diff (\S+) measured (\d+) "
        r"predicted (\d+)\n", out)}
    assert set(ranks) == {"0", "1"}, out
    for diff, recomputed, buckets, unreduced, measured, predicted in ranks.values():
        assert diff <= 1e-5 and unreduced > 1e-3, ranks       # the all-reduce happened, and matches DDP's
        assert recomputed > 0 and buckets > 1, ranks
        assert measured == predicted, ranks
