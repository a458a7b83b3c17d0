"""The optimizer inside the step in the planner: a gradient dies at its parameter's update (after the last
step that computes it or reads the parameter), the update's temporaries are charged there, the state is a
resident term; peaks below are worked out by hand."""

from __future__ import annotations

import numpy as np
import pytest

from memplan.tasks.config import ConfigError, parse_config
from memplan.tasks.solve.core.optimizer import in_step
from memplan.tasks.solve.core.problem import ParamUpdate, Problem, ProblemError
from memplan.tasks.solve.core.simulator import InvalidSchedule, simulate
from memplan.tasks.solve.core.solution import checked_solution, min_budget_lower_bound

W, X, A, LOSS, GW, GX, OUT = range(7)


def problem() -> Problem:
    """W (param, 100 B) and x (batch) in; n0: a = f(W, x) (40 B); n1: loss(a) (4 B); n2: dW = g(loss, x) (100 B);
    n3: dx = h(loss, W) (30 B, reads W after dW exists); n4: out = k(dx) (20 B). Outputs: loss, dW, out."""
    return Problem(
        name="toy", cost=np.ones(5), workspace=np.zeros(5, dtype=np.int64),
        phase=("forward", "loss", "backward", "backward", "backward"),
        node_inputs=((W, X), (A,), (LOSS, X), (LOSS, W), (GX,)),
        node_outputs=((A,), (LOSS,), (GW,), (GX,), (OUT,)),
        value_bytes=np.array([100, 8, 40, 4, 100, 30, 20], dtype=np.int64),
        value_producer=np.array([-1, -1, 0, 1, 2, 3, 4], dtype=np.int64),
        outputs=(LOSS, GW, OUT), order=np.arange(5))


def schedule(*nodes):
    return [("compute", n) for n in nodes]


def test_gradient_lives_to_the_end_without_the_optimizer_in_the_step():
    sim = simulate(problem(), schedule(0, 1, 2, 3, 4))
    assert sim.timeline.tolist() == [40, 44, 104, 134, 154]          # dW (100) held from step 2 to the end
    assert sim.peak_bytes == 154


def test_gradient_dies_after_the_last_read_of_its_parameter():
    """SGD: no state, no temporaries. dW is updated after n3, the last reader of W, so it is live through step 3."""
    p = in_step(problem(), [((GW,), (W,))], "sgd")
    assert p.outputs == (LOSS, OUT) and p.updates == (ParamUpdate((GW,), (W,), 0),) and p.optimizer_state_bytes == 0
    sim = simulate(p, schedule(0, 1, 2, 3, 4))
    assert sim.timeline.tolist() == [40, 44, 104, 134, 54]
    assert sim.peak_bytes == 134


def test_update_workspace_and_state_of_adamw():
    """AdamW: state 2 x 100 B (resident, not in the peak), 2 x 100 B of temporaries at the update step."""
    p = in_step(problem(), [((GW,), (W,))], "adamw")
    assert p.optimizer_state_bytes == 200
    sim = simulate(p, schedule(0, 1, 2, 3, 4))
    assert sim.timeline.tolist() == [40, 44, 104, 334, 54]
    assert sim.constant_bytes == 108 and sim.peak_bytes == 334
    assert min_budget_lower_bound(p) == 300                 # the update alone: dW (100) and its temporaries (200)


def test_updates_run_after_the_node_without_its_scratch_and_dead_inputs():
    """n3 with 50 B of workspace: during n3 134 + 50 B are live. The update after it runs without that scratch
    and with what lives on (loss 4, dx 30) plus dW (100) plus its temporaries: SGD 134 (n3's 184 stays the
    step's), AdamW 134 + 200 = 334 (not 384: the node's scratch is gone by then)."""
    base = problem()
    with_scratch = Problem(**{**base.__dict__, "workspace": np.array([0, 0, 0, 50, 0], dtype=np.int64)})
    for optimizer, step3 in (("sgd", 184), ("adamw", 334)):
        sim = simulate(in_step(with_scratch, [((GW,), (W,))], optimizer), schedule(0, 1, 2, 3, 4))
        assert sim.timeline.tolist() == [40, 44, 104, step3, 54]


def test_the_update_follows_the_gradient_when_the_parameter_is_read_first():
    """Order n3 before n2: W's last read is step 2, dW is computed at step 3 and updated right after it."""
    sim = simulate(in_step(problem(), [((GW,), (W,))], "sgd-momentum"), schedule(0, 1, 3, 2, 4))
    assert sim.timeline.tolist() == [40, 44, 34, 134, 54]
    assert sim.peak_bytes == 134


