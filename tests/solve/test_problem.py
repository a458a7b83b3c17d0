import json

import numpy as np
import pytest

from memplan.runtime.tracing.facts import graph_facts
from memplan.runtime.format.graph import Node, OpGraph, Value
from memplan.tasks.solve.core.problem import Problem, ProblemError


def _tiny_opgraph() -> OpGraph:
    """x (input), w (param) -> node 0 (mm: a) -> node 1 (relu: b, mask) -> node 2 (loss)."""
    values = [
        Value(0, 64, (4, 4), "float32", "input", "x", None),
        Value(1, 64, (4, 4), "float32", "param", "w", None),
        Value(2, 64, (4, 4), "float32", "activation", "a", 0),
        Value(3, 64, (4, 4), "float32", "activation", "b", 1),
        Value(4, 16, (4, 4), "bool", "activation", "mask", 1),
        Value(5, 4, (), "float32", "output", "loss", 2),
    ]
    nodes = [
        Node(0, "mm", ("aten.mm.default",), "forward", (0, 1), (2,)),
        Node(1, "relu", ("aten.relu.default",), "forward", (2,), (3, 4)),
        Node(2, "sum", ("aten.sum.default",), "loss", (3, 3, 4), (5,)),
    ]
    graph = OpGraph(values, nodes, [5], {"model": "tiny"})
    graph.meta.update(graph_facts(graph))      # as runtime.capture records them
    return graph


def test_from_graph_keeps_ids_costs_and_constant_bytes():
    graph = _tiny_opgraph()
    p = Problem.from_graph(graph, {0: (2.5, 100), 1: (1.0, 0), 2: (0.5, 8)})
    assert p.num_nodes == 3 and p.num_values == 6
    assert p.cost.tolist() == [2.5, 1.0, 0.5] and p.workspace.tolist() == [100, 0, 8]
    assert p.constant_bytes == 128
    assert p.node_inputs[2] == (3, 4)          # duplicate read folded
    assert p.node_outputs[1] == (3, 4) and p.node_bytes.tolist() == [64, 80, 4]
    assert p.outputs == (5,) and p.fingerprint == graph.fingerprint
    assert p.value_users[2] == (1,) and p.value_users[0] == (0,)


def test_from_graph_without_costs_is_unit_cost():
    p = Problem.from_graph(_tiny_opgraph())
    assert p.cost.tolist() == [1.0, 1.0, 1.0] and not p.workspace.any()


def test_from_graph_names_missing_costs():
    with pytest.raises(ProblemError, match=r"no entry for nodes \[1\]"):
        Problem.from_graph(_tiny_opgraph(), {0: (1.0, 0), 2: (1.0, 0)})


def test_checkmate_layout(tmp_path):
    path = tmp_path / "g.json"
    nodes = [{"id": i, "name": f"n{i}", "backward": i > 1, "cost_cpu": 10 * i, "cost_ram": 100 + i}
             for i in range(4)]
    links = [{"source": 0, "target": 1}, {"source": 1, "target": 2}, {"source": 0, "target": 3},
             {"source": 2, "target": 3}]
    path.write_text(json.dumps({"directed": True, "multigraph": False, "graph": {}, "nodes": nodes, "links": links}))
    p = Problem.from_node_link(path)
    assert p.phase == ("forward", "forward", "backward", "backward")
    assert p.node_inputs[3] == (0, 2) and p.outputs == (3,)
    assert p.value_bytes.tolist() == [100, 101, 102, 103] and p.constant_bytes == 0
    assert p.order.tolist() == [0, 1, 2, 3] and p.node_names[2] == "n2"


def test_random_layered_layout_uses_given_order(tmp_path):
    path = tmp_path / "r.json"
    nodes = [{"name": i, "out_cost": 10 + i, "duration": i, "param_cost": 0} for i in range(4)]
    links = [{"0": 0, "1": 2}, {"0": 2, "1": 3}, {"0": 3, "1": 1}]
    path.write_text(json.dumps({"graph": {"order": [0, 2, 3, 1], "target_node": 1}, "nodes": nodes, "links": links}))
    p = Problem.from_node_link(path)
    assert p.order.tolist() == [0, 2, 3, 1] and p.outputs == (1,)
    assert p.position.tolist() == [0, 3, 1, 2]
    assert set(p.phase) == {"forward"}


