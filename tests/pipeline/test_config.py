"""pipeline.toml schema: defaults, budgets, matrix expansion and one-paragraph errors."""

from __future__ import annotations

import hashlib
import json

import pytest

from memplan.tasks.solve.core.solution import SolveOptions

from memplan.tasks.config import (
    Budget,
    ConfigError,
    expand_matrix,
    load_config,
    parse_budget,
    parse_config,
)

SOLVERS = ["checkmate", "chen-sqrt-n"]


def parse(data):
    return parse_config(data, solvers=SOLVERS)


def test_defaults_fill_every_optional_section(config_data):
    config = parse(config_data)
    assert config.device == "auto"
    assert config.profile.warmup == 2 and config.profile.repeats == 5
    assert config.validation.rtol == 1e-4 and config.validation.peak_rtol == 0.05
    assert config.publish.dir == "plans"
    assert config.models[1].batch_sizes == [8]
    shared = SolveOptions()
    assert (shared.backend, shared.gap, shared.time_limit) == ("auto", 0.01, 300.0)
    assert config.plans[0].solve_settings().model_dump() == {"backend": shared.backend, "time_limit": shared.time_limit,
                                                "gap": shared.gap, "params": {}, "addresses": "none",
                                                "variants": "all", "optimizer": "none", "ddp_bucket_mb": None,
                                                "form": "executor"}


@pytest.mark.parametrize(
    "text, expected",
    [
        (2_000_000_000, Budget(bytes=2_000_000_000)),
        ("1.5 GiB", Budget(bytes=3 * 2**29)),
        ("512MiB", Budget(bytes=512 * 2**20)),
        ("2 GB", Budget(bytes=2 * 10**9)),
        ("1e3 B", Budget(bytes=1000)),
        (0.6, Budget(fraction=0.6)),
        ("60%", Budget(fraction=0.6)),
        (1.0, Budget(fraction=1.0)),
        (2**63 - 1, Budget(bytes=2**63 - 1)),
    ],
)
def test_budget_forms(text, expected):
    assert parse_budget(text) == expected


@pytest.mark.parametrize("text", [0, -5, 1.5, 0.0, "150%", "0%", "3 parsecs", "GiB", True, None,
                                  "1e30 B", 2**63, "8 EiB", "9.3e18 B"])
def test_bad_budgets_are_refused(text):
    with pytest.raises(ValueError, match="not understood"):
        parse_budget(text)


def test_budget_resolution_and_labels():
    assert Budget(fraction=0.5).resolve(1001) == 500
    assert Budget(bytes=123).resolve(10**9) == 123
    assert Budget(fraction=0.7).label == "70pct"
    assert Budget(bytes=1024).label == "1024B"


def test_matrix_is_models_by_batch_sizes_by_plans_by_budgets(config_data):
    cases = expand_matrix(parse(config_data))
    assert [c.alias for c in cases] == [
        "resnet18-b8-checkmate-70pct",
        "resnet18-b8-checkmate-50pct",
        "resnet18-b16-checkmate-70pct",
        "resnet18-b16-checkmate-50pct",
        "mlp-b8-checkmate-70pct",
        "mlp-b8-checkmate-50pct",
        "mlp-b8-chen-sqrt-n-1073741824B",
    ]


def test_matrix_drops_duplicate_cells(config_data):
    config_data["plans"][0]["budgets"] = ["50%", 0.5]
    assert len([c for c in expand_matrix(parse(config_data)) if c.model.name == "mlp"]) == 2


def test_content_hash_ignores_labels_but_not_shapes(config_data):
    config = parse(config_data)
    model = config.models[0]
    renamed = model.model_copy(update={"name": "other", "batch_sizes": [1]})
    assert model.content_hash(8) == renamed.content_hash(8)
    assert model.content_hash(8) != model.content_hash(16)
    wider = model.model_copy(update={"kwargs": {"num_classes": 11}})
    assert wider.content_hash(8) != model.content_hash(8)


def test_content_hash_keeps_full_precision_keys_and_tells_low_precision_apart(config_data):
    model = parse(config_data).models[0]
    explicit = model.model_copy(update={"dtype": "float32", "autocast": None})
    before = {k: v for k, v in model.model_dump().items() if k not in ("dtype", "autocast")}
    assert model.content_hash(8) == explicit.content_hash(8)
    # the hash of a file written before the precision keys existed
    old = {k: v for k, v in before.items() if k not in ("name", "batch_sizes")} | {"batch_size": 8}
    assert model.content_hash(8) == hashlib.sha256(json.dumps(old, sort_keys=True, default=str).encode()).hexdigest()
    hashes = {model.model_copy(update=u).content_hash(8) for u in
              ({}, {"dtype": "bfloat16"}, {"autocast": "bfloat16"}, {"autocast": "float16"})}
    assert len(hashes) == 4


