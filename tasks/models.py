"""Model, loss, batch and device factories for a `[[models]]` entry of `pipeline.toml`.

Models get seeded random weights (no downloads). A loss is called as `loss(model, *batch) -> scalar`,
the calling convention of `runtime.capture` and `runtime.load`.
"""

from __future__ import annotations

import difflib
import functools
import importlib
import inspect
import math
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from memplan.tasks.config import IMPORT_PATH, NAMED_LOSSES, MemplanError, ModelConfig


class ModelError(MemplanError):
    """A model, loss or batch that cannot be built from its `pipeline.toml` entry."""


class DeviceError(MemplanError):
    """The configured device is not present on this host."""


def resolve_device(spec: str) -> str:
    """`auto` -> `cuda:0` when torch sees a GPU, else `cpu`; `cuda`/`cuda:N` must exist."""
    if spec == "auto":
        return "cuda:0" if torch.cuda.is_available() else "cpu"
    if spec == "cpu":
        return "cpu"
    index = int(spec.partition(":")[2] or 0)
    if not torch.cuda.is_available():
        raise DeviceError(
            f"device = {spec!r} in pipeline.toml, but torch {torch.__version__} sees no CUDA GPU on this host "
            "(torch.cuda.is_available() is False); run on a GPU host, or set device = \"auto\" or \"cpu\"."
        )
    if index >= torch.cuda.device_count():
        raise DeviceError(
            f"device = {spec!r} in pipeline.toml, but this host has {torch.cuda.device_count()} CUDA GPU(s) "
            f"(cuda:0..cuda:{torch.cuda.device_count() - 1}); pick one of those or \"auto\"."
        )
    return f"cuda:{index}"


def allow_imports_from(folder: str | Path) -> None:
    """Let import paths name modules in `folder` (the folder holding pipeline.toml)."""
    folder = str(Path(folder).resolve())
    if folder not in sys.path:
        sys.path.insert(0, folder)


def import_object(path: str, role: str) -> Any:
    """The object named by `pkg.module:attr.sub`; `role` says what the path is for in error messages."""
    if not IMPORT_PATH.match(path):
        raise ModelError(f"{role} {path!r} is not an import path; write 'package.module:function'.")
    module_name, _, attr = path.partition(":")
    try:
        obj = importlib.import_module(module_name)
    except ImportError as exc:
        raise ModelError(
            f"{role} {path!r}: cannot import module {module_name!r} ({exc}); install the package or put "
            "its folder on PYTHONPATH."
        ) from None
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ModelError(f"{role} {path!r}: {obj.__name__} has no attribute {part!r}; check the name after ':'.")
        obj = getattr(obj, part)
    if not callable(obj):
        raise ModelError(f"{role} {path!r} names a {type(obj).__name__}, not a function or class.")
    return obj


def check_model(spec: ModelConfig) -> None:
    """Fail fast, without building anything, when the model's source or loss cannot be found."""
    kind, name = spec.source
    where = f"model {spec.name!r} ({kind} = {name!r})"
    if kind == "torchvision":
        import torchvision

        _known(name, torchvision.models.list_models(), f"{where}: torchvision {torchvision.__version__} has no model")
    elif kind == "transformers":
        import transformers

        _known(name, list(transformers.CONFIG_MAPPING), f"{where}: transformers {transformers.__version__} has no model type")
        if not hasattr(transformers, spec.auto_class):
            raise ModelError(f"{where}: transformers {transformers.__version__} has no {spec.auto_class}.")
    else:
        import_object(name, f"factory of model {spec.name!r}")
    build_loss(spec)


def _known(name: str, names: list[str], message: str) -> None:
    if name not in names:
        close = difflib.get_close_matches(name, names, n=5)
        raise ModelError(f"{message} {name!r}" + (f"; close matches: {', '.join(close)}" if close else "") + ".")


def build_model(spec: ModelConfig, seed: int) -> nn.Module:
    """The model of `spec` with weights drawn from `torch.manual_seed(seed)`, in training mode."""
    kind, name = spec.source
    torch.manual_seed(seed)
    where = f"model {spec.name!r} ({kind} = {name!r})"
    try:
        if kind == "torchvision":
            model = _torchvision(name, spec.kwargs, where)
        elif kind == "transformers":
            model = _transformers(name, spec.auto_class, spec.kwargs, where)
        else:
            model = import_object(name, f"factory of model {spec.name!r}")(**spec.kwargs)
    except MemplanError:
        raise
    except Exception as exc:
        raise ModelError(
            f"{where} could not be built with kwargs {spec.kwargs}: {type(exc).__name__}: {exc}. "
            "Fix the kwargs or the model source."
        ) from None
    if not isinstance(model, nn.Module):
        raise ModelError(f"{where} returned a {type(model).__name__}, not a torch.nn.Module.")
    if spec.dtype != "float32":
        model = model.to(getattr(torch, spec.dtype))            # floating parameters and buffers only
    return model.train()


