"""The plan checksum covers every key a plan carries, dict plans are checked like files, and addresses or
version-1 offsets naming values the graph does not have are refused (torch-free)."""

from __future__ import annotations

import json

import pytest

from memplan.runtime.format.graph import Value
from memplan.runtime.format.jsonio import sha256_hex
from memplan.runtime.format.plan import Plan, PlanError, default_plan, normalize_step

from .test_graph_plan import chain_graph

RECOMPUTE = [("compute", 0), ("compute", 1), ("compute", 2), ("compute", 1), ("compute", 3)]


def full_plan() -> Plan:
    """A plan with every optional key filled in."""
    g = chain_graph()
    return Plan(g.fingerprint, RECOMPUTE, addresses={(0, 1): 0, (1, 2): 128, (3, 2): 256},
                predicted={"peak_bytes": 200, "constant_bytes": 40, "compute_cost": 5.0, "time_ms": 1.5,
                           "arena_bytes": 356},
                provenance={"solver": "checkmate", "budget_bytes": 300, "backend": "highs", "gap": 0.0})


TAMPERS = {
    "predicted peak": lambda d: d["predicted"].update(peak_bytes=100),
    "predicted key added": lambda d: d["predicted"].update(time_ms=None),
    "provenance budget": lambda d: d["provenance"].update(budget_bytes=10**9),
    "provenance solver": lambda d: d["provenance"].update(solver="ap-greedy"),
    "address offset": lambda d: d["addresses"][1].__setitem__(2, 64),
    "address dropped": lambda d: d["addresses"].pop(),
    "fingerprint": lambda d: d.update(fingerprint="0" * 64),
    "schedule": lambda d: d["schedule"].pop(3),
}


@pytest.mark.parametrize("tamper", TAMPERS.values(), ids=list(TAMPERS))
def test_the_checksum_covers_every_key(tmp_path, tamper):
    plan = full_plan()
    plan.save(tmp_path / "p.json")
    data = json.loads((tmp_path / "p.json").read_text())
    assert Plan.load(data).to_json() == data                       # the untouched plan loads as a dict too
    tamper(data)
    (tmp_path / "p.json").write_text(json.dumps(data))
    with pytest.raises(PlanError, match="edited or corrupted"):
        Plan.load(tmp_path / "p.json")
    with pytest.raises(PlanError, match="plan dict: key 'checksum' is '[0-9a-f]{64}' but the content hashes to"):
        Plan.load(data)                                             # a dict carrying a checksum is checked


def test_the_checksum_covers_version_1_offsets(tmp_path):
    g = chain_graph()
    body = {"format": "memplan-plan", "version": 1, "fingerprint": g.fingerprint,
            "schedule": [{"compute": i} for i in range(4)], "offsets": {"1": 0, "2": 128},
            "predicted": {}, "provenance": {}}
    data = {**body, "checksum": sha256_hex(body)}
    assert Plan.load(data).v1_offsets == {1: 0, 2: 128}
    data["offsets"]["2"] = 64
    with pytest.raises(PlanError, match="edited or corrupted"):
        Plan.load(data)


def test_to_json_checksum_is_the_hash_of_the_other_keys():
    data = full_plan().to_json()
    body = {k: v for k, v in data.items() if k != "checksum"}
    assert data["checksum"] == sha256_hex(body)
    assert list(body) == ["format", "version", "fingerprint", "schedule", "addresses", "predicted", "provenance"]
    assert body["format"] == "memplan-plan" and body["version"] == 2
    assert body["addresses"] == [[0, 1, 0], [1, 2, 128], [3, 2, 256]]
    assert "addresses" not in default_plan(chain_graph()).to_json()


@pytest.mark.parametrize("checksum", ["", "0" * 64, None])
def test_a_dict_plan_with_a_wrong_checksum_is_refused(checksum):
    data = full_plan().to_json()
    data["checksum"] = checksum
    with pytest.raises(PlanError, match="plan dict: key 'checksum' .* edited or corrupted"):
        Plan.load(data)


def test_a_dict_plan_without_a_checksum_is_read_but_a_file_needs_one(tmp_path):
    data = full_plan().to_json()
    del data["checksum"]
    plan = Plan.load(data)
    assert plan.addresses == full_plan().addresses and plan.predicted["arena_bytes"] == 356
    (tmp_path / "p.json").write_text(json.dumps(data))
    with pytest.raises(PlanError, match="p.json: key 'checksum' is None"):
        Plan.load(tmp_path / "p.json")


@pytest.mark.parametrize("version", [True, False, 0, 3, "2", None])
def test_only_known_integer_versions_load(version):
    data = default_plan(chain_graph()).to_json()
    data["version"] = version
    with pytest.raises(PlanError, match=f"plan format version {version!r} is not supported"):
        Plan.load(data)


