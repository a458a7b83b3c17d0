"""Hierarchical planning (tasks/solve/hierarchical): the block chain, the retention-limited block MILP
against a closed form, the chain program against a brute force, and the solver end to end."""

import itertools
from dataclasses import replace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from memplan.tasks.solve import solve
from memplan.tasks.solve.core.remat_milp import build_model
from memplan.tasks.solve.hierarchical.blocks import block_chain, pinned_values, segments
from memplan.tasks.solve.hierarchical.chain import Choice, Sweep, chain_dp, chain_peak, nested_chain_dp
from memplan.tasks.solve.hierarchical.ladder import ladder
from memplan.tasks.solve.hierarchical.solver import compose
from memplan.tasks.solve.core.milp import MilpOptions, solve_milp
from memplan.tasks.solve.core.problem import Problem, Variant
from memplan.tasks.solve.core.simulator import default_schedule, simulate
from memplan.tasks.solve.core.solution import SolveOptions


def layered_step(layers: int, width: int = 3, mask: bool = False) -> Problem:
    """A training step of `layers` identical residual layers (x -> `width` chained nodes -> add x), a
    loss, and the mirrored backward: backward node of forward node f reads f's input and the gradient.
    With `mask`, node 0 also feeds a small value read by the first node of every layer."""
    fwd_edges, names, nbytes = [], [], []
    node = 0
    names.append("stem"); nbytes.append(8); node = 1                        # noqa: E702
    m = None
    if mask:
        names.append("mask"); nbytes.append(1); fwd_edges.append((0, 1)); m = 1; node = 2  # noqa: E702
    x = 0
    for _ in range(layers):
        prev = x
        for j in range(width):
            names.append(f"op{j}"); nbytes.append(8)                          # noqa: E702
            fwd_edges.append((prev, node))
            if j == 0 and m is not None:
                fwd_edges.append((m, node))
            prev, node = node, node + 1
        names.append("add"); nbytes.append(8)                                 # noqa: E702
        fwd_edges += [(prev, node), (x, node)]
        x, node = node, node + 1
    names.append("loss"); nbytes.append(1)                                    # noqa: E702
    fwd_edges.append((x, node))
    loss, node = node, node + 1
    nf = node
    reads = {t: [s for s, t2 in fwd_edges if t2 == t] for t in range(nf)}
    edges, grad_of = list(fwd_edges), {loss: None}
    for f in range(nf - 1, 0, -1):                                            # backward of f, reverse order
        names.append(f"{names[f]}_backward"); nbytes.append(8)                # noqa: E702
        edges += [(s, node) for s in reads[f]]
        g = max((grad_of[u] for u in range(f + 1, nf) if f in reads[u] and grad_of.get(u) is not None), default=None)
        if g is not None:
            edges.append((g, node))
        grad_of[f], node = node, node + 1
    return Problem.from_edges([1.0] * node, nbytes, edges, backward=[i >= nf for i in range(node)],
                              names=names, name=f"layers{layers}")


def test_blocks_partition_the_step_and_repeated_layers_share_a_key():
    problem = layered_step(6)
    chain = block_chain(problem, block_size=4)
    nodes = np.concatenate([b.nodes for b in chain.blocks])
    assert sorted(nodes.tolist()) == list(range(problem.num_nodes))
    for b in chain.blocks:                                          # forward first, in order
        assert all(problem.is_recomputable[b.nodes[:b.num_forward]])
        assert not any(problem.is_recomputable[b.nodes[b.num_forward:]])
    for node in range(problem.num_nodes):                           # nothing reads a later block's forward value
        if problem.is_recomputable[node]:
            for v in problem.node_inputs[node]:
                assert chain.block_of[problem.value_producer[v]] <= chain.block_of[node]
    keys = [b.key for b in chain.blocks]
    assert len(set(keys)) < len(keys)                               # the middle layers are one problem


def test_a_value_read_by_every_layer_is_pinned_so_the_layers_separate():
    problem = layered_step(6, mask=True)
    assert pinned_values(problem) == {1}
    assert len(segments(problem, set())) < len(segments(problem, {1})) - 2


