"""Rule `output` on the backward of training BatchNorm and of LayerNorm: output-activated normalization
(in-place activated BatchNorm, Bulo et al. 2018; MONeT's output-activated operators). The backward
reads the forward's output y, the saved 1/std and the affine parameters instead of the input x and the
saved mean, reconstructing x_hat = (y - beta) / gamma. Only the backward changes. Within the
validation tolerance, not bit-identical; needs gamma nonzero (asserted at run time).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from memplan.runtime.format.graph import OpGraph
from memplan.runtime.variants.spec import DTYPE_BYTES, Builder, Rule, VariantSpec

if TYPE_CHECKING:
    from torch import fx

    from memplan.runtime.variants.ops import VariantStep


# -- offer (torch-free: what the variants read, allocate and overwrite) ------------------------------


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


def _offer(b: Builder) -> None:
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


# -- emit (the variant's code, torch imported when it runs) --------------------------------------


def _emit(step: VariantStep) -> dict[int, fx.Node]:
    """Rule `output` (module docstring): the normalization backward reads the forward's output, not its input."""
    from memplan.runtime.variants.kernels import batch_norm_backward_from_output, layer_norm_backward_from_output
    from memplan.runtime.variants.ops import VariantError, aten, head_node, schema_arg

    head, graph = step.head, step.graph
    if head.target is aten.native_batch_norm_backward.default:
        invstd = head.args[6]
        if not schema_arg(head, 7):
            raise VariantError(f"node {step.spec.node} ({head.name}) is an evaluation-mode BatchNorm backward; the "
                               f"output-activated variant needs batch statistics. Run it as the default variant.")
    elif head.target is aten.native_layer_norm_backward.default:
        invstd = head.args[4]
    else:
        raise VariantError(f"variant 'output' of node {step.spec.node} ({head.name}) runs {head.target}, which is "
                           f"not a BatchNorm or LayerNorm backward; the graph's variants do not match its program.")
    forward = graph.values[graph.program.value_of[invstd]].producer
    f = head_node(graph, forward)
    y = step.graph_value(graph.nodes[forward].outputs[0])
    if head.target is aten.native_batch_norm_backward.default:
        weight, bias = schema_arg(f, 1), schema_arg(f, 2)
        call = lambda: step.call(batch_norm_backward_from_output, step.resolve(head.args[0]), y,  # noqa: E731
                                 step.resolve_arg(weight), step.resolve_arg(bias), step.resolve(invstd),
                                 schema_arg(head, 9))
    else:
        call = lambda: step.call(layer_norm_backward_from_output, step.resolve(head.args[0]), y,  # noqa: E731
                                 schema_arg(head, 2), step.resolve(invstd), step.resolve_arg(schema_arg(head, 5)),
                                 step.resolve_arg(schema_arg(head, 6)), schema_arg(head, 7))
    step.copy_group(call)
    return {}


OUTPUT = Rule("output", offer=_offer, emit=_emit, bit_identical=False)
