"""ACG solver (Feng & Huang 2021) on synthetic graphs: closed forms, exhaustive search, division tree."""

from __future__ import annotations

import itertools
import math

import networkx as nx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from memplan.tasks.solve.acg.dag import AcgGraphError, TensorDag, bits
from memplan.tasks.solve.acg.division import BRANCH, COMPLICATE, EDGE, LINEAR, division_tree, pieces, walk
from memplan.tasks.solve.acg.lcg import lcg_checkpoints
from memplan.tasks.solve.acg.search import DivisionSearch, acg_checkpoints


def chain(costs):
    graph = nx.DiGraph()
    for i, c in enumerate(costs):
        graph.add_node(i, cost=c)
    graph.add_edges_from((i, i + 1) for i in range(len(costs) - 1))
    return graph


def exhaustive_optimum(graph: nx.DiGraph, forced=(), weight=None) -> float:
    """Eq. (2) minimized over every checkpoint set containing source, target and `forced` whose
    segments (components of the other vertices) each have one entry and one exit checkpoint; with
    `weight` (vertex -> number), the checkpoints count their weight instead of their cost."""
    source = next(v for v in graph if graph.in_degree(v) == 0)
    target = next(v for v in graph if graph.out_degree(v) == 0)
    inner = [v for v in graph if v not in (source, target) and v not in forced]
    cost = nx.get_node_attributes(graph, "cost")
    best = math.inf
    for r in range(len(inner) + 1):
        for extra in itertools.combinations(inner, r):
            kept = {source, target, *forced, *extra}
            rest = graph.subgraph(set(graph) - kept)
            largest = 0
            for comp in nx.weakly_connected_components(rest):
                entries = {u for v in comp for u in graph.predecessors(v)} - comp
                exits = {w for v in comp for w in graph.successors(v)} - comp
                if len(entries) != 1 or len(exits) != 1:
                    break
                largest = max(largest, sum(cost[v] for v in comp))
            else:
                best = min(best, sum((weight or cost)[v] for v in kept) + largest)
    return best


@st.composite
def random_dags(draw, max_vertices=14):
    n = draw(st.integers(2, max_vertices))
    density = draw(st.sampled_from([0.15, 0.3, 0.5]))
    graph = nx.DiGraph()
    for v in range(n):
        graph.add_node(v, cost=draw(st.integers(0, 40)))
    pairs = [(i, j) for i in range(n) for j in range(i + 1, n)]
    picks = draw(st.lists(st.floats(0, 1), min_size=len(pairs), max_size=len(pairs)))
    graph.add_edges_from(p for p, x in zip(pairs, picks) if x < density)
    for v in range(1, n):
        if graph.in_degree(v) == 0:
            graph.add_edge(0, v)
    for v in range(n - 1):
        if graph.out_degree(v) == 0:
            graph.add_edge(v, n - 1)
    return graph


@pytest.mark.parametrize("m", range(2, 11))
def test_uniform_chain_reaches_closed_form(m):
    """Sec. 4 case (1): N = m^2 unit-cost vertices; optimum 2 sqrt(N) with about sqrt(N) segments."""
    n = m * m
    lcg = lcg_checkpoints([1] * n)
    acg = acg_checkpoints(TensorDag.from_networkx(chain([1] * n)))
    assert lcg.objective == acg.memory == 2 * m
    assert len(lcg.checkpoints) - 1 in (m - 1, m, m + 1)
    assert acg.checkpoints.bit_count() - 1 in (m - 1, m, m + 1)


@given(costs=st.lists(st.integers(0, 50), min_size=2, max_size=12))
@settings(max_examples=60, deadline=None)
def test_lcg_and_acg_match_exhaustive_on_chains(costs):
    truth = exhaustive_optimum(chain(costs))
    assert lcg_checkpoints(costs).objective == truth
    assert acg_checkpoints(TensorDag.from_networkx(chain(costs))).memory == truth