def test_composing_the_no_recomputation_options_runs_each_node_once():
    problem = layered_step(5)
    chain = block_chain(problem, block_size=4)
    picked = [ladder(b.problem, b.num_forward, (), time_limit=1.0, gap=0.0)[0][0] for b in chain.blocks]
    schedule = compose(chain, picked)
    assert sorted(n for _, n in schedule) == list(range(problem.num_nodes))
    assert simulate(problem, schedule).peak_bytes == simulate(problem, default_schedule(problem)).peak_bytes


@pytest.mark.parametrize("kept", range(6))
def test_retention_limited_checkmate_milp_matches_the_closed_form(linear, kept):
    """Checkmate's linear graph, n = 4, no peak limit, at most `kept` unit values retained into the first
    backward stage: every forward value is read in the backward, so each one not retained is computed
    once more, and that suffices: cost (2n + 1) + (n + 1 - kept)."""
    n = 4
    problem = linear(n)
    model, _ = build_model(problem, 10 ** 6, retained=(n + 1, kept))
    result = solve_milp(model, MilpOptions(backend="highs", gap=0.0))
    assert result.status == "optimal"
    assert result.objective == pytest.approx(2 * n + 1 + n + 1 - kept)


def test_ladder_options_report_what_the_simulator_measures():
    problem = layered_step(3)
    block = max(block_chain(problem, block_size=5).blocks, key=lambda b: len(b.nodes))
    options, complete = ladder(block.problem, block.num_forward, time_limit=10.0, gap=0.0)
    assert complete and len(options) >= 3
    for o in options:
        sim = simulate(block.problem, [("compute", n) for n in o.schedule])
        assert max(o.forward_peak, o.backward_peak) == sim.peak_bytes
        assert o.schedule[o.split - 1] == block.num_forward - 1 and block.num_forward - 1 not in o.schedule[:o.split - 1]
    full, bare = options[0], options[1]
    assert full.retained > bare.retained and bare.cost(block.problem.cost) > full.cost(block.problem.cost)


choice = st.builds(Choice, st.integers(0, 9).map(float), st.integers(0, 40), st.integers(0, 40), st.integers(0, 30))


@settings(max_examples=150, deadline=None)
@given(st.lists(st.lists(choice, min_size=1, max_size=3), min_size=1, max_size=4),
       st.lists(st.integers(0, 20), min_size=4, max_size=4), st.integers(0, 150))
def test_chain_program_equals_brute_force(choices, external, budget):
    external = np.array(external)
    best = min((sum(choices[i][o].cost for i, o in enumerate(p)) for p in
                itertools.product(*(range(len(c)) for c in choices)) if chain_peak(choices, external, p) <= budget),
               default=None)
    picked = chain_dp(choices, external, budget)
    if best is None:
        assert picked is None
    else:
        assert chain_peak(choices, external, picked) <= budget
        assert sum(choices[i][o].cost for i, o in enumerate(picked)) == best


def test_chain_estimate_bounds_the_simulated_peak():
    problem = layered_step(8, mask=True)
    chain = block_chain(problem, block_size=4)
    per_block = [ladder(b.problem, b.num_forward, time_limit=5.0, gap=0.0)[0] for b in chain.blocks]
    choices = [[Choice(o.cost(b.problem.cost), o.forward_peak, o.backward_peak, o.retained) for o in opts]
               for b, opts in zip(chain.blocks, per_block)]
    external = chain.external
    full = simulate(problem, default_schedule(problem)).peak_bytes
    seen = set()
    for budget in np.linspace(0.2 * full, 1.1 * full, 25):
        picked = chain_dp(choices, external, budget)
        if picked is not None:
            seen.add(tuple(picked))
            sim = simulate(problem, compose(chain, [per_block[i][o] for i, o in enumerate(picked)]))
            assert sim.peak_bytes <= chain_peak(choices, external, picked) <= budget
    assert len(seen) >= 4


def test_hierarchical_fits_budgets_the_segment_baselines_cannot():
    problem = layered_step(8)
    full = simulate(problem, default_schedule(problem)).peak_bytes
    opts = SolveOptions(time_limit=60, portfolio=False, params={"block_size": 4, "inner_time_limit": 5.0})
    plain = SolveOptions(time_limit=60)
    tight = int(0.35 * full)
    assert not any(solve(problem, s, tight, plain).feasible for s in ("ap-greedy", "linearized-greedy", "acg"))
    assert solve(problem, "hierarchical", tight, opts).feasible
    for fraction in (0.8, 0.6, 0.45):
        budget = int(fraction * full)
        ours = solve(problem, "hierarchical", budget, opts)
        assert ours.objective <= solve(problem, "ap-greedy", budget, plain).objective


