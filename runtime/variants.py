"""Implementation variants of operator nodes: which ones a graph offers, what each reads and allocates.

Torch-free: planners and the plan checker see variants as data. The executor's code for each variant
lives in `runtime.variant_ops` (torch; its kernels in `runtime.variant_kernels`).

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
- `bitmask` on the same nodes as `mask`: the same mask packed 1 bit per element (element j is bit j % 8 of
  byte j // 8, in the memory order of the forward input; ceil(n / 8) bytes, 8x fewer than `mask`); the
  backward unpacks it into a temporary bool mask and computes the same `where(mask, 0, grad)`, so it is
  bit-identical like `mask`, a little slower, and keeps 32x fewer bytes than the fp32 activation.
  Where a node offers both, the solver picks by the profiled time and the bytes kept.
- `output` on the backward of training BatchNorm and of LayerNorm: output-activated normalization
  (in-place activated BatchNorm, Bulo et al. 2018; MONeT's output-activated operators). The backward
  reads the forward's output y, the saved 1/std and the affine parameters instead of the input x and the
  saved mean, reconstructing x_hat = (y - beta) / gamma. Only the backward changes. Within the
  validation tolerance, not bit-identical; needs gamma nonzero (asserted at run time).
- `compact` on `aten.max_pool2d_with_indices` and its backward: MONeT's intermediate-activated max-pool.
  The forward keeps a uint8 window position per output element instead of the int64 flat indices; the
  backward rebuilds the indices and no longer reads the forward input. Bit-identical.
- `math` on the CPU flash attention (`aten._scaled_dot_product_flash_attention_for_cpu`) and its
  backward: the math backend, whose forward keeps the attention probabilities (B x H x L x S) instead of
  the log-sum-exp and whose backward reads them, not the output. With fewer key/value heads than query
  heads (grouped-query or multi-query attention, SDPA's `enable_gqa`), each key/value head serves its group
  of query heads as in ATen, without repeating keys and values. Within the validation tolerance.
- `inplace` on a forward ReLU (`aten.relu`) whose input is an activation read by nothing else in the
  whole graph (no other forward node, no backward node; not a graph output): the forward runs `relu_` on
  its input, writing the output into the input's storage (MONeT's in-place operators, appendix C.3), so
  the step allocates nothing. The spec declares it as data: `overwrites = ((output, input),)`; planners
  then count the output in the input's bytes and must not read the input after the step
  (`tasks.solve.core.simulator`). Offered as `inplace` (the default backward, reading the output), and where
  the node offers `mask` / `bitmask` also as `mask-inplace` / `bitmask-inplace`: the same mask value as
  `mask` / `bitmask` (so the backward's `mask` / `bitmask` variant reads it), computed from the input
  before `relu_` overwrites it. Bit-identical. Another node's variant may still read the input (the
  `output` BatchNorm backward reads the BatchNorm output): then a schedule running the ReLU in place must
  compute the input again before that read (the simulator and plan validation refuse it otherwise).
  In-place copies get no arena address (refused; `runtime.arena` runs the step as a fallback).
- `sigmoid` on `aten.tanh` and on memplan's fused tanh-GELU (`memplan.gelu_tanh_inner`,
  runtime/fused_gelu.py): the same tanh computed as `2 sigmoid(2 z) - 1`, which ATen's CPU kernels run
  about 2.4x faster than its tanh (whether it is faster on a device is the profile's to say). Same
  inputs, outputs and bytes; a variant of time only (MONeT's operator implementations differ in time as in
  memory). Within the validation tolerance (2.5e-7 of the tanh), not bit-identical.

A convolution's backward split into weight- and input-gradient nodes (MONeT appendix D) is not a variant:
`runtime.capture` always splits it (docs/plan-format.md).
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


def _zero_gradient_pairs(g: OpGraph):
    """(forward node, its output value, whether it is hardtanh, [(backward node, value it reads)]) for every
    ReLU / hardtanh forward node and the backward nodes that read its output (ReLU) or its input or a clone
    of its input (hardtanh): the nodes rules `mask` and `bitmask` pair."""
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
        hardtanh = backward_target == "aten.hardtanh_backward.default"
        if not hardtanh:
            saved = {out.id}                           # ReLU's backward reads the output
        else:                                          # hardtanh's reads the input, or a clone of it
            x = node.inputs[0]
            saved = {x} | {c for r in readers.get(x, ()) if g.nodes[r].targets[0] == "aten.clone.default"
                           for c in g.nodes[r].outputs}
        pairs = [(r, v) for v in sorted(saved) for r in readers.get(v, ())
                 if g.nodes[r].targets[0] == backward_target and g.nodes[r].inputs[1] == v]
        if pairs:
            yield node, out, hardtanh, pairs


def _add_mask_pair(b: _Builder, rule: str, node, pairs, mask: int, forward_workspace: int,
                   backward_workspace: int) -> None:
    """Variant `rule` of a ReLU / hardtanh forward node (also allocating `mask`) and of its backward nodes
    (reading `mask` instead of the activation)."""
    g = b.graph
    b.add(VariantSpec(node.id, rule, rule, tuple(dict.fromkeys(node.inputs)), (*node.outputs, mask), forward_workspace))
    for r, v in pairs:
        inputs = tuple(dict.fromkeys(mask if i == v else i for i in g.nodes[r].inputs))
        b.add(VariantSpec(r, rule, rule, inputs, tuple(g.nodes[r].outputs), backward_workspace))


def _zero_mask(b: _Builder) -> None:
    """Rule `mask` (module docstring): a 1-byte bool mask per element."""
    for node, out, hardtanh, pairs in _zero_gradient_pairs(b.graph):
        numel = out.bytes // DTYPE_BYTES[out.dtype]
        mask = b.new_value(numel, out.shape, "bool", f"{out.name}.zero_mask", node.id)
        # workspace: hardtanh's second comparison; the backward's masked_fill allocates no scalar
        _add_mask_pair(b, "mask", node, pairs, mask, numel if hardtanh else 0, 0)


def _zero_bitmask(b: _Builder) -> None:
    """Rule `bitmask` (module docstring): the mask packed 8 elements per byte."""
    for node, out, hardtanh, pairs in _zero_gradient_pairs(b.graph):
        numel = out.bytes // DTYPE_BYTES[out.dtype]
        packed = (numel + 7) // 8
        mask = b.new_value(packed, (packed,), "uint8", f"{out.name}.zero_bitmask", node.id)
        # workspace: the forward packs bit k of every byte from one strided comparison at a time (one
        # packed-size temporary, two for hardtanh); the backward unpacks into a bool mask of numel bytes
        _add_mask_pair(b, "bitmask", node, pairs, mask, packed * (2 if hardtanh else 1), numel)


_NORMS = {  # training forward -> its backward; outputs (y, saved mean, saved 1/std, ...)
    "aten._native_batch_norm_legit_functional.default": "aten.native_batch_norm_backward.default",
    "aten._native_batch_norm_legit.default": "aten.native_batch_norm_backward.default",
    "aten.native_batch_norm.default": "aten.native_batch_norm_backward.default",
    "aten.native_layer_norm.default": "aten.native_layer_norm_backward.default",
}


def _forward_partner(g: OpGraph, node) -> int | None:
    """The normalization forward node whose saved statistics backward `node` reads."""
    for v in node.inputs:
        producer = g.values[v].producer
        if producer is not None and _NORMS.get(g.nodes[producer].targets[0]) == node.targets[0]:
            return producer
    return None


def _norm_output(b: _Builder) -> None:
    """Rule `output` (module docstring): BatchNorm / LayerNorm backward from the forward's output."""
    g = b.graph
    for node in g.nodes:
        forward = _forward_partner(g, node) if node.phase == "backward" else None
        if forward is None:
            continue
        f = g.nodes[forward]
        x, (y, mean, rstd) = f.inputs[0], f.outputs[:3]
        if x not in node.inputs or rstd not in node.inputs or g.values[y].dtype not in DTYPE_BYTES:
            continue
        params = [v for v in f.inputs if g.values[v].kind == "param"]       # weight and bias
        inputs = tuple(dict.fromkeys([y if v == x else v for v in node.inputs if v != mean] + params))
        out = g.values[y]
        size = DTYPE_BYTES[out.dtype]
        if node.targets[0] == "aten.native_batch_norm_backward.default":
            workspace = 6 * out.shape[1] * size                   # per-channel sums and coefficients
        else:                                                     # row statistics, one block of column sums
            width = g.values[params[0]].bytes // size if params else out.shape[-1]
            rows = out.bytes // size // width
            workspace = (3 * rows + min(rows, max(1, 65536 // width)) * width) * size
        b.add(VariantSpec(node.id, "output", "output", inputs, tuple(node.outputs), workspace))


def _maxpool_compact(b: _Builder) -> None:
    """Rule `compact` (module docstring): max-pool indices as 1-byte window positions."""
    g = b.graph
    readers = _readers(g)
    pools = {"aten.max_pool2d_with_indices.default": "aten.max_pool2d_with_indices_backward.default"}
    for node in g.nodes:
        if node.phase == "backward" or node.targets[0] not in pools or len(node.outputs) != 2:
            continue
        out, indices = node.outputs
        users = readers.get(indices, [])
        if not users or any(g.nodes[r].targets[0] != pools[node.targets[0]] for r in users):
            continue
        shape = g.values[out].shape
        compact = b.new_value(g.values[out].bytes // DTYPE_BYTES[g.values[out].dtype], shape, "uint8",
                              f"{g.values[indices].name}.window", node.id)
        # workspace: the int64 indices (now a temporary) and one int64 temporary converting them; the backward
        # rebuilds the int64 indices in one buffer (its uint8 temporary is freed before the gradient exists)
        index_bytes = g.values[indices].bytes
        b.add(VariantSpec(node.id, "compact", "compact", tuple(dict.fromkeys(node.inputs)), (out, compact),
                          2 * index_bytes))
        x = node.inputs[0]
        for r in users:
            inputs = tuple(dict.fromkeys(compact if v == indices else v for v in g.nodes[r].inputs if v != x))
            grad_bytes = sum(g.values[v].bytes for v in g.nodes[r].outputs)
            scalar = DTYPE_BYTES[g.values[out].dtype]            # the zero-stride stand-in for the input
            b.add(VariantSpec(r, "compact", "compact", inputs, tuple(g.nodes[r].outputs),
                              max(index_bytes + scalar, index_bytes + index_bytes // 8 - grad_bytes)))


_ATTENTION = {"aten._scaled_dot_product_flash_attention_for_cpu.default":
              "aten._scaled_dot_product_flash_attention_for_cpu_backward.default"}


def _attention_math(b: _Builder) -> None:
    """Rule `math` (module docstring): attention as softmax(q k^T) v, saving the probabilities."""
    g = b.graph
    readers = _readers(g)
    for node in g.nodes:
        backward_target = _ATTENTION.get(node.targets[0])
        if backward_target is None or node.phase == "backward":
            continue
        out, lse = (g.values[v] for v in node.outputs[:2])
        users = readers.get(lse.id, [])
        if not users or any(g.nodes[r].targets[0] != backward_target for r in users) or out.dtype not in DTYPE_BYTES:
            continue
        # the key length, from the key gradient the backward allocates (batch..., keys, head dim); the
        # executor checks the probabilities it computes against this shape
        grads = g.nodes[users[0]].outputs
        if len(grads) != 3:
            continue
        probs_shape = (*lse.shape, g.values[grads[1]].shape[-2])
        nbytes = DTYPE_BYTES[out.dtype]
        for s in probs_shape:
            nbytes *= s
        probs = b.new_value(nbytes, probs_shape, out.dtype, f"{out.name}.probs", node.id)
        # workspace: the scores (softmax allocates the probabilities beside them), or the output before its copy
        # into the captured strides
        b.add(VariantSpec(node.id, "math", "math", tuple(dict.fromkeys(node.inputs)), (out.id, probs),
                          max(nbytes, out.bytes)))
        # grouped-query attention stacks each key/value head's query heads: the output gradient may be copied
        grouped = out.bytes if g.values[grads[1]].shape[-3] != lse.shape[-2] else 0
        for r in users:
            inputs = tuple(dict.fromkeys(probs if v == lse.id else v for v in g.nodes[r].inputs if v != out.id))
            b.add(VariantSpec(r, "math", "math", inputs, tuple(g.nodes[r].outputs),
                              nbytes + out.bytes + grouped))   # dS, and one gradient before its copy into place


def _relu_in_place(b: _Builder) -> None:
    """Rule `inplace` (module docstring): ReLU forward into its input's storage, alone or with the mask /
    bitmask of rules `mask` / `bitmask` (which must run first to offer those combinations)."""
    g = b.graph
    readers = _readers(g)
    outputs = set(g.outputs)
    for node in g.nodes:
        if node.phase == "backward" or node.targets[0] != "aten.relu.default" or len(node.outputs) != 1 \
                or len(set(node.inputs)) != 1:
            continue
        (x,), out = tuple(dict.fromkeys(node.inputs)), node.outputs[0]
        if g.values[x].kind != "activation" or readers.get(x) != [node.id] or x in outputs \
                or g.values[x].bytes != g.values[out].bytes:
            continue
        b.add(VariantSpec(node.id, "inplace", "inplace", (x,), (out,), 0, ((out, x),)))
        for rule in ("mask", "bitmask"):
            spec = b.specs.get(node.id, {}).get(rule)
            if spec is not None:
                b.add(VariantSpec(node.id, f"{rule}-inplace", "inplace", (x,), spec.outputs, spec.workspace,
                                  ((out, x),)))


def _tanh_by_sigmoid(b: _Builder) -> None:
    """Rule `sigmoid` (module docstring): a tanh by its sigmoid identity."""
    for node in b.graph.nodes:
        if node.targets[0] in ("aten.tanh.default", "memplan.gelu_tanh_inner.default"):
            b.add(VariantSpec(node.id, "sigmoid", "sigmoid", tuple(dict.fromkeys(node.inputs)), tuple(node.outputs)))


BIT_IDENTICAL_RULES = ("mask", "bitmask", "compact", "inplace")
"""The rules whose code gives ATen's bits (module docstring): a plan using only these trains exactly like eager.
The others (`output`, `math`, `sigmoid`) are within the validation tolerance."""


# registry order numbers the variant values: a new rule goes last, so plans written before it keep their ids
RULES: dict[str, Callable[[_Builder], None]] = {"mask": _zero_mask, "output": _norm_output,
                                                "compact": _maxpool_compact, "math": _attention_math,
                                                "bitmask": _zero_bitmask, "inplace": _relu_in_place,
                                                "sigmoid": _tanh_by_sigmoid}


def graph_variants(graph: OpGraph, rules: tuple[str, ...] | None = None) -> GraphVariants:
    """The variants `graph` offers under `rules` (default: every rule in `RULES`). Every rule runs, in
    registry order, and the specs of those not chosen are dropped, so variant value ids do not depend on
    `rules`: a plan made with some rules names the values that `graph_variants(graph)` (the executor's,
    the plan checker's) numbers alike. A dropped rule's values stay listed, allocated by no variant."""
    unknown = [name for name in rules or () if name not in RULES]
    if unknown:
        raise KeyError(f"unknown variant rule {unknown[0]!r}; known rules: {', '.join(RULES)}.")
    b = _Builder(graph)
    for name, rule in RULES.items():
        kept = {node: dict(specs) for node, specs in b.specs.items()}
        rule(b)
        if rules is not None and name not in rules:
            b.specs = kept
    return GraphVariants(len(graph.values), tuple(b.values), b.specs)
