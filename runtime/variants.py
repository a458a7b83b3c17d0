"""Implementation variants of operator nodes: which ones a graph offers, what each reads and allocates.

Torch-free: planners and the plan checker see variants as data. The executor's code for each variant
lives in `runtime.variant_ops` (torch).

A node's **default** variant is the captured ATen op (the node as the graph lists it). A non-default
variant computes the same values the node's readers need, but may read other values, allocate extra
values and need another workspace (MONeT, Gupta et al. 2021: an operator's implementations differ in
what the backward keeps, D_k^l, and in workspace and time). Values that only variants allocate are
**variant values**: ids `len(graph.values)`, `len(graph.values) + 1`, ... in the order `graph_variants`
lists them, a pure function of the graph, so plans name them by id like any other value.

Rules shipped (`RULES`):
- `mask` on ReLU (`aten.relu` / `aten.threshold_backward`) and ReLU6 / hardtanh
  (`aten.hardtanh` / `aten.hardtanh_backward`): the forward node also allocates a bool mask of the
  elements whose gradient is zero (1 byte per element: `x <= 0`, or `x <= min or x >= max`), and
  the backward node reads that mask instead of the forward's output (ReLU) or input (hardtanh, or the
  clone of it that an in-place ReLU6 saves): `grad_input = where(mask, 0, grad)`. The same comparisons
  as ATen's backward kernels, so gradients are bit-identical (for ReLU also at NaN inputs; ATen's own CPU
  hardtanh backward treats NaN differently in its vectorized and scalar loops, so there only finite
  inputs match). The 4-byte activation the default backward holds until the backward pass can be
  freed once its forward readers are done.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from runtime.graph import OpGraph, Value

DEFAULT = "default"
DTYPE_BYTES = {"float64": 8, "float32": 4, "float16": 2, "bfloat16": 2}


@dataclass(frozen=True)
class VariantSpec:
    """Variant `name` of node `node`: the values it reads and allocates, its workspace (bytes, analytic;
    a profile's measured workspace takes precedence) and the rule whose code the executor runs."""

    node: int
    name: str
    rule: str
    inputs: tuple[int, ...]
    outputs: tuple[int, ...]
    workspace: int = 0


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

    def value(self, graph: OpGraph, value: int) -> Value:
        """Value `value`: one of the graph's, or a variant value."""
        return graph.values[value] if value < self.num_graph_values else self.values[value - self.num_graph_values]


class _Builder:
    """Numbers variant values and collects specs while rules run."""

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


def _readers(graph: OpGraph) -> dict[int, list[int]]:
    readers: dict[int, list[int]] = {}
    for node in graph.nodes:
        for v in dict.fromkeys(node.inputs):
            readers.setdefault(v, []).append(node.id)
    return readers


def _zero_mask(b: _Builder) -> None:
    """Rule `mask` (module docstring): pairs each ReLU / hardtanh forward node with the backward nodes
    that read its output (ReLU) or its input or a clone of its input (hardtanh)."""
    g = b.graph
    readers = _readers(g)
    kinds = {"aten.relu.default": "aten.threshold_backward.default",
             "aten.hardtanh.default": "aten.hardtanh_backward.default"}
    for node in g.nodes:
        backward_target = kinds.get(node.targets[0])
        if backward_target is None or len(node.outputs) != 1 or node.phase == "backward":
            continue
        out = g.values[node.outputs[0]]
        if out.dtype not in DTYPE_BYTES:
            continue
        if backward_target == "aten.threshold_backward.default":
            saved = {out.id}                           # ReLU's backward reads the output
        else:                                          # hardtanh's reads the input, or a clone of it
            x = node.inputs[0]
            saved = {x} | {c for r in readers.get(x, ()) if g.nodes[r].targets[0] == "aten.clone.default"
                           for c in g.nodes[r].outputs}
        pairs = [(r, v) for v in sorted(saved) for r in readers.get(v, ())
                 if g.nodes[r].targets[0] == backward_target and g.nodes[r].inputs[1] == v]
        if not pairs:
            continue
        numel = out.bytes // DTYPE_BYTES[out.dtype]
        mask = b.new_value(numel, out.shape, "bool", f"{out.name}.zero_mask", node.id)
        workspace = 0 if backward_target == "aten.threshold_backward.default" else numel  # one more comparison
        b.add(VariantSpec(node.id, "mask", "mask", tuple(dict.fromkeys(node.inputs)), (*node.outputs, mask), workspace))
        for r, v in pairs:
            inputs = tuple(dict.fromkeys(mask if i == v else i for i in g.nodes[r].inputs))
            b.add(VariantSpec(r, "mask", "mask", inputs, tuple(g.nodes[r].outputs)))


RULES: dict[str, Callable[[_Builder], None]] = {"mask": _zero_mask}


def graph_variants(graph: OpGraph, rules: tuple[str, ...] | None = None) -> GraphVariants:
    """The variants `graph` offers under `rules` (default: every rule in `RULES`, in registry order)."""
    b = _Builder(graph)
    for name in RULES if rules is None else rules:
        if name not in RULES:
            raise KeyError(f"unknown variant rule {name!r}; known rules: {', '.join(RULES)}.")
        RULES[name](b)
    return GraphVariants(len(graph.values), tuple(b.values), b.specs)