def error(data) -> str:
    with pytest.raises(ConfigError) as info:
        parse(data)
    return str(info.value)


def test_unknown_key_names_its_path_and_the_allowed_keys(config_data):
    config_data["models"][1]["batchsize"] = 4
    message = error(config_data)
    assert "models[1].batchsize = 4" in message
    assert "allowed keys in models[1]: name, torchvision, transformers, factory" in message


def test_unknown_top_level_key(config_data):
    config_data["solver"] = "checkmate"
    assert "key solver = 'checkmate': unknown key; allowed keys in the top level: device" in error(config_data)


def test_unknown_solver_lists_registered_solvers(config_data):
    config_data["plans"][1]["solver"] = "chekmate"
    message = error(config_data)
    assert "plans[1].solver = 'chekmate'" in message
    assert "registered solvers: checkmate, chen-sqrt-n" in message


def test_bad_budget_names_its_index(config_data):
    config_data["plans"][0]["budgets"] = ["70%", "lots"]
    assert "plans[0].budgets[1] = 'lots': budget 'lots' is not understood" in error(config_data)


def test_bad_literal_lists_allowed_values(config_data):
    config_data["models"][0]["inputs"][0]["dtype"] = "float8"
    message = error(config_data)
    assert "models[0].inputs[0].dtype = 'float8'" in message and "'float32', 'float64'" in message


@pytest.mark.parametrize(
    "change, fragment",
    [
        (lambda d: d.update(device="gpu"), "device 'gpu' is not one of 'auto', 'cpu', 'cuda', 'cuda:N'"),
        (lambda d: d["models"][0].update(transformers="gpt2"), "needs exactly one of 'torchvision', 'transformers' or 'factory'"),
        (lambda d: d["models"][1].update(factory="torch.nn.Linear"), "is not an import path"),
        (lambda d: d["models"][1].update(loss="hinge"), "neither a named loss"),
        (lambda d: d["models"][0]["inputs"][1].pop("high"), "needs 'high'"),
        (lambda d: d["models"][1].update(name="resnet18"), "used twice"),
        (lambda d: d["models"][1].update(name="a b"), "becomes a file name"),
        (lambda d: d["plans"][1].update(models=["vgg"]), "plans[1].models names 'vgg', which is not a model"),
        (lambda d: d["plans"][0].update(gap=1.5), "plans[0].gap = 1.5"),
        (lambda d: d["plans"][0].update(variants="exact"), "plans[0].variants = 'exact'"),
        (lambda d: d["plans"][0].pop("budgets"), "key plans[0]: plan of solver 'checkmate' gives neither 'budgets' nor "
                                                "'max_overhead'; give exactly one"),
        (lambda d: d.pop("models"), "key models: required key is missing"),
        (lambda d: d.update(validate={"steps": 0}), "validate.steps = 0"),
        (lambda d: d.update(validate={"rtol": float("inf")}), "validate.rtol = inf"),
        (lambda d: d.update(validate={"atol": float("nan")}), "validate.atol = nan"),
        (lambda d: d["plans"][0].update(time_limit_s=float("nan")), "plans[0].time_limit_s = nan"),
        (lambda d: d["plans"][0].update(time_limit_s=0), "plans[0].time_limit_s = 0"),
        (lambda d: d.update(models=[]), "models = []"),
        (lambda d: d["models"][0].update(dtype="bf16"), "models[0].dtype = 'bf16'"),
        (lambda d: d["models"][0].update(autocast="float32"), "models[0].autocast = 'float32'"),
    ],
)
def test_bad_values_are_named(config_data, change, fragment):
    change(config_data)
    assert fragment in error(config_data)


def test_malformed_toml_names_the_file_and_position(tmp_path):
    path = tmp_path / "pipeline.toml"
    path.write_text('device = "cpu"\n[[models]\nname = "x"\n')
    with pytest.raises(ConfigError, match=r"pipeline.toml is not valid TOML: .*line 2"):
        load_config(path, solvers=SOLVERS)