def test_a_freed_gradient_still_lives_through_its_update_and_the_plan_keeps_it():
    """A free of dW before W's last read releases nothing (the update still reads dW), and the plan drops the
    free: the runtime's graph keeps the gradient an output that its program frees at the update."""
    p = in_step(problem(), [((GW,), (W,))], "adamw")
    steps = [*schedule(0, 1, 2), ("free", GW), *schedule(3, 4)]
    solution = checked_solution(p, "test", 1000, steps)
    assert solution.simulation.peak_bytes == 334
    plan = solution.to_plan(p)
    assert {"free": GW} not in plan.schedule and len(plan.schedule) == 5
    assert plan.predicted["optimizer_state_bytes"] == 200 and plan.predicted["peak_bytes"] == 334


def test_the_gradients_of_a_tied_tensor_live_until_its_one_update():
    """A tensor held under two names has two gradients, summed for one update after the last step touching any of
    them (n4 reads dx): both live to step 4, and the state counts the tensor once."""
    p = in_step(problem(), [((GW, GX), (W,))], "sgd-momentum")
    assert p.optimizer_state_bytes == 100 and p.outputs == (LOSS, OUT)
    sim = simulate(p, schedule(0, 1, 2, 3, 4))
    assert sim.timeline.tolist() == [40, 44, 104, 134, 154]


def test_updates_after_the_last_step_count_the_outputs_that_outlive_it():
    """AdamW on the tied tensor: its update runs after n4, the last step. Then the loss (4) and out (20) live on
    past the step, beside both gradients (130) and the temporaries (2 x 100): 354, above n4's own 154."""
    sim = simulate(in_step(problem(), [((GW, GX), (W,))], "adamw"), schedule(0, 1, 2, 3, 4))
    assert sim.timeline.tolist() == [40, 44, 104, 134, 354]


def test_a_gradient_never_computed_is_an_invalid_schedule():
    with pytest.raises(InvalidSchedule, match=f"never computes value {GW}, a gradient of parameter value {W}"):
        simulate(in_step(problem(), [((GW,), (W,))], "sgd"), schedule(0, 1, 3, 4))


def test_updates_must_name_a_computed_gradient_and_a_parameter():
    base = problem()
    with pytest.raises(ProblemError, match="each parameter update names"):
        in_step(base, [((GW,), (A,))], "sgd")                               # a is not a graph input
    with pytest.raises(ProblemError, match="each parameter update names"):
        Problem(**{**base.__dict__, "updates": (ParamUpdate((GW,), (W,)),)})   # dW is still a graph output


PLAN = {"solver": "checkmate", "budgets": ["70%"]}


def config(optimizer: str | None = None, **plan):
    data = {"models": [{"name": "mlp", "factory": "torch.nn:Linear", "loss": "cross_entropy",
                        "batch_sizes": [4], "inputs": [{"shape": [8]}, {"shape": [], "dtype": "int64", "high": 4}]}],
            "plans": [{**PLAN, **plan}]}
    if optimizer is not None:
        data["optimizer"] = optimizer
    return parse_config(data, solvers=["checkmate"])


def test_plan_settings_reach_the_solve_stage():
    adamw = config(optimizer="adamw", optimizer_in_step=True)
    assert adamw.plans[0].solve_settings(adamw.optimizer).optimizer == "adamw"
    outside = config(optimizer="adamw")
    assert outside.plans[0].solve_settings(outside.optimizer).optimizer == "none"   # the plan keeps it outside
    default = config(optimizer_in_step=True)
    assert default.plans[0].solve_settings(default.optimizer).optimizer == "sgd"    # the pipeline's default


@pytest.mark.parametrize("settings, message", [
    ({"optimizer_in_step": True, "addresses": "greedy"}, "arena addresses do not combine"),
    ({"optimizer": "lion", "optimizer_in_step": True}, "'sgd', 'sgd-momentum', 'adam' or 'adamw'"),
])
def test_bad_optimizer_settings_are_refused(settings, message):
    with pytest.raises(ConfigError) as info:
        config(**settings)
    assert message in str(info.value)


def _pair() -> Problem:
    """n0: a = f(W1, W2, x) (40 B); n1: loss(a) (4 B); n2: (dW1, dW2) = g(loss, x) (100 B, 60 B); values W1, W2,
    x, a, loss, dW1, dW2 are ids 0..6."""
    w1, w2, x, a, loss, gw1, gw2 = range(7)
    return Problem(
        name="pair", cost=np.ones(3), workspace=np.zeros(3, dtype=np.int64), phase=("forward", "loss", "backward"),
        node_inputs=((w1, w2, x), (a,), (loss, x)), node_outputs=((a,), (loss,), (gw1, gw2)),
        value_bytes=np.array([100, 60, 8, 40, 4, 100, 60], dtype=np.int64),
        value_producer=np.array([-1, -1, -1, 0, 1, 2, 2], dtype=np.int64),
        outputs=(loss, gw1, gw2), order=np.arange(3))


