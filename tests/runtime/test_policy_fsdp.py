"""FSDP2 with the policy form: a tiny GPT-2 with a plan applied, then `fully_shard` per block and at the
root, trains on 2 gloo CPU ranks to the parameter shards of FSDP2 without checkpointing. FSDP2's gathered
parameters and gradient buffers come on top of the plan's peak, and the same bytes on top of the unplanned
peak: the bytes the plan saves are within 5% of the bytes the simulator predicts it saves (the plan's
prediction counts what checkpoint's frame holds, which under FSDP2 is not at the rank's peak)."""

import re


def test_policy_model_under_fsdp2_trains_to_the_parameters_of_fsdp2_without_checkpointing(run_ranks):
    out = run_ranks("policy_fsdp_worker.py")
    ranks = {r: tuple(map(float, rest)) for r, *rest in re.findall(
        r"rank (\d) max_abs_diff (\S+) recomputations (\d+) peak (\d+) predicted (\d+) reference_peak (\d+) "
        r"reference_predicted (\d+)",
        out)}
    assert set(ranks) == {"0", "1"}, out
    for diff, recomputed, peak, predicted, reference_peak, reference_predicted in ranks.values():
        assert diff <= 1e-6 and recomputed > 0, ranks
        assert predicted < peak < reference_peak, ranks
        saved, predicted_saving = reference_peak - peak, reference_predicted - predicted
        assert abs(saved / predicted_saving - 1) <= 0.05, ranks     # docs/training.md: 2.8% measured