def test_time_saving_variants_are_fixed_for_the_checkmate_inner_solver():
    """A variant that reads and allocates what its default does at half the cost (the GELU's tanh by its
    sigmoid identity) runs on every compute of its node, so the plan costs what the same step with those
    nodes at the lower cost costs; the bound is every node once in its cheapest implementation."""
    plain = layered_step(6)
    fast = [i for i, name in enumerate(plain.node_names) if name == "op1"]
    variants = tuple((Variant("sigmoid", 0.5, 0, plain.node_inputs[i], plain.node_outputs[i]),) if i in fast else ()
                     for i in range(plain.num_nodes))
    offered = replace(plain, variants=variants)
    cheaper = replace(plain, cost=np.where(np.isin(np.arange(plain.num_nodes), fast), 0.5, plain.cost))
    opts = SolveOptions(time_limit=60, portfolio=False, params={"block_size": 4, "inner_time_limit": 5.0})
    budget = int(0.5 * simulate(plain, default_schedule(plain)).peak_bytes)
    sol, reference = solve(offered, "hierarchical", budget, opts), solve(cheaper, "hierarchical", budget, opts)
    assert sol.feasible and reference.feasible
    runs = [s for s in sol.schedule if s[1] in fast]
    assert len(runs) > len(fast) and all(s[2:] == ("sigmoid",) for s in runs)          # recomputed ones too
    assert sol.objective == pytest.approx(reference.objective)
    assert sol.objective < solve(plain, "hierarchical", budget, opts).objective
    assert sol.bound == pytest.approx(cheaper.cost.sum())


def test_a_step_without_forward_nodes_runs_in_the_default_order():
    problem = Problem.from_edges([1.0, 2.0], [4, 4], [(0, 1)], backward=[True, True])
    sol = solve(problem, "hierarchical", 8, SolveOptions(portfolio=False))
    assert sol.schedule == default_schedule(problem) and sol.objective == 3.0
    assert not solve(problem, "hierarchical", 7, SolveOptions(portfolio=False)).feasible


def test_below_its_reach_the_portfolio_answers_with_a_cheap_solver_as_feasible():
    """A budget only a cheap solver meets: the answer is that schedule, status feasible (no time limit
    stopped anything), the source named."""
    problem = layered_step(8)
    full = simulate(problem, default_schedule(problem)).peak_bytes
    params = {"block_size": 40, "inner_time_limit": 5.0, "rungs": [[1.0, 1.0]],   # one block: no option lowers its peak
              "greedy": False}
    budget = int(0.8 * full)
    alone = solve(problem, "hierarchical", budget, SolveOptions(time_limit=60, portfolio=False, params=params))
    assert alone.status == "no_solution"
    sol = solve(problem, "hierarchical", budget, SolveOptions(time_limit=60, params=params))
    assert sol.feasible and sol.status == "feasible" and sol.source != "hierarchical"


def with_modules(problem: Problem, layers: int, width: int = 3) -> Problem:
    """`layered_step(layers, width)` with each layer's forward nodes recorded as one module call."""
    modules = [None] * problem.num_nodes
    for i in range(layers):
        for j in range(width + 1):
            modules[1 + i * (width + 1) + j] = f"layer{i}"
    return replace(problem, node_modules=tuple(modules))


@pytest.mark.parametrize("every, kept_adds", [(1, 4), (2, 2), (4, 1)])
def test_module_checkpoint_recomputes_each_group_once(every, kept_adds):
    problem = with_modules(layered_step(4), 4)
    sol = solve(problem, "module-checkpoint", 10**9, SolveOptions(params={"every": every}))
    counts = np.bincount([step[1] for step in sol.schedule], minlength=problem.num_nodes)
    assert counts.max() == 2                                             # at most one extra forward
    # closed form: every layer node runs again except the adds that end a group (kept)
    assert sol.objective == problem.cost.sum() + 4 * 4 - kept_adds
    eager = simulate(problem, default_schedule(problem)).peak_bytes
    assert sol.predicted_peak_bytes < eager if every < 4 else sol.predicted_peak_bytes == eager  # one group: all live


