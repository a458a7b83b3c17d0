"""Model, loss, batch and device factories."""

from __future__ import annotations

import textwrap

import pytest
import torch
import torch.nn.functional as F

from memplan.tasks.config import parse_config
from memplan.tasks.models import DeviceError, ModelError, build_batch, build_loss, build_model, resolve_device


def model_spec(**entry):
    entry.setdefault("name", "m")
    entry.setdefault("inputs", [{"shape": [4]}])
    return parse_config({"models": [entry], "plans": [{"solver": "checkmate", "budgets": [0.5]}]}, solvers=["checkmate"]).models[0]


def test_torchvision_model_takes_kwargs_and_seed():
    spec = model_spec(torchvision="resnet18", kwargs={"num_classes": 7})
    a, b, c = build_model(spec, 0), build_model(spec, 0), build_model(spec, 1)
    assert a.fc.out_features == 7 and a.training
    assert torch.equal(a.conv1.weight, b.conv1.weight)
    assert not torch.equal(a.conv1.weight, c.conv1.weight)


def test_transformers_model_is_built_from_a_config_and_causal_lm_loss_is_next_token_ce():
    spec = model_spec(
        transformers="gpt2",
        kwargs={"n_layer": 1, "n_embd": 32, "n_head": 2, "vocab_size": 50, "n_positions": 16,
                "bos_token_id": 0, "eos_token_id": 0, "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0},
        loss="causal_lm",
        inputs=[{"shape": [16], "dtype": "int64", "high": 50}],
    )
    model = build_model(spec, 0)
    assert model.config.n_layer == 1 and model.config._attn_implementation == "sdpa"     # transformers' default
    (ids,) = build_batch(spec, 3, 0)
    assert ids.shape == (3, 16) and ids.dtype == torch.int64 and 0 <= int(ids.min()) and int(ids.max()) < 50
    logits = model(ids).logits
    expected = F.cross_entropy(logits[:, :-1].reshape(-1, 50), ids[:, 1:].reshape(-1))
    assert torch.allclose(build_loss(spec)(model, ids), expected)


@pytest.mark.parametrize("kwargs, attention", [
    ({}, "aten._scaled_dot_product_flash_attention_for_cpu.default"),          # transformers' defaults
    ({"use_cache": False}, "aten._scaled_dot_product_flash_attention_for_cpu.default"),
    ({"use_cache": False, "attn_implementation": "eager"}, "aten._softmax.default"),
])
def test_causal_lm_of_a_transformers_lm_is_its_labels_loss_and_capture_fuses_it_with_the_head(kwargs, attention):
    """`causal_lm` of a `*ForCausalLM` is the model's own `labels=` loss, equal to next-token cross-entropy
    of its logits. Capture traces it whatever the config's cache and attention settings (the loss runs
    the forward without the cache, and transformers' untraceable packed-sequence check answers "none" while
    capture traces), holds no copy of the keys and values and fuses the LM head with the loss."""
    from memplan.tasks.trace import capture_model

    spec = model_spec(
        transformers="gpt2",
        kwargs={"n_layer": 1, "n_embd": 32, "n_head": 2, "vocab_size": 50, "n_positions": 16, "bos_token_id": 0,
                "eos_token_id": 0, "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0} | kwargs,
        loss="causal_lm",
        inputs=[{"shape": [16], "dtype": "int64", "high": 50}],
    )
    model = build_model(spec, 0)
    (ids,) = build_batch(spec, 3, 0)
    logits = model(ids).logits
    expected = F.cross_entropy(logits[:, :-1].reshape(-1, 50), ids[:, 1:].reshape(-1))
    torch.testing.assert_close(build_loss(spec)(model, ids), expected)
    graph = capture_model(spec, 3, "cpu", 0)
    targets = [t for n in graph.nodes for t in n.targets]
    assert "memplan.linear_cross_entropy.default" in targets and attention in targets
    keys = [v for v in graph.values if v.kind == "activation" and v.shape == (3, 2, 16, 16)]   # batch, heads, tokens, head dim
    assert not any(graph.nodes[v.producer].targets[0] == "aten.cat.default" for v in keys)     # no cache copies


def test_import_path_factory_and_loss(tmp_path, monkeypatch):
    (tmp_path / "mymodels.py").write_text(textwrap.dedent("""
        import torch
        def tiny(width):
            return torch.nn.Sequential(torch.nn.Linear(4, width), torch.nn.Tanh())
        def l1(model, x):
            return model(x).abs().sum()
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    spec = model_spec(factory="mymodels:tiny", kwargs={"width": 5}, loss="mymodels:l1")
    model = build_model(spec, 0)
    (x,) = build_batch(spec, 2, 0)
    assert model[0].out_features == 5
    assert torch.allclose(build_loss(spec)(model, x), model(x).abs().sum())


def test_named_losses_match_torch():
    spec = model_spec(factory="torch.nn:Linear", kwargs={"in_features": 4, "out_features": 3}, loss="mse",
                      inputs=[{"shape": [4]}, {"shape": [3]}])
    model = build_model(spec, 0)
    x, y = build_batch(spec, 5, 0)
    assert torch.allclose(build_loss(spec)(model, x, y), F.mse_loss(model(x), y))
    summed = spec.model_copy(update={"loss": "sum"})
    assert torch.allclose(build_loss(summed)(model, x), model(x).sum())


def test_batches_are_seeded_and_typed():
    spec = model_spec(factory="torch.nn:Identity", inputs=[{"shape": [2, 3]}, {"shape": [], "dtype": "int32", "high": 4},
                                                          {"shape": [1], "dtype": "bool"}])
    x, y, mask = build_batch(spec, 6, seed=3)
    assert (x.shape, y.shape, mask.shape) == ((6, 2, 3), (6,), (6, 1))
    assert (x.dtype, y.dtype, mask.dtype) == (torch.float32, torch.int32, torch.bool)
    assert torch.equal(x, build_batch(spec, 6, seed=3)[0])
    assert not torch.equal(x, build_batch(spec, 6, seed=4)[0])


@pytest.mark.parametrize(
    "entry, fragment",
    [
        ({"torchvision": "resnet19"}, "torchvision .* has no model 'resnet19'; close matches: resnet18"),
        ({"transformers": "gpt3"}, "has no model type 'gpt3'; close matches: .*gpt2"),
        ({"factory": "no_such_pkg.models:make"}, "cannot import module 'no_such_pkg.models'"),
        ({"factory": "torch.nn:Lineer"}, "torch.nn has no attribute 'Lineer'"),
        ({"factory": "torch.nn:Linear", "kwargs": {"in_features": 4}}, "could not be built with kwargs .*out_features"),
        ({"factory": "math:pi"}, "names a float, not a function"),
        ({"factory": "torch:zeros", "kwargs": {"size": [2]}}, "returned a Tensor, not a torch.nn.Module"),
    ],
)
def test_model_errors_name_the_cause(entry, fragment):
    with pytest.raises(ModelError, match=fragment):
        build_model(model_spec(**entry), 0)


def test_loss_import_errors_name_the_cause():
    with pytest.raises(ModelError, match="loss of model 'm' 'torch.nn.functional:nope'"):
        build_loss(model_spec(factory="torch.nn:Identity", loss="torch.nn.functional:nope"))


def test_device_resolution():
    assert resolve_device("cpu") == "cpu"
    assert resolve_device("auto") == ("cuda:0" if torch.cuda.is_available() else "cpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a host without CUDA")
def test_missing_gpu_is_a_clear_error():
    with pytest.raises(DeviceError, match=r"device = 'cuda:1' in pipeline.toml, but torch .* sees no CUDA GPU"):
        resolve_device("cuda:1")


@pytest.mark.parametrize(
    "entry, fragment",
    [
        ({"torchvision": "resnet19"}, "has no model 'resnet19'"),
        ({"transformers": "gpt3"}, "has no model type 'gpt3'"),
        ({"factory": "no_such_pkg.models:make"}, "cannot import module 'no_such_pkg.models'"),
        ({"factory": "torch.nn:Linear", "loss": "torch.nn.functional:nope"}, "has no attribute 'nope'"),
    ],
)
def test_check_model_fails_fast_without_building(entry, fragment):
    from memplan.tasks.models import check_model

    with pytest.raises(ModelError, match=fragment):
        check_model(model_spec(**entry))


def test_check_model_accepts_each_source_kind():
    from memplan.tasks.models import check_model

    for entry in ({"torchvision": "resnet18"}, {"transformers": "gpt2"}, {"factory": "torch.nn:Linear"}):
        check_model(model_spec(**entry))


@pytest.mark.parametrize("model_type, auto_class, kwargs, inputs", [
    ("t5", "AutoModelForSeq2SeqLM",
     {"vocab_size": 64, "d_model": 32, "d_kv": 16, "d_ff": 64, "num_layers": 1, "num_decoder_layers": 1,
      "num_heads": 2, "dropout_rate": 0.0},
     [{"shape": [12], "dtype": "int64", "high": 64}, {"shape": [6], "dtype": "int64", "high": 64}]),
    ("bert", "AutoModelForMaskedLM",
     {"vocab_size": 64, "hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2, "intermediate_size": 64,
      "max_position_embeddings": 16, "hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0},
     [{"shape": [12], "dtype": "int64", "high": 64}, {"shape": [12], "dtype": "int64", "high": 64}]),
])
def test_an_encoder_decoder_and_an_encoder_train_with_the_labels_loss(model_type, auto_class, kwargs, inputs):
    """`loss = "labels"`: the model's own loss from `labels=` the batch's last tensor (T5 with
    `AutoModelForSeq2SeqLM`, whose config the builder gives T5's decoder start token; BERT's masked LM), and the
    trace stage captures it (issue #53)."""
    from memplan.tasks.trace import capture_model

    spec = model_spec(transformers=model_type, auto_class=auto_class, kwargs=kwargs, loss="labels", inputs=inputs)
    model = build_model(spec, 0)
    ids, labels = build_batch(spec, 2, 0)
    torch.testing.assert_close(build_loss(spec)(model, ids, labels), model(input_ids=ids, labels=labels).loss)
    graph = capture_model(spec, 2, "cpu", 0)
    assert graph.meta["rewrites"]["applied"]["fuse_cross_entropy"] == [0]


def test_the_labels_loss_needs_the_labels_in_the_batch():
    spec = model_spec(transformers="bert", auto_class="AutoModelForMaskedLM", loss="labels",
                      kwargs={"vocab_size": 64, "hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2,
                              "intermediate_size": 64},
                      inputs=[{"shape": [8], "dtype": "int64", "high": 64}])
    with pytest.raises(ModelError, match="batch \\(\\*inputs, labels\\)"):
        build_loss(spec)(build_model(spec, 0), *build_batch(spec, 2, 0))
