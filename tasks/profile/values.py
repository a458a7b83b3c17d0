"""The graph values a profile round keeps between nodes, within a bound on their bytes.

A round runs the graph in node order and feeds every node the values its producers computed. Kept until
their last reads, those values reach the step's no-recomputation peak, eager's: a step that needs a plan to
fit its device could not be profiled there (GPT-2 124M at twice the batch eager fits on an H100). With a
bound, once the kept bytes exceed it the values read farthest ahead are dropped (Belady's rule, which makes
the fewest stand-ins), and a node that reads a dropped value gets a stand-in of the same layout (storage
size, shape, strides, offset and dtype), filled as `tasks.profile.stage.graph_inputs` fills the graph's inputs:
floating N(0, 1), integers 0 (a valid index), booleans True. Kernel times and allocations depend on
layouts, not values, so the columns keep their meaning; only a node reading stand-ins computes other
numbers. Graph inputs (parameters, batch), variant values and the inputs of nodes with variants are never
dropped: a variant's outputs are compared with its default's on the same computed inputs.
"""

from __future__ import annotations

import math
from collections.abc import Container
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Layout:
    """What a stand-in copies of a dropped value."""

    storage_elements: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int
    dtype: torch.dtype
    device: torch.device

    @classmethod
    def of(cls, t: torch.Tensor) -> "Layout":
        return cls(t.untyped_storage().nbytes() // t.element_size(), tuple(t.shape), tuple(t.stride()),
                   t.storage_offset(), t.dtype, t.device)

    def stand_in(self, generator: torch.Generator) -> torch.Tensor:
        flat = torch.empty(self.storage_elements, dtype=self.dtype, device=self.device)
        if self.dtype == torch.bool:
            flat.fill_(True)
        elif self.dtype.is_floating_point or self.dtype.is_complex:
            flat.normal_(generator=generator)
        else:
            flat.zero_()
        return flat.as_strided(self.shape, self.stride, self.offset)


def _kept_bytes(tensors) -> int:
    """Bytes of the distinct storages of `tensors`."""
    return sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}.values())


class LiveValues:
    """Value id -> tensor for a profile round: `reads[v]` lists the nodes reading value `v` in node order;
    `bound` caps the bytes kept between nodes (None: no bound); only values with ids in `droppable` (the
    graph's computed values) are dropped."""

    def __init__(self, values: dict[int, torch.Tensor], reads: dict[int, list[int]], bound: int | None,
                 droppable: Container[int], seed: int):
        self._kept = dict(values)
        self._dropped: dict[int, Layout] = {}
        self._reads, self._bound, self._droppable, self._seed = reads, bound, droppable, seed
        self._generators: dict[torch.device, torch.Generator] = {}
        self.stand_ins = 0

    def __contains__(self, v: int) -> bool:
        return v in self._kept or v in self._dropped

    def __getitem__(self, v: int) -> torch.Tensor:
        if v not in self._kept:
            layout = self._dropped[v]
            if layout.device not in self._generators:
                self._generators[layout.device] = torch.Generator(layout.device).manual_seed(self._seed)
            self._kept[v] = layout.stand_in(self._generators[layout.device])
            self.stand_ins += 1
        return self._kept[v]

    def update(self, pairs) -> None:
        for v, t in pairs:
            self._kept[v] = t
            self._dropped.pop(v, None)

    def pop(self, v: int) -> None:
        self._kept.pop(v, None)
        self._dropped.pop(v, None)

    def shrink(self, after: int) -> None:
        """Drop kept values, those read farthest after node `after` first, until the kept bytes are within the
        bound (each value its own storage: the bytes a drop frees are its storage's)."""
        if self._bound is None:
            return
        kept = _kept_bytes(self._kept.values())
        if kept <= self._bound:
            return

        def next_read(v: int) -> float:
            return next((n for n in self._reads.get(v, ()) if n > after), math.inf)

        for v in sorted((v for v in self._kept if v in self._droppable), key=next_read, reverse=True):
            t = self._kept.pop(v)
            self._dropped[v] = Layout.of(t)
            kept -= t.untyped_storage().nbytes()
            if kept <= self._bound:
                return
