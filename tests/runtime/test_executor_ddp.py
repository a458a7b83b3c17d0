"""The executor under DistributedDataParallel: per-rank gradients equal plain DDP's (2 gloo ranks, CPU, in
tests/runtime/executor_ddp_worker.py), the buckets follow the planned backward, what it cannot run is
refused in one paragraph, and ranks holding different plans are refused on the first step (in
tests/runtime/executor_ddp_plans_worker.py)."""

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


def test_ranks_holding_different_plans_are_refused_on_every_rank_before_the_all_reduce(run_ranks):
    out = run_ranks("executor_ddp_plans_worker.py")
    refused = dict(re.findall(r"rank (\d) refused: (.*)\n", out))
    assert set(refused) == {"0", "1"} and len(set(refused.values())) == 1, out
    digests = re.fullmatch(r"the ranks hold different plans \(rank 0: ([0-9a-f]{12}), rank 1: ([0-9a-f]{12}); .*"
                           r"load the same plan file on every rank\.", refused["0"])
    assert digests and digests[1] != digests[2], refused["0"]
    assert sorted(re.findall(r"rank (\d) gradients: none\n", out)) == ["0", "1"], out