@given(graph=random_dags())
@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_acg_matches_exhaustive_on_random_dags(graph):
    dag = TensorDag.from_networkx(graph)
    solution = acg_checkpoints(dag)
    assert solution.memory == exhaustive_optimum(graph)
    assert all(p.independent for p in pieces(dag, solution.checkpoints))
    assert solution.memory == dag.mask_cost(solution.checkpoints) + max(
        (p.cost for p in pieces(dag, solution.checkpoints)), default=0)


@given(graph=random_dags(10), data=st.data())
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_weighted_search_matches_exhaustive(graph, data):
    """The budgeted mode's checkpoint weights w = l - mu * t may be negative: Algorithm 5-6 with w
    still finds the least sum of weights + largest segment."""
    weight = {v: graph.nodes[v]["cost"] - data.draw(st.integers(0, 60)) for v in graph}
    dag = TensorDag.from_networkx(graph)
    search = DivisionSearch(dag, division_tree(dag), [weight[label] for label in dag.labels])
    assert acg_checkpoints(dag, search=search).objective == exhaustive_optimum(graph, weight=weight)


@given(graph=random_dags(12), data=st.data())
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_forced_checkpoints_are_kept_and_optimal(graph, data):
    inner = list(graph)[1:-1]
    forced = data.draw(st.lists(st.sampled_from(inner), max_size=3, unique=True)) if inner else []
    dag = TensorDag.from_networkx(graph, forced=forced)
    solution = acg_checkpoints(dag)
    assert dag.forced & ~solution.checkpoints == 0
    assert solution.memory == exhaustive_optimum(graph, forced)


@given(graph=random_dags())
@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_division_tree_partitions_every_segment(graph):
    """Each division is made of IS (Definition 1) that, with the chain's splitting vertices or the
    complicate IS's connecting vertices, cover the parent's interior exactly once."""
    dag = TensorDag.from_networkx(graph)
    for seg in walk(division_tree(dag)):
        assert seg.cost == sum(graph.nodes[dag.labels[v]]["cost"] for v in bits(seg.interior))
        if seg.kind == EDGE:
            assert seg.interior == 0
            continue
        covered = 0
        for child in seg.children:
            inside = child.interior
            assert covered & inside == 0
            covered |= inside
            for v in bits(inside):
                assert (dag.pred_mask[v] | dag.succ_mask[v]) & ~child.vertices == 0
        if seg.kind == LINEAR:
            covered |= sum(1 << v for v in seg.chain[1:-1])
            assert [c.source for c in seg.children] == list(seg.chain[:-1])
        elif seg.kind == COMPLICATE:
            assert covered & seg.connecting == 0
            covered |= seg.connecting
        else:
            assert seg.kind == BRANCH and len(seg.children) >= 2
            assert all((c.source, c.target) == (seg.source, seg.target) for c in seg.children)
        assert covered == seg.interior


def test_paper_figure_3_segments():
    """Fig. 3: {v_k, v_j} is not an IS boundary (v_t depends on v_i); {v_i, v_t} is."""
    graph = nx.DiGraph([("i", "k"), ("k", "j"), ("j", "t"), ("i", "t")])
    nx.set_node_attributes(graph, 1, "cost")
    dag = TensorDag.from_networkx(graph)
    assert all(p.independent for p in pieces(dag, dag.mask_of("it")))
    assert not all(p.independent for p in pieces(dag, dag.mask_of("kjt")))


def test_solver_is_deterministic():
    graph = nx.gnp_random_graph(12, 0.3, seed=4, directed=True)
    dag_graph = nx.DiGraph((u, v) for u, v in graph.edges if u < v)
    dag_graph.add_nodes_from(range(12))
    for v in range(1, 12):
        if dag_graph.in_degree(v) == 0:
            dag_graph.add_edge(0, v)
    for v in range(11):
        if dag_graph.out_degree(v) == 0:
            dag_graph.add_edge(v, 11)
    nx.set_node_attributes(dag_graph, {v: 3 + (7 * v) % 11 for v in dag_graph}, "cost")
    runs = {acg_checkpoints(TensorDag.from_networkx(dag_graph)).checkpoints for _ in range(3)}
    assert len(runs) == 1


