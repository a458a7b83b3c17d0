"""Rule `compact` on `aten.max_pool2d_with_indices` and its backward: MONeT's intermediate-activated max-pool.
The forward keeps a uint8 window position per output element instead of the int64 flat indices; the
backward rebuilds the indices and no longer reads the forward input. Bit-identical.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from memplan.runtime.variants.spec import DTYPE_BYTES, Builder, Rule, VariantSpec, readers

if TYPE_CHECKING:
    from torch import fx

    from memplan.runtime.variants.ops import VariantStep


# -- offer (torch-free: what the variants read, allocate and overwrite) ------------------------------


def _offer(b: Builder) -> None:
    """Rule `compact` (module docstring): max-pool indices as 1-byte window positions."""
    g = b.graph
    read_by = readers(g)
    pools = {"aten.max_pool2d_with_indices.default": "aten.max_pool2d_with_indices_backward.default"}
    for node in g.nodes:
        if node.phase == "backward" or node.targets[0] not in pools or len(node.outputs) != 2:
            continue
        out, indices = node.outputs
        users = read_by.get(indices, [])
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


# -- emit (the variant's code, torch imported when it runs) --------------------------------------


def _pair(v, n: int = 2) -> list[int]:
    return list(v) * (n // len(v)) if isinstance(v, (list, tuple)) else [v] * n


def _pool_args(head: fx.Node) -> tuple[list[int], list[int], list[int], list[int]]:
    """kernel, stride, padding, dilation of a max_pool2d_with_indices(_backward) call, as pairs."""
    from memplan.runtime.variants.ops import aten, schema_arg

    offset = 1 if head.target is aten.max_pool2d_with_indices.default else 2
    kernel = _pair(schema_arg(head, offset))
    stride = _pair(schema_arg(head, offset + 1)) if schema_arg(head, offset + 1) else kernel
    return kernel, stride, _pair(schema_arg(head, offset + 2)), _pair(schema_arg(head, offset + 3))


def _emit(step: VariantStep) -> dict[int, fx.Node]:
    """Rule `compact` (module docstring): max-pool indices kept as uint8 window positions."""
    from memplan.runtime.variants.kernels import max_pool_backward_from_windows, window_positions
    from memplan.runtime.variants.ops import VariantError, aten, schema_arg

    head, graph = step.head, step.graph
    kernel, stride, padding, dilation = _pool_args(head)
    if kernel[0] * kernel[1] > 256:
        raise VariantError(f"node {step.spec.node} ({head.name}) pools {kernel} windows, more positions than one "
                           f"byte holds; run it as the default variant.")
    if head.target is aten.max_pool2d_with_indices.default:
        step.copy_group()
        indices = step.env[graph.program.primary[graph.nodes[step.spec.node].outputs[1]]]
        width = head.args[0].meta["val"].shape[-1]
        return {step.spec.outputs[-1]: step.call(window_positions, indices, width, kernel, stride, padding, dilation)}
    if head.target is aten.max_pool2d_with_indices_backward.default:
        windows = step.values[next(v for v in step.spec.inputs if v >= step.variants.num_graph_values)]
        shape = list(head.args[1].meta["val"].shape)
        step.copy_group(lambda: step.call(max_pool_backward_from_windows, step.resolve(head.args[0]), windows, shape,
                                          kernel, stride, padding, dilation, schema_arg(head, 6)))
        return {}
    raise VariantError(f"variant 'compact' of node {step.spec.node} ({head.name}) runs {head.target}, which is not "
                       f"a 2-d max-pool or its backward; the graph's variants do not match its program.")


COMPACT = Rule("compact", offer=_offer, emit=_emit, bit_identical=True)