@pytest.mark.parametrize("data, message", [
    ({"format": "memplan-plan", "version": 2, "schedule": []}, "required key 'fingerprint' is missing"),
    ({"format": "memplan-plan", "version": 2, "fingerprint": "f"}, "required key 'schedule' is missing"),
])
def test_incomplete_dicts_are_refused(data, message):
    with pytest.raises(PlanError, match=message):
        Plan.load(data)


def test_a_json_list_file_is_refused(tmp_path):
    (tmp_path / "p.json").write_text("[1, 2]")
    with pytest.raises(PlanError, match="p.json: expected a JSON object, got list"):
        Plan.load(tmp_path / "p.json")


@pytest.mark.parametrize("offsets, message", [
    ({"9": 0}, "offsets place value 9, which the schedule computes 0 times"),      # no such value
    ({"0": 0}, "offsets place value 0, which the schedule computes 0 times"),      # the graph input
])
def test_version_1_offsets_naming_values_the_schedule_does_not_compute_are_refused(offsets, message):
    g = chain_graph()
    body = {"format": "memplan-plan", "version": 1, "fingerprint": g.fingerprint,
            "schedule": [{"compute": i} for i in range(4)], "offsets": offsets}
    plan = Plan.load(body)
    with pytest.raises(PlanError, match=message):
        plan.validate(g)


@pytest.mark.parametrize("offsets, message", [
    ([0, 1], "'offsets' .* must be an object"),
    ({"x": 0}, r"offsets\['x'\] = 0"),
    ({"1": -5}, r"offsets\['1'\] = -5"),
    ({"1": True}, r"offsets\['1'\] = True"),
])
def test_malformed_version_1_offsets_are_refused(offsets, message):
    body = {"format": "memplan-plan", "version": 1, "fingerprint": "f", "schedule": [], "offsets": offsets}
    with pytest.raises(PlanError, match=message):
        Plan.load(body)


def test_a_version_1_plan_with_offsets_cannot_be_written_before_validation(tmp_path):
    g = chain_graph()
    body = {"format": "memplan-plan", "version": 1, "fingerprint": g.fingerprint,
            "schedule": [{"compute": i} for i in range(4)], "offsets": {"2": 0}}
    plan = Plan.load(body)
    with pytest.raises(PlanError, match="call plan.validate"):
        plan.save(tmp_path / "p.json")
    plan.validate(g)
    assert plan.addresses == {(1, 2): 0} and plan.v1_offsets is None
    plan.save(tmp_path / "p.json")
    assert Plan.load(tmp_path / "p.json").addresses == {(1, 2): 0}


@pytest.mark.parametrize("addresses, message", [
    ([[0, 9, 0]], r"name value 9 at schedule\[0\], but that step does not allocate it"),     # no value 9
    ([[1, 1, 0]], r"name value 1 at schedule\[1\], but that step does not allocate it"),
    ([[0, 0, 0]], r"name value 0 at schedule\[0\]"),                                          # a graph input
])
def test_addresses_naming_values_that_do_not_exist_are_refused(addresses, message):
    g = chain_graph()
    plan = Plan.load({"format": "memplan-plan", "version": 2, "fingerprint": g.fingerprint,
                      "schedule": [{"compute": i} for i in range(4)], "addresses": addresses})
    with pytest.raises(PlanError, match=message):
        plan.validate(g)


@pytest.mark.parametrize("addresses, message", [
    ("0,1,0", "must be a list of"),
    (5, "must be a list of"),
    ([[0, 1, -1]], "non-negative"),
    ([[0, True, 0]], "non-negative"),
    ([[0, 1, 0, 0]], "non-negative"),
    ([[4, 1, 0]], r"names schedule\[4\], which is not a compute step"),
    ([[5, 1, 0]], r"names schedule\[5\], which is not a compute step"),         # one past the last step
    ([5], r"entry 5 is not \[step, value, offset\]"),
    ({3: 0}, r"entry \(3, 0\) is not \[step, value, offset\]"),                 # a mapping keyed by step only
])
def test_malformed_addresses_are_refused(addresses, message):
    with pytest.raises(PlanError, match=message):
        Plan("f", [("compute", 0), ("compute", 1), ("free", 1), ("compute", 1), ("free", 2)], addresses=addresses)


def test_addresses_given_as_a_mapping_are_copies():
    plan = Plan("f", [("compute", 0), ("compute", 1)], addresses={(0, 1): 8, (1, 2): 16})
    assert plan.addresses == {(0, 1): 8, (1, 2): 16}


