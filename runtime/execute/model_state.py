"""What a training step checks of its model on each call: that its modules and parameter tensors are the ones
it captured (docs/training.md).

`ModelState.of(model)` records, per qualified name, each module and each parameter with its `requires_grad`,
shape, dtype and device. Each call compares `signature(model)`, the same objects and facts in tree order
without the names (a walk of the modules' `_modules` and `_parameters`: no per-element work, 1 to 2 us per
module and parameter), with the recorded one, object by identity; only when they differ does `changes` name what changed,
each `Change` of a kind the forms decide on: a module put in, taken out or replaced (`module`), a parameter
that is another tensor of the same shape, dtype and device (`rebound`), one that no longer requires grad
(`frozen`), and any other parameter change (`other`: added, removed, reshaped, cast, moved, unfrozen).
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Literal, NamedTuple

import torch
from torch import nn


class ModelChanged(ValueError):
    """The model changed since the step captured it, in a way the step does not follow."""


class Change(NamedTuple):
    kind: Literal["module", "rebound", "frozen", "other"]
    text: str                                   # e.g. "module 'blocks.1.1' is now Tanh, was GELU"


class _Param(NamedTuple):
    tensor: torch.Tensor
    requires_grad: bool
    shape: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device

    def facts(self) -> str:
        return f"{list(self.shape)} {str(self.dtype).removeprefix('torch.')} on {self.device}"


@dataclass(frozen=True, eq=False)
class Signature:
    """A model's modules and parameters in tree order (compared by identity) and each parameter's facts."""

    objects: tuple[object, ...]
    facts: tuple[tuple, ...]

    def same(self, other: "Signature") -> bool:
        return (len(self.objects) == len(other.objects) and all(map(operator.is_, self.objects, other.objects))
                and self.facts == other.facts)


def signature(model: nn.Module, parameters: bool = True) -> Signature:
    """`model`'s modules (and with `parameters` its parameter slots and their requires_grad, shape, dtype,
    device) in tree order: the per-call check."""
    objects: list[object] = []
    facts: list[tuple] = []
    stack: list[nn.Module | None] = [model]
    while stack:
        module = stack.pop()
        objects.append(module)
        if module is None:
            continue
        if parameters:
            for p in module._parameters.values():
                objects.append(p)
                if p is not None:
                    facts.append((p.requires_grad, p.shape, p.dtype, p.device))
        stack.extend(module._modules.values())
    return Signature(tuple(objects), tuple(facts))


@dataclass(frozen=True, eq=False)
class ModelState:
    """A model as a step captured it: its signature and, by qualified name, its modules and parameters."""

    key: Signature
    modules: dict[str, nn.Module]
    params: dict[str, _Param] | None             # None: parameters are not checked

    @classmethod
    def of(cls, model: nn.Module, parameters: bool = True) -> "ModelState":
        params = {name: _Param(p, p.requires_grad, tuple(p.shape), p.dtype, p.device)
                  for name, p in model.named_parameters(remove_duplicate=False)} if parameters else None
        return cls(signature(model, parameters), dict(model.named_modules(remove_duplicate=False)), params)

    def changes(self, model: nn.Module) -> list[Change]:
        """What differs in `model` from this state, by qualified name; [] when nothing does."""
        if signature(model, self.params is not None).same(self.key):
            return []
        return _differences(self, ModelState.of(model, self.params is not None))


def describe(changes: list[Change]) -> str:
    """The changes in a phrase: "module 'a' is now Tanh, was GELU; parameter 'b' is a new tensor"."""
    return "; ".join(c.text for c in changes)


def _differences(old: ModelState, new: ModelState) -> list[Change]:
    out: list[Change] = []
    replaced: list[str] = []                     # modules reported: what is under them is not

    def under(name: str) -> bool:
        return any(name.startswith(r + ".") for r in replaced)

    for name in dict.fromkeys([*old.modules, *new.modules]):
        a, b = old.modules.get(name), new.modules.get(name)
        if a is not b and not under(name):
            replaced.append(name)
            out.append(Change("module", _module_change(name, a, b)))
    for name in dict.fromkeys([*(old.params or {}), *(new.params or {})]):
        change = _param_change(name, (old.params or {}).get(name), (new.params or {}).get(name))
        if change is not None and not under(name):
            out.append(change)
    return out


def _module_change(name: str, was: nn.Module | None, now: nn.Module | None) -> str:
    if now is None:
        return f"module {name!r} ({type(was).__name__}) was removed"
    if was is None:
        return f"module {name!r} ({type(now).__name__}) was added"
    if type(was) is not type(now):
        return f"module {name!r} is now {type(now).__name__}, was {type(was).__name__}"
    return f"module {name!r} is another {type(now).__name__} object"


def _param_change(name: str, was: _Param | None, now: _Param | None) -> Change | None:
    if now is None or was is None:
        return Change("other", f"parameter {name!r} was {'removed' if now is None else 'added'}")
    if was.requires_grad and not now.requires_grad:
        return Change("frozen", f"parameter {name!r} no longer requires grad")
    if not was.requires_grad and now.requires_grad:
        return Change("other", f"parameter {name!r} now requires grad")
    if (was.shape, was.dtype, was.device) != (now.shape, now.dtype, now.device):
        new = " (a new tensor)" if was.tensor is not now.tensor else ""
        return Change("other", f"parameter {name!r} is now {now.facts()}{new}, was {was.facts()}")
    if was.tensor is not now.tensor:
        return Change("rebound", f"parameter {name!r} is a new tensor")
    return None
