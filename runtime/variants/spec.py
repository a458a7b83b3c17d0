"""The data of implementation variants (torch-free): `VariantSpec` (what one variant of one node reads,
allocates and overwrites), `GraphVariants` (what a graph offers), `Builder` (what a rule's `offer` fills)
and `Rule` (one variant rule: its offer, its code and whether that code gives ATen's bits). The rules
themselves live in `runtime.variants.rules`, one module each; `runtime.variants.offered.graph_variants` runs them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from memplan.runtime.format.graph import OpGraph, Value

DEFAULT = "default"
DTYPE_BYTES = {"float64": 8, "float32": 4, "float16": 2, "bfloat16": 2}


@dataclass(frozen=True)
class VariantSpec:
    """Variant `name` of node `node`: the values it reads and allocates, its workspace (bytes, analytic;
    a profile's measured workspace takes precedence) and the rule whose code the executor runs.
    `overwrites`: pairs (output, input), the output computed in place into the input's storage."""

    node: int
    name: str
    rule: str
    inputs: tuple[int, ...]
    outputs: tuple[int, ...]
    workspace: int = 0
    overwrites: tuple[tuple[int, int], ...] = ()

    def __post_init__(self) -> None:
        for out, inp in self.overwrites:
            if out not in self.outputs or inp not in self.inputs:
                raise ValueError(f"variant {self.name!r} of node {self.node} overwrites input {inp} with output "
                                 f"{out}, but its inputs are {self.inputs} and outputs {self.outputs}; an in-place "
                                 f"pair names one of each.")


@dataclass(frozen=True)
class GraphVariants:
    """The variants a graph offers. `values` are the variant values (activations whose ids follow the
    graph's); `specs[node]` the node's non-default variants, by name."""

    num_graph_values: int
    values: tuple[Value, ...]
    specs: dict[int, dict[str, VariantSpec]]

    def names(self, node: int) -> tuple[str, ...]:
        """Implementation names of `node`, the default first."""
        return (DEFAULT, *self.specs.get(node, {}))

    def spec(self, node: int, impl: str | None) -> VariantSpec | None:
        """The non-default variant `impl` of `node`, None for the default; KeyError names the choices."""
        if impl is None or impl == DEFAULT:
            return None
        found = self.specs.get(node, {}).get(impl)
        if found is None:
            raise KeyError(f"node {node} has no implementation variant {impl!r}; it offers "
                           f"{', '.join(self.names(node))}.")
        return found

    def io(self, graph: OpGraph, node: int, impl: str | None) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """(values read, values allocated) by `node` run as `impl`."""
        spec = self.spec(node, impl)
        if spec is None:
            return tuple(dict.fromkeys(graph.nodes[node].inputs)), tuple(graph.nodes[node].outputs)
        return spec.inputs, spec.outputs

    def restricted(self, keep: Callable[[VariantSpec], bool]) -> "GraphVariants":
        """The variants `keep` accepts, less those that read a variant value no kept variant allocates (a
        backward whose forward's mask is gone); variant values and their ids stay as they are."""
        specs = {node: {name: s for name, s in named.items() if keep(s)} for node, named in self.specs.items()}
        while True:
            made = {v for named in specs.values() for s in named.values() for v in s.outputs}
            orphans = {(node, name) for node, named in specs.items() for name, s in named.items()
                       if any(v >= self.num_graph_values and v not in made for v in s.inputs)}
            if not orphans:
                return GraphVariants(self.num_graph_values, self.values,
                                     {node: named for node, named in specs.items() if named})
            specs = {node: {name: s for name, s in named.items() if (node, name) not in orphans}
                     for node, named in specs.items()}

    def value(self, graph: OpGraph, value: int) -> Value:
        """Value `value`: one of the graph's, or a variant value."""
        return graph.values[value] if value < self.num_graph_values else self.values[value - self.num_graph_values]


class Builder:
    """Numbers variant values and collects specs while rules offer them (`Rule.offer`)."""

    def __init__(self, graph: OpGraph):
        self.graph = graph
        self.values: list[Value] = []
        self.specs: dict[int, dict[str, VariantSpec]] = {}

    def new_value(self, nbytes: int, shape: tuple[int, ...], dtype: str, name: str, producer: int) -> int:
        vid = len(self.graph.values) + len(self.values)
        self.values.append(Value(vid, nbytes, shape, dtype, "activation", name, producer))
        return vid

    def add(self, spec: VariantSpec) -> None:
        if spec.name == DEFAULT or spec.name in self.specs.get(spec.node, {}):
            raise ValueError(f"variant {spec.name!r} of node {spec.node} is declared twice.")
        self.specs.setdefault(spec.node, {})[spec.name] = spec


def readers(graph: OpGraph) -> dict[int, list[int]]:
    """Value id -> the nodes that read it, in node order."""
    readers: dict[int, list[int]] = {}
    for node in graph.nodes:
        for v in dict.fromkeys(node.inputs):
            readers.setdefault(v, []).append(node.id)
    return readers



@dataclass(frozen=True)
class Rule:
    """A variant rule: `offer` adds the specs of the variants it offers on a graph (torch-free data), `emit`
    emits a spec's code into the step's FX graph (`runtime.variants.ops.emit_variant`), and `bit_identical`
    says whether that code gives ATen's bits (a plan using only such rules trains exactly like eager)."""

    name: str
    offer: Callable[[Builder], None]
    emit: Callable[[Any], dict[int, Any]]          # (runtime.variants.ops.VariantStep) -> {value id: FX node}
    bit_identical: bool