def test_updates_after_one_step_run_as_one_optimizer_step():
    """n0: a = f(W1, W2, x) (40 B); n1: loss(a) (4 B); n2: (dW1, dW2) = g(loss, x) (100 B, 60 B): both updated
    after step 2, by one AdamW step, with the loss (4 B) and both gradients (160 B) live. Single-tensor kernels
    update one after another, each holding 2x its bytes while the one before keeps 1x: W1 then W2 needs
    max(200, 100 + 120) = 220 B, W2 then W1 max(120, 60 + 200) = 260 B; foreach kernels hold 1x of both at
    once: 160 B."""
    w1, w2, x, a, loss, gw1, gw2 = range(7)
    p = _pair()
    for updates, foreach, scratch in (([((gw1,), (w1,)), ((gw2,), (w2,))], False, 220),
                                      ([((gw2,), (w2,)), ((gw1,), (w1,))], False, 260),
                                      ([((gw1,), (w1,)), ((gw2,), (w2,))], True, 160)):
        sim = simulate(in_step(p, updates, "adamw", foreach), schedule(0, 1, 2))
        assert sim.timeline.tolist() == [40, 44, 4 + 160 + scratch], (updates, foreach)


def test_large_parameters_are_updated_in_slices_each_by_a_call_of_its_own():
    """As above with slice_bytes = 70 (slices of 64 B, a multiple of SLICE_ALIGN): W1 (100 B) in slices of 64 and
    36 B, each updated by an AdamW call of its own holding 2x the slice: 128 B at most, nothing after; W2 (60 B)
    stays whole (120 B, 60 B carried). W2 then W1: W2's call ends before W1's slices; W1 then W2: W1's slices,
    then W2 with nothing carried: 128 B either way, against 220 / 260 whole. The update floor: dW1 and 128 B.
    SGD with momentum allocates nothing and foreach kernels hold every slice's temporaries at once, so neither
    is sliced."""
    w1, w2, x, a, loss, gw1, gw2 = range(7)
    p = _pair()
    first, second = ((gw1,), (w1,)), ((gw2,), (w2,))
    sliced = in_step(p, [first, second], "adamw", slice_bytes=70)
    assert sliced.updates == (ParamUpdate((gw1,), (w1,), 0, 0, 128), ParamUpdate((gw2,), (w2,), 120, 60))
    assert sliced.optimizer_state_bytes == 2 * 160
    for updates in ([first, second], [second, first]):
        sim = simulate(in_step(p, updates, "adamw", slice_bytes=70), schedule(0, 1, 2))
        assert sim.timeline.tolist() == [40, 44, 4 + 160 + 128], updates
    assert min_budget_lower_bound(sliced) == 100 + 128
    assert in_step(p, [first, second], "sgd-momentum", slice_bytes=70).updates == \
        (ParamUpdate((gw1,), (w1,)), ParamUpdate((gw2,), (w2,)))
    assert in_step(p, [first, second], "adamw", True, slice_bytes=70).updates == \
        (ParamUpdate((gw1,), (w1,), 100, 100), ParamUpdate((gw2,), (w2,), 60, 60))


def test_update_order_moves_the_parameters_later_readers_before_its_gradient():
    """`update_order`: n3 (dx, reads W) moves before n2 (dW), so dW dies in the step that makes it (hand-worked
    timeline: a freed after n1, dx then dW, loss and out to the end); a reader of W that depends on the
    gradient stays after it; without updates the order is the default."""
    from dataclasses import replace

    from memplan.tasks.solve.core.orders import update_order

    p = in_step(problem(), [((GW,), (W,))], "sgd")
    order = update_order(p)
    assert order.tolist() == [0, 1, 3, 2, 4]
    sim = simulate(p, schedule(*order.tolist()))
    assert sim.timeline.tolist() == [40, 44, 34, 134, 54]
    (dw,) = np.flatnonzero(sim.copy_value == GW)
    assert sim.copy_start[dw] == sim.copy_end[dw] == 3
    reads_gradient = replace(p, node_inputs=((W, X), (A,), (LOSS, X), (LOSS, W, GW), (GX,)))
    assert update_order(reads_gradient).tolist() == [0, 1, 2, 3, 4]
    assert update_order(problem()).tolist() == [0, 1, 2, 3, 4]