def test_module_checkpoint_searches_the_cheapest_group_size_that_fits():
    problem = with_modules(layered_step(4), 4)
    peaks = {n: solve(problem, "module-checkpoint", 10**9, SolveOptions(params={"every": n})) for n in (1, 2, 4)}
    budget = peaks[2].predicted_peak_bytes
    auto = solve(problem, "module-checkpoint", budget)
    fitting = [s.objective for s in peaks.values() if s.predicted_peak_bytes <= budget]
    assert auto.feasible and auto.objective == min(fitting)
    assert not solve(layered_step(4), "module-checkpoint", 10**9).feasible   # no modules recorded


def test_blocks_follow_recorded_module_boundaries():
    problem = with_modules(layered_step(4), 4)
    chain = block_chain(problem, block_size=100)                          # size alone would make one block
    forward = [[problem.node_modules[n] for n in b.nodes[:b.num_forward]] for b in chain.blocks]
    layer_blocks = [f for f in forward if f[0] is not None]
    assert [f[0] for f in layer_blocks] == [f"layer{i}" for i in range(4)]
    assert all(len(set(f)) == 1 and len(f) == 4 for f in layer_blocks)
    assert len({b.key for b, f in zip(chain.blocks, forward) if f[0] is not None}) <= 2


def nested_sequences(k_options: list[int], s: int, t: int):
    """Every operation sequence of Rotor's family on blocks s..t: keep a block's option and recurse on the
    rest, or sweep s..s'-1 forward, process s'..t, then s..s'-1 again."""
    for o in range(k_options[s]):
        for rest in ([[]] if s == t else nested_sequences(k_options, s + 1, t)):
            yield [("forward", s, o), *rest, ("backward", s, o)]
    for split in range(s + 1, t + 1):
        for later in nested_sequences(k_options, split, t):
            for earlier in nested_sequences(k_options, s, split - 1):
                yield [("sweep", i, -1) for i in range(s, split)] + later + earlier


def walk(ops, choices, sweeps, external, budget):
    """Cost of an operation sequence, or None when the bytes held plus the running part's peak exceed
    the budget. Held, as the simulator frees: a forward part's retained bytes until the block's backward
    part starts; a sweep's output until its last read (an operation on the next block) before the block
    is computed again."""
    held, cost, release = 0, 0.0, {}
    for p, (kind, i, o) in enumerate(ops):
        if kind == "forward":
            c = choices[i][o]
            if held + c.forward_peak > budget:
                return None
            held += c.retained
            cost += c.cost
        elif kind == "sweep":
            if held + sweeps[i].peak > budget:
                return None
            again = next((q for q in range(p + 1, len(ops)) if ops[q][1] == i and ops[q][0] != "backward"), len(ops))
            last = max((q for q in range(p + 1, again) if ops[q][1] == i + 1), default=p)
            release.setdefault(last, []).append(sweeps[i].output)
            held += sweeps[i].output
            cost += sweeps[i].cost
        else:                                           # the backward peak counts the block's own bytes
            held -= next(choices[i][f[2]].retained for f in reversed(ops[:p]) if f[:2] == ("forward", i))
            if held + external[i] + choices[i][o].backward_peak > budget:
                return None
        held -= sum(release.pop(p, []))
        if held > budget:
            return None
    return cost


small_choice = st.builds(Choice, st.integers(1, 9).map(float), st.integers(0, 12), st.integers(0, 12), st.integers(0, 8))


@settings(max_examples=60, deadline=None)
@given(st.lists(st.lists(small_choice, min_size=1, max_size=2), min_size=1, max_size=3),
       st.lists(st.tuples(st.integers(1, 9), st.integers(0, 10), st.integers(0, 6)), min_size=3, max_size=3),
       st.lists(st.integers(0, 5), min_size=3, max_size=3), st.integers(4, 40))
def test_nested_chain_program_equals_brute_force(choices, sweep_rows, external, budget):
    sweeps = [Sweep(float(c), max(p, x), x) for c, p, x in sweep_rows][:len(choices)]
    external = np.array(external[:len(choices)])
    costs = [walk(seq, choices, sweeps, external, budget)
             for seq in nested_sequences([len(o) for o in choices], 0, len(choices) - 1)]
    feasible = [c for c in costs if c is not None]
    ops = nested_chain_dp(choices, sweeps, external, budget)
    if not feasible:
        assert ops is None
        return
    assert ops is not None and walk(ops, choices, sweeps, external, budget) == min(feasible)