def _torchvision(name: str, kwargs: dict[str, Any], where: str) -> nn.Module:
    import torchvision

    _known(name, torchvision.models.list_models(), f"{where}: torchvision {torchvision.__version__} has no model")
    return torchvision.models.get_model(name, weights=None, **kwargs)


def _transformers(model_type: str, auto_class: str, kwargs: dict[str, Any], where: str) -> nn.Module:
    """A transformers model from `AutoConfig.for_model(model_type, **kwargs)`: no hub access, transformers'
    own defaults (SDPA attention), and built for training: without its key/value cache (`use_cache = False`
    unless `kwargs` say otherwise), which a recomputed layer would append to again. A causal LM whose class
    names no loss of transformers' (`GPT2LMHeadModel`) gets the causal-LM loss that transformers falls back to,
    named: the fallback's one-time warning breaks torch.compile's graph. An encoder-decoder whose config has no
    `decoder_start_token_id` (transformers 5's T5Config; the pretrained checkpoints set it) starts its decoder
    with the padding token, T5's convention, so that `labels=` trains it (the decoder reads the labels shifted
    right, behind that token)."""
    import transformers
    from transformers.loss.loss_utils import LOSS_MAPPING

    _known(model_type, list(transformers.CONFIG_MAPPING), f"{where}: transformers {transformers.__version__} has no model type")
    config = transformers.AutoConfig.for_model(model_type, **{"use_cache": False} | kwargs)
    if getattr(config, "is_encoder_decoder", False) and getattr(config, "decoder_start_token_id", None) is None:
        config.decoder_start_token_id = getattr(config, "pad_token_id", None)    # T5's convention
    model = getattr(transformers, auto_class).from_config(config)
    if auto_class == "AutoModelForCausalLM" and getattr(model, "loss_type", None) not in LOSS_MAPPING:
        model.loss_type = "ForCausalLM"
    return model


def build_loss(spec: ModelConfig) -> Callable[..., torch.Tensor]:
    """The loss of `spec`: a named loss or the function at its import path, run under `torch.autocast`
    when `spec.autocast` names a dtype."""
    loss = _NAMED[spec.loss] if spec.loss in NAMED_LOSSES else import_object(spec.loss, f"loss of model {spec.name!r}")
    if spec.autocast is None:
        return loss
    return functools.partial(autocast_loss, loss, getattr(torch, spec.autocast))


def autocast_loss(loss: Callable[..., torch.Tensor], dtype: torch.dtype, model: nn.Module,
                  *batch: torch.Tensor) -> torch.Tensor:
    """`loss(model, *batch)` under `torch.autocast` of the batch's device type with `dtype`."""
    with torch.autocast(batch[0].device.type, dtype=dtype):
        return loss(model, *batch)


def check_batch_fits(spec: ModelConfig, batch_size: int, device: str) -> None:
    """Refuse a batch whose input tensors alone exceed the device's memory, before anything is allocated."""
    nbytes = sum(batch_size * math.prod(item.shape) * getattr(torch, item.dtype).itemsize for item in spec.inputs)
    if device.startswith("cuda"):
        total = torch.cuda.get_device_properties(torch.device(device)).total_memory
    else:
        import psutil

        total = psutil.virtual_memory().total
    if nbytes > total:
        raise ModelError(
            f"model {spec.name!r} at batch {batch_size}: its inputs alone take {nbytes / 2**30:,.1f} GiB, more than "
            f"the {total / 2**30:,.1f} GiB of {device}; lower `batch_sizes` in pipeline.toml.")


def build_batch(spec: ModelConfig, batch_size: int, seed: int, device: str | torch.device = "cpu") -> tuple[torch.Tensor, ...]:
    """The batch tensors of `spec` (shape `[batch_size, *shape]`), drawn from a generator seeded with `seed`."""
    generator = torch.Generator().manual_seed(seed)
    batch = []
    for item in spec.inputs:
        shape = (batch_size, *item.shape)
        dtype = getattr(torch, item.dtype)
        if item.high is not None:
            tensor = torch.randint(0, item.high, shape, generator=generator, dtype=dtype)
        elif dtype == torch.bool:
            tensor = torch.rand(shape, generator=generator) < 0.5
        else:
            tensor = torch.randn(shape, generator=generator).to(dtype)
        batch.append(tensor.to(device))
    return tuple(batch)