def test_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="no such file"):
        load_config(tmp_path / "absent.toml", solvers=SOLVERS)


def test_repository_pipeline_toml_is_valid():
    from pathlib import Path

    config = load_config(Path(__file__).parents[2] / "pipeline.toml")
    assert len(expand_matrix(config)) >= 5


def test_every_key_is_documented():
    """docs/config.md has a table row for every key of every section of the schema."""
    from pathlib import Path

    from memplan.tasks.config import InputSpec, ModelConfig, PipelineConfig, PlanConfig, ProfileConfig, PublishConfig, ValidateConfig

    doc = (Path(__file__).parents[2] / "docs" / "config.md").read_text()
    for section in (PipelineConfig, ModelConfig, InputSpec, ProfileConfig, PlanConfig, ValidateConfig, PublishConfig):
        missing = [key for key in section.toml_keys() if f"| `{key}` |" not in doc]
        assert not missing, f"{section.__name__} keys {missing} are not documented in docs/config.md"


def test_max_overhead_gives_one_plan_per_limit_with_a_readable_alias(config_data):
    from memplan.tasks.config import Budget, expand_matrix, parse_config

    config_data["plans"] = [{"solver": "checkmate", "max_overhead": [0.05, 0.25], "models": ["mlp"]},
                            {"solver": "chen-sqrt-n", "max_overhead": 0.1, "models": ["mlp"]}]
    cases = expand_matrix(parse_config(config_data, solvers=["checkmate", "chen-sqrt-n"]))
    assert [c.alias for c in cases] == ["mlp-b8-checkmate-ovh5pct", "mlp-b8-checkmate-ovh25pct",
                                        "mlp-b8-chen-sqrt-n-ovh10pct"]
    assert cases[2].budget == Budget(max_overhead=0.1)


@pytest.mark.parametrize("value", [-0.1, float("nan"), 10.5, float("inf"), [], [0.1, -1], "10%", True])
def test_a_bad_max_overhead_names_the_key_and_the_fix(config_data, value):
    config_data["plans"][0].pop("budgets")
    config_data["plans"][0]["max_overhead"] = value
    message = error(config_data)
    assert "key plans[0].max_overhead = " in message
    assert "max_overhead must be a number or a non-empty list of numbers in [0, 10]" in message
    assert "write e.g. max_overhead = 0.10 or max_overhead = [0.05, 0.25]" in message


def test_budgets_and_max_overhead_together_are_refused(config_data):
    config_data["plans"][0]["max_overhead"] = 0.1
    message = error(config_data)
    assert "key plans[0]: plan of solver 'checkmate' gives both 'budgets' and 'max_overhead'; give exactly one" in message
    assert "in separate [[plans]] tables for both" in message


@pytest.mark.parametrize("change, fragment", [
    (lambda d: d.update(validate={"host_reference": "yes"}),
     "key validate.host_reference = 'yes': not a boolean; write true or false, without quotes"),
    (lambda d: d["plans"][0].update(optimizer_in_step="yes"),
     "key plans[0].optimizer_in_step = 'yes': not a boolean; write true or false, without quotes"),
    (lambda d: d["models"][0].update(batch_sizes=[True]),
     "key models[0].batch_sizes[0] = True: not an integer; write a whole number without quotes"),
    (lambda d: d["models"][0].update(batch_sizes=["8"]), "key models[0].batch_sizes[0] = '8': not an integer"),
    (lambda d: d["models"][0]["inputs"][0].update(shape=[3, 64.0, 64]), "key models[0].inputs[0].shape[1] = 64.0: not an integer"),
    (lambda d: d.update(seed="7"), "key seed = '7': not an integer"),
    (lambda d: d.update(seed=True), "key seed = True: not an integer"),
    (lambda d: d.update(profile={"repeats": "5"}), "key profile.repeats = '5': not an integer"),
    (lambda d: d.update(validate={"rtol": "1e-3"}), "key validate.rtol = '1e-3': not a number; write a number without quotes"),
    (lambda d: d.update(validate={"peak_rtol": False}), "key validate.peak_rtol = False: not a number"),
    (lambda d: d["plans"][0].update(time_limit_s="60"), "key plans[0].time_limit_s = '60': not a number"),
    (lambda d: d.update(run={"dask_workers": "2"}), "key run.dask_workers = '2': not an integer"),
])
def test_strings_and_booleans_are_not_read_as_booleans_or_numbers(config_data, change, fragment):
    change(config_data)
    assert fragment in error(config_data)