@pytest.mark.parametrize("step, expected", [
    (("compute", 3), {"compute": 3}),
    (("compute", 3, None), {"compute": 3}),
    (("compute", 3, "default"), {"compute": 3}),
    (("compute", 3, "mask"), {"compute": 3, "impl": "mask"}),
    (["free", 2], {"free": 2}),
    ({"compute": 0, "impl": "mask"}, {"compute": 0, "impl": "mask"}),
    ({"free": 0}, {"free": 0}),
])
def test_steps_normalize_to_their_json_dicts(step, expected):
    assert normalize_step(step) == expected


@pytest.mark.parametrize("step", [("compute",), ("compute", 1, "a", "b"), ("free", 1, 2), ("run", 1),
                                  {"compute": True}, {"compute": 1.0}, {"free": -1}, {"compute": 1, "impl": 3},
                                  {"compute": 1, "free": 2}, {"free": 1, "impl": "mask"}, "compute 1", ()])
def test_malformed_steps_are_refused(step):
    with pytest.raises(PlanError, match="a step is"):
        normalize_step(step)


@pytest.mark.parametrize("kwargs, message", [
    (dict(fingerprint=""), "'fingerprint' must be a non-empty string"),
    (dict(fingerprint=3), "'fingerprint' must be a non-empty string"),
    (dict(schedule="compute 0"), "'schedule' must be a list of steps"),
    (dict(schedule={"compute": 0}), "'schedule' must be a list of steps"),
    (dict(predicted=[1]), "'predicted' must be an object"),
    (dict(predicted={"peak_bytes": "1"}), r"predicted\['peak_bytes'\] = '1'"),
    (dict(predicted={"peak_bytes": True}), r"predicted\['peak_bytes'\] = True"),
    (dict(provenance=[1]), "'provenance' must be an object"),
    (dict(provenance={1: "x"}), "'provenance' must be an object with string keys"),
])
def test_malformed_plan_fields_are_refused(kwargs, message):
    fields = dict(fingerprint="f", schedule=[("compute", 0)]) | kwargs
    with pytest.raises(PlanError, match=message):
        Plan(**fields)


def test_predicted_numbers_and_nulls_are_kept():
    plan = Plan("f", [("compute", 0)], predicted={"peak_bytes": 1, "time_ms": None, "compute_cost": 2.5})
    assert plan.predicted == {"peak_bytes": 1, "time_ms": None, "compute_cost": 2.5}


def test_refusals_of_malformed_keys_say_what_the_key_must_be(tmp_path):
    with pytest.raises(PlanError) as err:
        Plan("f", [("compute", 0)], addresses="0,1,0")
    assert str(err.value) == "plan key 'addresses' must be a list of [step, value, offset] triples."
    with pytest.raises(PlanError) as err:
        Plan.load({"format": "memplan-plan", "version": 1, "fingerprint": "f", "schedule": [], "offsets": [0, 1]})
    assert str(err.value) == ("plan dict: plan key 'offsets' (version 1) must be an object mapping value ids to "
                              "byte offsets.")
    with pytest.raises(PlanError) as err:
        Plan("f", "compute 0")
    assert str(err.value) == "plan key 'schedule' must be a list of steps."
    with pytest.raises(PlanError) as err:
        Plan("f", [("compute", 0)], predicted=[1])
    assert str(err.value) == "plan key 'predicted' must be an object."
    with pytest.raises(PlanError) as err:
        Plan("f", [("compute", 0)], predicted={"peak": 1})
    assert str(err.value) == ("plan predicted['peak'] = 1: allowed keys are peak_bytes, constant_bytes, compute_cost, "
                              "time_ms, arena_bytes, optimizer_state_bytes, dispatch_cost, each a finite number or "
                              "null.")
    with pytest.raises(PlanError) as err:
        Plan("f", [("compute", 0)], provenance={1: "x"})
    assert str(err.value) == "plan key 'provenance' must be an object with string keys."
    with pytest.raises(PlanError) as err:
        normalize_step(("run", 1))
    assert str(err.value) == ("step is ('run', 1); a step is {\"compute\": node_id} (optionally with \"impl\": name and "
                              "\"holds\": [value_id, ...]) or {\"free\": value_id} with non-negative integer ids.")
    with pytest.raises(PlanError, match="non-negative integer ids"):
        normalize_step({"compute": 1, "holds": [2, -1]})
    assert normalize_step({"compute": 1, "holds": [3, 2, 3]}) == {"compute": 1, "holds": [2, 3]}
    assert normalize_step({"compute": 1, "holds": []}) == {"compute": 1}
    with pytest.raises(PlanError) as err:
        Plan.load({"format": "memplan-plan", "version": 3, "fingerprint": "f", "schedule": []})
    assert str(err.value) == ("plan dict: plan format version 3 is not supported (this memplan reads versions 1, 2); "
                              "regenerate the plan with this memplan version.")
    v1 = Plan.load({"format": "memplan-plan", "version": 1, "fingerprint": "f", "schedule": [{"compute": 0}],
                    "offsets": {"1": 0}})
    with pytest.raises(PlanError) as err:
        v1.save(tmp_path / "p.json")
    assert str(err.value) == ("this version-1 plan's offsets are keyed by value; call plan.validate(graph) to turn "
                              "them into copy addresses before writing it as version 2.")