def _logits(output: Any) -> torch.Tensor:
    """The prediction tensor of a model output: the tensor itself, `.logits`, or the first element."""
    if isinstance(output, torch.Tensor):
        return output
    if hasattr(output, "logits"):
        return output.logits
    if isinstance(output, (tuple, list)) and output and isinstance(output[0], torch.Tensor):
        return output[0]
    raise ModelError(
        f"the model returned a {type(output).__name__}; named losses need a tensor, an object with "
        "`.logits` or a tuple whose first element is a tensor. Use a loss given by import path."
    )


def _forward(model: nn.Module, *args: torch.Tensor, **kwargs: torch.Tensor) -> Any:
    """`model(*args, **kwargs)`, for a transformers model (a forward taking `use_cache`) as it trains: without its
    key/value cache, which each recomputed layer would append to again. Without a cache or an attention mask,
    transformers checks the position ids for packed sequences, which reads a tensor: while memplan traces the step
    (`runtime.capture.capturing()`) the check answers "none", as it does on the batches memplan builds."""
    if "use_cache" not in inspect.signature(model.forward).parameters:
        return model(*args, **kwargs)
    with _packed_sequences_unchecked():
        return model(*args, use_cache=False, **kwargs)


@contextmanager
def _packed_sequences_unchecked() -> Iterator[None]:
    """transformers' check for packed sequences answering "none" while memplan traces a step in this thread (a
    forward elsewhere runs the check), where transformers has the check."""
    try:
        import transformers.masking_utils as masking

        check = masking.find_packed_sequence_indices
    except (ImportError, AttributeError):
        yield
        return
    from memplan.runtime.tracing.capture import capturing           # here: it imports AOTAutograd (2 s)

    masking.find_packed_sequence_indices = lambda position_ids: None if capturing() else check(position_ids)
    try:
        yield
    finally:
        masking.find_packed_sequence_indices = check


def cross_entropy(model: nn.Module, inputs: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of `model(inputs)` against class indices `target`."""
    return F.cross_entropy(_logits(_forward(model, inputs)), target)


def mse(model: nn.Module, inputs: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Mean squared error of `model(inputs)` against `target`."""
    return F.mse_loss(_logits(_forward(model, inputs)), target)


def causal_lm(model: nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy: logits at position t predict token t+1, the mean over positions 0..T-2.

    A model whose forward takes `labels` (transformers' `*ForCausalLM`) computes it itself from
    `labels=input_ids`, as its users train it: capture then fuses the LM head with the loss in CPU
    graphs (runtime/tracing/fused_loss.py). A transformers model runs without its key/value cache (`_forward`)."""
    if "labels" in inspect.signature(model.forward).parameters:
        return _forward(model, input_ids, labels=input_ids).loss
    logits = _logits(_forward(model, input_ids))
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), input_ids[:, 1:].reshape(-1))


def labels(model: nn.Module, *batch: torch.Tensor) -> torch.Tensor:
    """The model's own loss, `model(*inputs, labels=labels).loss` for the batch `(*inputs, labels)`: what
    transformers' `*ForMaskedLM`, `*ForSeq2SeqLM` (T5, BART: the decoder reads the labels shifted right),
    `*ForSequenceClassification` and `*ForCausalLM` compute from `labels` (a mean over the labelled tokens or
    samples). The inputs go in the forward's order (`input_ids`, then `attention_mask` where given); a
    transformers model runs without its key/value cache (`_forward`)."""
    if len(batch) < 2:
        raise ModelError(f"the loss `labels` takes a batch (*inputs, labels), got {len(batch)} tensor(s); declare the "
                         "labels as the last of the model's `inputs` in pipeline.toml.")
    output = _forward(model, *batch[:-1], labels=batch[-1])
    loss = getattr(output, "loss", None)
    if not isinstance(loss, torch.Tensor):
        raise ModelError(f"the loss `labels` needs a model that returns `.loss` when given `labels=`; "
                         f"{type(model).__name__} returned a {type(output).__name__} without one. Use a loss given by "
                         "import path.")
    return loss


def output_sum(model: nn.Module, *batch: torch.Tensor) -> torch.Tensor:
    """Sum of the model output (a loss for models without targets)."""
    return _logits(_forward(model, *batch)).sum()


_NAMED = {"cross_entropy": cross_entropy, "mse": mse, "causal_lm": causal_lm, "labels": labels, "sum": output_sum}
assert set(_NAMED) == set(NAMED_LOSSES)