def test_integers_are_floats_and_string_sizes_and_budgets_still_parse(config_data):
    config_data.update(device_memory="16 GiB", validate={"rtol": 0, "overhead_precision": 1, "steps": 3, "max_steps": 3})
    config_data["plans"][0].update(budgets=[1, "60%", "50% eager", "1.5 GiB", 0.5], time_limit_s=60, gap=0, ddp_bucket_mb=25)
    config_data["plans"][1] = {"solver": "chen-sqrt-n", "max_overhead": [0, 1], "models": ["mlp"]}
    config = parse(config_data)
    assert config.device_memory == 16 * 2**30
    assert (config.validation.rtol, config.validation.overhead_precision) == (0.0, 1.0)
    assert config.plans[0].budgets == [Budget(bytes=1), Budget(fraction=0.6), Budget(eager_fraction=0.5),
                                       Budget(bytes=3 * 2**29), Budget(fraction=0.5)]
    assert (config.plans[0].time_limit_s, config.plans[0].gap, config.plans[0].ddp_bucket_mb) == (60.0, 0.0, 25.0)
    assert config.plans[1].max_overhead == [0.0, 1.0]


@pytest.mark.parametrize("seed", [-1, 2**63, 99999999999999999999])
def test_a_seed_torch_or_the_store_cannot_take_is_refused(config_data, seed):
    config_data["seed"] = seed
    message = error(config_data)
    assert f"key seed = {seed}: seed {seed} is outside 0 to 2**63 - 1" in message
    assert "torch.manual_seed takes 64-bit seeds" in message and "e.g. seed = 0" in message


def test_the_largest_seed_is_one_torch_and_the_store_take(config_data):
    import pyarrow as pa
    import torch

    from memplan.tasks.config import MAX_SEED

    config_data["seed"] = MAX_SEED
    assert parse(config_data).seed == MAX_SEED
    torch.Generator().manual_seed(MAX_SEED)
    pa.array([MAX_SEED], pa.int64())


def test_max_steps_below_steps_is_refused(config_data):
    config_data["validate"] = {"steps": 10, "max_steps": 5}
    assert ("key validate.max_steps = 5: max_steps 5 is below steps = 10: timing runs `steps` rounds at least and "
            "goes on up to `max_steps`; set max_steps = 10 or more, or leave it out") in error(config_data)
    config_data["validate"] = {"max_steps": 5}                            # below the default steps = 10
    assert "max_steps 5 is below steps = 10" in error(config_data)
    config_data["validate"] = {"steps": 40}                               # max_steps left out: timing stops at 40
    assert parse(config_data).validation.steps == 40


@pytest.mark.parametrize("device", ["auto", "cuda", "cuda:1"])
@pytest.mark.parametrize("value", ["1 KiB", 1024, "0.5 MiB", 2**20 - 1])
def test_a_device_memory_below_1_mib_is_a_unit_slip_unless_on_cpu(config_data, device, value):
    from memplan.tasks.config import MIN_DEVICE_MEMORY

    config_data.update(device=device, device_memory=value)
    message = error(config_data)
    assert f"key device_memory = {value!r}: device_memory " in message and "B is below 1 MiB" in message
    assert "PyTorch's CUDA allocator reserves at least 2 MiB" in message
    assert "give the device's memory with its unit (e.g. '16 GiB'), or set device = \"cpu\"" in message
    assert parse(config_data | {"device": "cpu"}).device_memory == parse_budget(value).bytes
    assert parse(config_data | {"device_memory": "1 MiB"}).device_memory == MIN_DEVICE_MEMORY


@pytest.mark.parametrize("value", [0, -1, "0 B"])
def test_device_memory_must_be_positive(config_data, value):
    config_data.update(device="cpu", device_memory=value)
    assert f"key device_memory = {value!r}: device_memory {value!r} is not a size" in error(config_data)


def test_the_device_memory_option_of_fit_has_the_files_floor():
    from memplan.tasks.config import parse_device_memory_text

    with pytest.raises(ValueError, match="device_memory 1,024 B is below 1 MiB"):
        parse_device_memory_text("1KiB", "auto")
    assert parse_device_memory_text("1KiB", "cpu") == 1024
    assert parse_device_memory_text("16GiB", "cuda") == 16 * 2**30
