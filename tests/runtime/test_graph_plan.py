"""OpGraph and Plan: JSON round trips, fingerprints, validation and refusals (torch-free code)."""

import json
import subprocess
import sys

import pytest

from memplan.runtime.format.graph import GraphFormatError, Node, OpGraph, Value
from memplan.runtime.format.plan import Plan, PlanError, default_plan


def chain_graph(n=4, nbytes=100):
    """x -> a0 -> a1 -> ... -> a{n-1} (the loss), one node per value."""
    values = [Value(0, 40, (10,), "float32", "input", "x", None)]
    nodes = []
    for i in range(n):
        kind = "output" if i == n - 1 else "activation"
        values.append(Value(i + 1, nbytes, (nbytes // 4,), "float32", kind, f"a{i}", i))
        nodes.append(Node(i, f"op{i}", ("aten.relu.default",), "forward", (i,), (i + 1,)))
    return OpGraph(values, nodes, [n])


def test_graph_json_round_trip_keeps_content_and_fingerprint(tmp_path):
    g = chain_graph()
    g.meta["model"] = "chain"
    g.save(tmp_path / "g.json")
    h = OpGraph.load(tmp_path / "g.json")
    assert h.fingerprint == g.fingerprint
    assert h.values == g.values and h.nodes == g.nodes and h.outputs == g.outputs and h.meta == g.meta
    assert h.program is None
    assert not [p for p in tmp_path.iterdir() if p.name != "g.json"]  # no temporary file left


def test_fingerprint_ignores_names_and_meta_but_not_shapes():
    g = chain_graph()
    renamed = OpGraph([Value(v.id, v.bytes, v.shape, v.dtype, v.kind, "other", v.producer) for v in g.values],
                      g.nodes, g.outputs, {"model": "x"})
    assert renamed.fingerprint == g.fingerprint
    assert chain_graph(nbytes=200).fingerprint != g.fingerprint
    assert chain_graph(n=5).fingerprint != g.fingerprint


def test_tampered_graph_file_is_refused(tmp_path):
    data = chain_graph().to_json()
    data["values"][1]["bytes"] = 1
    (tmp_path / "g.json").write_text(json.dumps(data))
    with pytest.raises(GraphFormatError, match="stored fingerprint .* does not match"):
        OpGraph.load(tmp_path / "g.json")


@pytest.mark.parametrize("edit, message", [
    (lambda d: d.update(version=2), "version 2"),
    (lambda d: d["values"][1].pop("bytes"), r"values\[1\] lacks key 'bytes'"),
    (lambda d: d["nodes"][2].update(inputs=[3]), "reads value 3 before its producer"),
    (lambda d: d["values"][2].update(kind="weird"), "kind 'weird'"),
    (lambda d: d.update(outputs=[99]), "graph output 99"),
])
def test_malformed_graph_is_refused(edit, message):
    data = chain_graph().to_json()
    edit(data)
    with pytest.raises(GraphFormatError, match=message):
        OpGraph.from_json(data)


def test_default_plan_is_eager_order_and_valid(tmp_path):
    g = chain_graph()
    plan = default_plan(g)
    assert plan.schedule == [{"compute": i} for i in range(4)]
    plan.validate(g)
    plan.save(tmp_path / "p.json")
    again = Plan.load(tmp_path / "p.json")
    assert again.schedule == plan.schedule and again.fingerprint == g.fingerprint
    assert again.provenance["solver"] == "default"


def test_plan_accepts_tuple_steps_and_recomputation():
    g = chain_graph()
    plan = Plan(g.fingerprint, [("compute", 0), ("compute", 1), ("free", 2), ("compute", 1, "default"),
                                ("compute", 2), ("compute", 3)])
    assert plan.schedule[2] == {"free": 2} and plan.schedule[3] == {"compute": 1}  # default impl is implicit
    plan.validate(g)
    fast = Plan(g.fingerprint, [("compute", 0), ("compute", 1, "fast"), ("compute", 2), ("compute", 3)])
    with pytest.raises(PlanError, match=r"schedule\[1\]: node 1 has no implementation variant 'fast'; it offers default"):
        fast.validate(g)


def test_plan_json_keeps_addresses_and_predictions(tmp_path):
    g = chain_graph()
    schedule = [("compute", 0), ("compute", 1), ("compute", 2), ("compute", 1), ("compute", 3)]
    plan = Plan(g.fingerprint, schedule, addresses={(0, 1): 0, (1, 2): 128, (3, 2): 256},
                predicted={"peak_bytes": 200, "time_ms": None, "arena_bytes": 356}, provenance={"solver": "olla"})
    plan.validate(g)
    plan.save(tmp_path / "p.json")
    raw = json.loads((tmp_path / "p.json").read_text())
    assert raw["version"] == 2 and raw["addresses"] == [[0, 1, 0], [1, 2, 128], [3, 2, 256]]
    again = Plan.load(tmp_path / "p.json")
    assert again.addresses == {(0, 1): 0, (1, 2): 128, (3, 2): 256}            # two copies of value 2
    assert again.predicted == {"peak_bytes": 200, "time_ms": None, "arena_bytes": 356}


@pytest.mark.parametrize("addresses, message", [
    ({(1, 1): 0}, r"name value 1 at schedule\[1\], but that step does not allocate it"),
    ({(3, 4): 0}, r"final copy as a graph output"),
])
def test_addresses_must_name_copies_inside_the_step(addresses, message):
    g = chain_graph()
    with pytest.raises(PlanError, match=message):
        Plan(g.fingerprint, default_plan(g).schedule, addresses=addresses).validate(g)


@pytest.mark.parametrize("form, expected", [(None, "executor"), ("policy", "policy")])
def test_a_plans_form_is_typed_from_its_keys(form, expected):
    g = chain_graph()
    provenance = {} if form is None else {"form": form}
    assert Plan(g.fingerprint, default_plan(g).schedule, provenance=provenance).form == expected


@pytest.mark.parametrize("form", ["executor", "compiled", "Policy", 3])
def test_a_form_the_provenance_cannot_hold_is_refused(form):
    g = chain_graph()
    with pytest.raises(PlanError, match=r"provenance\['form'\] = .*records only the policy form"):
        Plan(g.fingerprint, default_plan(g).schedule, provenance={"form": form})


def _v1_file(tmp_path, schedule, offsets=None):
    """A plan file as memplan 0.1 wrote it (format version 1)."""
    from memplan.runtime.format.jsonio import sha256_hex

    body = {"format": "memplan-plan", "version": 1, "fingerprint": chain_graph().fingerprint, "schedule": schedule}
    if offsets is not None:
        body["offsets"] = offsets
    body |= {"predicted": {"peak_bytes": 200, "constant_bytes": 40, "compute_cost": 4.0, "time_ms": None},
             "provenance": {"solver": "checkmate", "memplan_version": "0.1.0"}}
    (tmp_path / "v1.json").write_text(json.dumps({**body, "checksum": sha256_hex(body)}))
    return tmp_path / "v1.json"


def test_version_1_plans_load_and_their_offsets_become_addresses(tmp_path):
    g = chain_graph()
    plan = Plan.load(_v1_file(tmp_path, [{"compute": i} for i in range(4)], {"1": 0, "2": 128}))
    assert plan.schedule == default_plan(g).schedule
    plan.validate(g)
    assert plan.addresses == {(0, 1): 0, (1, 2): 128}
    plan.save(tmp_path / "v2.json")
    assert json.loads((tmp_path / "v2.json").read_text())["version"] == 2
    twice = Plan.load(_v1_file(tmp_path, [{"compute": 0}, {"compute": 1}, {"compute": 1}, {"compute": 2},
                                          {"compute": 3}], {"2": 0}))
    with pytest.raises(PlanError, match="computes 2 times"):
        twice.validate(g)


@pytest.mark.parametrize("schedule, message", [
    ([("compute", 0), ("compute", 2), ("compute", 3)], r"schedule\[1\] computes node 2 .* reads value 2 .* "
                                                      r"producer node 1 has not been computed"),
    ([("compute", 0), ("compute", 1), ("free", 2), ("compute", 2), ("compute", 3)],
     r"reads value 2 \(a1\), but it was freed at schedule\[2\]"),
    ([("compute", 0), ("compute", 1), ("compute", 2)], r"graph outputs \[4\]"),
    ([("compute", 0), ("compute", 1), ("compute", 2), ("compute", 3), ("free", 4)], r"graph outputs \[4\]"),
    ([("compute", 7)], "node 7, which does not exist"),
    ([("compute", 0), ("free", 9)], "value 9, which does not exist"),
    ([("compute", 0), ("free", 0)], "graph inputs are always resident"),
    ([("compute", 0), ("free", 2)], "value 2 .* which is not resident"),
])
def test_invalid_schedules_are_refused(schedule, message):
    g = chain_graph()
    with pytest.raises(PlanError, match=message):
        Plan(g.fingerprint, schedule).validate(g)


def test_plan_for_another_graph_names_both_fingerprints():
    g, other = chain_graph(), chain_graph(nbytes=200)
    with pytest.raises(PlanError) as err:
        default_plan(other).validate(g)
    assert other.fingerprint in str(err.value) and g.fingerprint in str(err.value)


def test_truncated_plan_file_is_refused(tmp_path):
    g = chain_graph()
    default_plan(g).save(tmp_path / "p.json")
    text = (tmp_path / "p.json").read_text()
    (tmp_path / "p.json").write_text(text[: len(text) // 2])
    with pytest.raises(PlanError, match=r"p.json is not valid JSON .* truncated"):
        Plan.load(tmp_path / "p.json")


def test_tampered_plan_file_is_refused(tmp_path):
    g = chain_graph()
    default_plan(g).save(tmp_path / "p.json")
    data = json.loads((tmp_path / "p.json").read_text())
    data["schedule"].insert(1, {"compute": 0})
    (tmp_path / "p.json").write_text(json.dumps(data))
    with pytest.raises(PlanError, match="edited or corrupted"):
        Plan.load(tmp_path / "p.json")
    del data["checksum"]
    (tmp_path / "p.json").write_text(json.dumps(data))
    with pytest.raises(PlanError, match="key 'checksum' is None"):
        Plan.load(tmp_path / "p.json")


@pytest.mark.parametrize("edit, message", [
    (lambda d: d.update(version=99), "version 99 is not supported"),
    (lambda d: d.update(format="pickle"), "key 'format' is 'pickle'"),
    (lambda d: d.pop("fingerprint"), "required key 'fingerprint' is missing"),
    (lambda d: d.update(schedule=[{"compute": -1}]), r"schedule\[0\] is \{'compute': -1\}"),
    (lambda d: d.update(schedule=[{"run": 0}]), r"schedule\[0\]"),
    (lambda d: d.update(offsets={"1": 0}), r"unknown keys \['offsets'\] for plan version 2"),
    (lambda d: d.update(addresses=[[0, 1]]), r"addresses entry \[0, 1\] is not \[step, value, offset\]"),
    (lambda d: d.update(addresses=[[9, 1, 0]]), r"names schedule\[9\], which is not a compute step"),
    (lambda d: d.update(addresses=[[0, 1, 0], [0, 1, 64]]), r"copy \(step 0, value 1\) twice"),
    (lambda d: d.update(predicted={"peak": 1}), r"predicted\['peak'\]"),
    (lambda d: d.update(extra=1), r"unknown keys \['extra'\]"),
])
def test_malformed_plan_dict_is_refused(edit, message):
    data = default_plan(chain_graph()).to_json()
    del data["checksum"]
    edit(data)
    with pytest.raises(PlanError, match=message):
        Plan.load(data)


def test_missing_plan_file_names_the_path(tmp_path):
    with pytest.raises(PlanError, match="cannot read plan file .*nothing.json"):
        Plan.load(tmp_path / "nothing.json")


def test_graph_and_plan_modules_do_not_import_torch():
    code = ("import sys, runtime, runtime.format.graph, runtime.format.plan, runtime.variants.offered; "
            "from memplan.runtime import Plan, OpGraph, default_plan; "
            "assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True)