@pytest.mark.parametrize("edges, message", [
    ([("a", "b"), ("b", "a")], "cycle"),
    ([("a", "c"), ("b", "c")], "one source and one target"),
])
def test_bad_graphs_are_refused(edges, message):
    graph = nx.DiGraph(edges)
    nx.set_node_attributes(graph, 1, "cost")
    with pytest.raises(AcgGraphError, match=message):
        TensorDag.from_networkx(graph)


def test_missing_cost_is_named():
    graph = nx.DiGraph([("a", "b")])
    graph.nodes["a"]["cost"] = 1
    with pytest.raises(AcgGraphError, match="vertex 'b'"):
        TensorDag.from_networkx(graph)


def _graph(edges, cost):
    graph = nx.DiGraph(edges)
    nx.set_node_attributes(graph, cost, "cost")
    return graph


FRACTIONAL = [
    # a branch IS left whole while its interior weighs more than nothing
    (_graph([(0, 1), (0, 2), (1, 3), (2, 3)], {0: 12, 1: 9, 2: 4, 3: 3}), {0: 7.5, 1: 9.0, 2: 1.0, 3: -3.0}),
    # a complicate IS whose connecting vertices weigh more than keeping it whole
    (_graph([(0, 1), (0, 2), (0, 3), (1, 6), (2, 4), (2, 6), (3, 4), (3, 5), (4, 6), (5, 6)],
            {0: 1, 1: 11, 2: 0, 3: 1, 4: 2, 5: 2, 6: 2}),
     {0: 1.0, 1: 10.0, 2: -1.0, 3: 0.75, 4: 1.0, 5: 2.0, 6: 1.5}),
    # negative weights: the recursion's floor (no limit on segments) is below zero
    (_graph([(0, 1), (0, 3), (0, 5), (0, 7), (1, 2), (1, 6), (2, 4), (3, 4), (3, 6), (3, 7), (4, 7), (5, 6), (6, 7)],
            {0: 5, 1: 5, 2: 7, 3: 8, 4: 5, 5: 9, 6: 6, 7: 3}),
     {0: -5.0, 1: 5.0, 2: 2.0, 3: 8.0, 4: -5.0, 5: 9.0, 6: -9.0, 7: -9.5}),
    # the optimum leaves a segment: its cost counts in the objective
    (_graph([(0, 1), (0, 2), (0, 3), (0, 5), (1, 4), (1, 5), (2, 6), (3, 5), (4, 6), (5, 6)],
            {0: 7, 1: 6, 2: 2, 3: 8, 4: 5, 5: 1, 6: 4}),
     {0: 4.5, 1: 5.0, 2: -0.5, 3: 5.5, 4: 3.0, 5: -1.5, 6: 3.5}),
]


@pytest.mark.parametrize("graph, weight", FRACTIONAL)
def test_weighted_search_with_fractional_weights(graph, weight):
    """Weights l - mu t with a fractional multiplier: differences below one byte decide the optimum."""
    dag = TensorDag.from_networkx(graph)
    weights = [weight[label] for label in dag.labels]
    search = DivisionSearch(dag, division_tree(dag), weights)
    solution = acg_checkpoints(dag, search=search)
    assert solution.objective == exhaustive_optimum(graph, weight=weight)
    assert acg_checkpoints(dag, weights).objective == solution.objective
    assert solution.max_segment == max((p.cost for p in pieces(dag, solution.checkpoints)), default=0)
    assert solution.max_segment <= solution.max_term


def test_weights_must_match_the_vertices():
    dag = TensorDag.from_networkx(chain([1, 2, 3]))
    with pytest.raises(ValueError, match="^2 checkpoint weights for 3 vertices.$"):
        DivisionSearch(dag, division_tree(dag), [1.0, 2.0])