def test_impls_are_the_variants_named_besides_the_default():
    plan = Plan("f", [("compute", 0, "mask"), ("compute", 1), ("compute", 2, "default"), {"compute": 3, "impl": "fast"}])
    assert plan.impls() == {"mask", "fast"}
    assert default_plan(chain_graph()).impls() == set()


def test_default_plan_provenance_names_the_solver_the_utc_time_and_the_memplan_version(monkeypatch):
    from datetime import datetime, timedelta, timezone
    from importlib import metadata

    provenance = default_plan(chain_graph()).provenance
    assert set(provenance) == {"solver", "created_at", "memplan_version"} and provenance["solver"] == "default"
    created = datetime.fromisoformat(provenance["created_at"])
    assert created.utcoffset() == timedelta(0) and abs(datetime.now(timezone.utc) - created) < timedelta(minutes=1)
    assert provenance["memplan_version"] == metadata.version("memplan")

    def not_installed(name):
        raise metadata.PackageNotFoundError(name)

    monkeypatch.setattr(metadata, "version", not_installed)
    assert default_plan(chain_graph()).provenance["memplan_version"] == "unknown"


def test_compute_steps_are_the_computed_nodes_in_order():
    assert full_plan().compute_steps() == [0, 1, 2, 1, 3]
    assert Plan("f", [("compute", 0), ("free", 1), ("compute", 2)]).compute_steps() == [0, 2]


def _fan_out_graph(n_outputs):
    """x -> node 0 -> o0, o1, ... (every value a graph output)."""
    from memplan.runtime.format.graph import Node, OpGraph, Value

    values = [Value(0, 4, (1,), "float32", "input", "x", None)]
    values += [Value(i + 1, 4, (1,), "float32", "output", f"o{i}", 0) for i in range(n_outputs)]
    node = Node(0, "split", ("aten.split.Tensor",), "forward", (0,), tuple(range(1, n_outputs + 1)))
    return OpGraph(values, [node], list(range(1, n_outputs + 1)))


def test_refusals_of_invalid_schedules_name_the_valid_ranges_and_the_missing_outputs():
    g = chain_graph()                                         # nodes 0..3, values 0..4
    with pytest.raises(PlanError) as err:
        Plan(g.fingerprint, [("compute", 4)]).validate(g)
    assert str(err.value) == "schedule[0] computes node 4, which does not exist (0..3)."
    with pytest.raises(PlanError) as err:
        Plan(g.fingerprint, [("compute", 0), ("free", 5)]).validate(g)
    assert str(err.value) == "schedule[1] frees value 5, which does not exist (0..4)."
    fan = _fan_out_graph(12)
    with pytest.raises(PlanError) as err:
        Plan(fan.fingerprint, []).validate(fan)
    assert str(err.value) == ("graph outputs [1, 2, 3, 4, 5, 6, 7, 8, 9, 10] (o0, o1, o2...) are not resident at the "
                              "end of the schedule; every output must be computed and not freed after.")


def test_validation_uses_the_variants_it_is_given_and_their_values():
    """A variant (here a hand-made `mask` of node 1 that also allocates value 5) is known only to the
    variants passed in; its value may be freed, the next id does not exist."""
    from memplan.runtime.variants.offered import GraphVariants, VariantSpec

    g = chain_graph()
    mask = Value(5, 8, (8,), "uint8", "activation", "a0.mask", 1)
    variants = GraphVariants(5, (mask,), {1: {"mask": VariantSpec(1, "mask", "relu_mask", (1,), (2, 5))}})
    schedule = [("compute", 0), ("compute", 1, "mask"), ("free", 5), ("compute", 2), ("compute", 3)]
    assert Plan(g.fingerprint, schedule).validate(g, variants) is variants
    with pytest.raises(PlanError, match=r"schedule\[3\] frees value 6, which does not exist \(0..5\)"):
        Plan(g.fingerprint, [*schedule[:3], ("free", 6)]).validate(g, variants)