def test_node_link_errors_name_the_fault(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text('{"nodes": [{"id": 0, "cost_ram": 1}], "links": []}')
    with pytest.raises(ProblemError, match="lacks one of the keys"):
        Problem.from_node_link(bad)
    cyc = tmp_path / "cyc.json"
    nodes = [{"id": i, "name": "x", "backward": False, "cost_cpu": 1, "cost_ram": 1} for i in range(2)]
    cyc.write_text(json.dumps({"nodes": nodes, "links": [{"source": 1, "target": 0}]}))
    with pytest.raises(ProblemError, match="must be topological"):
        Problem.from_node_link(cyc)
    trunc = tmp_path / "trunc.json"
    trunc.write_text('{"nodes": [')
    with pytest.raises(ProblemError, match="cannot read node-link graph"):
        Problem.from_node_link(trunc)


def test_bad_sizes_and_costs_rejected():
    with pytest.raises(ProblemError, match="finite and non-negative"):
        Problem.from_edges([1.0, -1.0], [1, 1], [(0, 1)])
    with pytest.raises(ProblemError, match="does not exist"):
        Problem.from_edges([1.0, 1.0], [1, 1], [(0, 5)])


def test_load_dispatches_on_format(tmp_path, benchmark_paths):
    from datetime import datetime, timezone

    from memplan.tasks.problems import load_problem
    from memplan.tasks.store.profiles import ProfileNotFoundError, new_run_id, write_run
    from memplan.tasks.store.schema import SCHEMA_VERSION

    graph = _tiny_opgraph()
    graph.save(tmp_path / "g.json")
    with pytest.raises(ProfileNotFoundError, match="No complete profile"):
        load_problem(tmp_path / "g.json", store=tmp_path / "db")
    run_id = new_run_id()
    write_run([dict(schema_version=SCHEMA_VERSION, run_id=run_id, created_at=datetime(2026, 1, 1, tzinfo=timezone.utc),
                    fingerprint=graph.fingerprint, model="tiny", graph_nodes=len(graph.nodes), device="cpu",
                    device_type="cpu", node_id=n.id, impl="default", time_ms=0.5 + n.id, output_bytes=8,
                    workspace_bytes=2 * n.id) for n in graph.nodes], tmp_path / "db")
    loaded = load_problem(tmp_path / "g.json", store=tmp_path / "db")
    assert loaded.problem.fingerprint == graph.fingerprint and loaded.profile_run_id == run_id
    assert loaded.problem.cost_unit == "ms" and loaded.problem.cost.tolist() == [0.5 + n.id for n in graph.nodes]
    assert loaded.problem.workspace.tolist() == [2 * n.id for n in graph.nodes]
    resnet = next(p for p in benchmark_paths if p.name.startswith("ResNet50") and "train" in p.name)
    p = load_problem(resnet).problem
    assert p.cost_unit is None
    assert p.num_nodes == 353 and sum(map(len, p.node_inputs)) == 751
    assert np.array_equal(p.order, np.arange(353))


@pytest.mark.parametrize("choice, offered", [("all", {"mask", "bitmask", "inplace", "mask-inplace", "bitmask-inplace",
                                                      "sigmoid"}),
                                             ("bit-identical", {"mask", "bitmask", "inplace", "mask-inplace",
                                                                "bitmask-inplace"}),
                                             ("none", set())])
def test_load_offers_the_variants_a_plan_allows(tmp_path, choice, offered):
    """A captured Linear-ReLU-Linear-Tanh-Linear net, profiled in every variant: `variants` = "all" offers the
    ReLU's masks and in-place runs and the tanh's sigmoid identity, "bit-identical" all but the sigmoid (within
    tolerance only, though this profile found it exact), "none" nothing; value ids are the same in all three. A
    bad choice names the choices."""
    from datetime import datetime, timezone

    import torch

    from memplan import runtime
    from memplan.runtime.variants.offered import graph_variants
    from memplan.tasks.problems import load_problem
    from memplan.tasks.store.profiles import new_run_id, write_run
    from memplan.tasks.store.schema import SCHEMA_VERSION

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 8), torch.nn.Tanh(),
                                torch.nn.Linear(8, 2))
    graph = runtime.capture(model, lambda m, x: m(x).sum(), (torch.randn(3, 4),))
    graph.save(tmp_path / "g.json")
    impls = [(n.id, "default") for n in graph.nodes] + \
        [(n, name) for n, specs in graph_variants(graph).specs.items() for name in specs]
    run_id = new_run_id()
    write_run([dict(schema_version=SCHEMA_VERSION, run_id=run_id, created_at=datetime(2026, 1, 1, tzinfo=timezone.utc),
                    fingerprint=graph.fingerprint, model="net", graph_nodes=len(graph.nodes), device="cpu",
                    device_type="cpu", node_id=n, impl=impl, time_ms=1.0, output_bytes=8, workspace_bytes=0,
                    exact=None if impl == "default" else True)
               for n, impl in impls], tmp_path / "db")
    p = load_problem(tmp_path / "g.json", store=tmp_path / "db", variants=choice).problem
    assert {name for n in range(p.num_nodes) for name in p.impls(n)} - {"default"} == offered
    assert p.num_values == load_problem(tmp_path / "g.json", store=tmp_path / "db").problem.num_values
    with pytest.raises(ProblemError, match="'all', 'bit-identical', 'none'"):
        load_problem(tmp_path / "g.json", store=tmp_path / "db", variants="exact")
