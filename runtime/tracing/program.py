"""The captured program: the FX joint graph behind an operator graph (never serialized), and the
error capture raises."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from torch import fx


class CaptureError(RuntimeError):
    """The training step cannot be captured or folded into an operator graph."""


@dataclass(eq=False)
class Program:
    """The captured FX joint graph and its mapping onto the operator graph (never serialized)."""

    gm: fx.GraphModule
    placeholders: list[fx.Node]
    params: list[str]                    # FQN per parameter placeholder, in placeholder order
    buffers: list[str]                   # FQN per buffer placeholder
    outputs: list[fx.Node]               # FX graph outputs, in FX order
    mutated_buffers: list[str]           # FQN of the buffer updated by each leading FX output
    grad_params: list[str]               # FQN of the parameter of each trailing gradient output
    groups: list[list[fx.Node]]          # per operator node: its FX nodes in execution order
    value_of: dict[fx.Node, int]         # tensor-valued FX node -> value (storage) id
    primary: list[Any]                   # value id -> FX node holding it, or (tuple node, index)
    random_devices: dict[int, str] = field(default_factory=dict)  # node id -> device of its RNG
    batch_signature: tuple = ()
