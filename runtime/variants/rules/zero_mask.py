"""Rules `mask` and `bitmask`: the backward of ReLU / hardtanh reads a mask of the elements whose
gradient is zero instead of an activation.

Rule `mask` on ReLU (`aten.relu` / `aten.threshold_backward`) and ReLU6 / hardtanh
(`aten.hardtanh` / `aten.hardtanh_backward`): the forward node also allocates a bool mask of the
elements whose gradient is zero (1 byte per element: `x <= 0`, or `x <= min or x >= max`), and
the backward node reads that mask instead of the forward's output (ReLU) or input (hardtanh, or the
clone of it that an in-place ReLU6 saves): `grad_input = where(mask, 0, grad)`. The same comparisons
as ATen's backward kernels, so gradients are bit-identical (for ReLU also at NaN inputs; ATen's own CPU
hardtanh backward treats NaN differently in its vectorized and scalar loops, so there only finite
inputs match). The 4-byte activation the default backward holds until the backward pass can be
freed once its forward readers are done.

Rule `bitmask` on the same nodes as `mask`: the same mask packed 1 bit per element (element j is bit j % 8 of
byte j // 8, in the memory order of the forward input; ceil(n / 8) bytes, 8x fewer than `mask`); the
backward unpacks it into a temporary bool mask and computes the same `where(mask, 0, grad)`, so it is
bit-identical like `mask`, a little slower, and keeps 32x fewer bytes than the fp32 activation.
Where a node offers both, the solver picks by the profiled time and the bytes kept.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from memplan.runtime.format.graph import OpGraph
from memplan.runtime.variants.spec import DTYPE_BYTES, Builder, Rule, VariantSpec, readers

if TYPE_CHECKING:
    from torch import fx

    from memplan.runtime.variants.ops import VariantStep


# -- offer (torch-free: what the variants read, allocate and overwrite) ------------------------------


def _zero_gradient_pairs(g: OpGraph):
    """(forward node, its output value, whether it is hardtanh, [(backward node, value it reads)]) for every
    ReLU / hardtanh forward node and the backward nodes that read its output (ReLU) or its input or a clone
    of its input (hardtanh): the nodes rules `mask` and `bitmask` pair."""
    read_by = readers(g)
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
            saved = {x} | {c for r in read_by.get(x, ()) if g.nodes[r].targets[0] == "aten.clone.default"
                           for c in g.nodes[r].outputs}
        pairs = [(r, v) for v in sorted(saved) for r in read_by.get(v, ())
                 if g.nodes[r].targets[0] == backward_target and g.nodes[r].inputs[1] == v]
        if pairs:
            yield node, out, hardtanh, pairs


def _add_mask_pair(b: Builder, rule: str, node, pairs, mask: int, forward_workspace: int,
                   backward_workspace: int) -> None:
    """Variant `rule` of a ReLU / hardtanh forward node (also allocating `mask`) and of its backward nodes
    (reading `mask` instead of the activation)."""
    g = b.graph
    b.add(VariantSpec(node.id, rule, rule, tuple(dict.fromkeys(node.inputs)), (*node.outputs, mask), forward_workspace))
    for r, v in pairs:
        inputs = tuple(dict.fromkeys(mask if i == v else i for i in g.nodes[r].inputs))
        b.add(VariantSpec(r, rule, rule, inputs, tuple(g.nodes[r].outputs), backward_workspace))


def _zero_mask(b: Builder) -> None:
    """Rule `mask` (module docstring): a 1-byte bool mask per element."""
    for node, out, hardtanh, pairs in _zero_gradient_pairs(b.graph):
        numel = out.bytes // DTYPE_BYTES[out.dtype]
        mask = b.new_value(numel, out.shape, "bool", f"{out.name}.zero_mask", node.id)
        # workspace: hardtanh's second comparison; the backward's masked_fill allocates no scalar
        _add_mask_pair(b, "mask", node, pairs, mask, numel if hardtanh else 0, 0)


def _zero_bitmask(b: Builder) -> None:
    """Rule `bitmask` (module docstring): the mask packed 8 elements per byte."""
    for node, out, hardtanh, pairs in _zero_gradient_pairs(b.graph):
        numel = out.bytes // DTYPE_BYTES[out.dtype]
        packed = (numel + 7) // 8
        mask = b.new_value(packed, (packed,), "uint8", f"{out.name}.zero_bitmask", node.id)
        # workspace: the forward packs bit k of every byte from one strided comparison at a time (one
        # packed-size temporary, two for hardtanh); the backward unpacks into a bool mask of numel bytes
        _add_mask_pair(b, "bitmask", node, pairs, mask, packed * (2 if hardtanh else 1), numel)


# -- emit (the variant's code, torch imported when it runs) --------------------------------------


def _mask(step: VariantStep) -> dict[int, fx.Node]:
    """Rule `mask` (module docstring). Forward ReLU: `out = relu(x)`, `mask = le(x, 0)` (the same mask as
    `le(out, 0)`, NaNs included, and read while x is live so the step holds what the simulator charges).
    Forward hardtanh: `mask = le(x, min)`, then `logical_or_(mask, ge(x, max))` (one bool temporary,
    the spec's workspace). Backward: `masked_fill(grad, mask, 0.0)` instead of the threshold/hardtanh backward
    (`where(mask, 0.0, grad)` would also allocate the scalar as a 0-dim tensor the simulator does not charge)."""
    from memplan.runtime.variants.ops import VariantError, aten, schema_arg

    target = step.head.target
    if target in (aten.relu.default, aten.hardtanh.default):
        step.copy_group()
        x = step.resolve(step.head.args[0])
        if target is aten.relu.default:
            mask = step.call(aten.le.Scalar, x, 0)
        else:
            mask = step.call(aten.le.Scalar, x, schema_arg(step.head, 1))
            step.call(aten.logical_or_.default, mask, step.call(aten.ge.Scalar, x, schema_arg(step.head, 2)))
        return {step.spec.outputs[-1]: mask}
    if target in (aten.threshold_backward.default, aten.hardtanh_backward.default):
        _check_backward(step)
        mask = _mask_view(step, step.values[_mask_input(step)])
        step.copy_group(lambda: step.call(aten.masked_fill.Scalar, step.resolve(step.head.args[0]), mask, 0.0))
        return {}
    raise VariantError(f"variant 'mask' of node {step.spec.node} ({step.head.name}) runs {target}, which is not "
                       f"ReLU, hardtanh or their backward; the graph's variants do not match its captured program.")


def _mask_input(step: VariantStep) -> int:
    return next(v for v in step.spec.inputs if v >= step.variants.num_graph_values)


def _check_backward(step: VariantStep) -> None:
    """The backward's constants must be the ones its forward's mask was computed with."""
    from memplan.runtime.variants.ops import VariantError, aten, head_node, schema_arg

    head = step.head
    if head.target is aten.threshold_backward.default:
        if schema_arg(head, 2) != 0:
            raise VariantError(f"node {step.spec.node} ({head.name}) runs threshold_backward with threshold "
                               f"{schema_arg(head, 2)}, but the ReLU mask marks out <= 0; run it as the default "
                               f"variant.")
        return
    forward = head_node(step.graph, step.variants.value(step.graph, _mask_input(step)).producer)
    ours, theirs = (schema_arg(head, 2), schema_arg(head, 3)), (schema_arg(forward, 1), schema_arg(forward, 2))
    if ours != theirs:
        raise VariantError(
            f"node {step.spec.node} ({head.name}) runs hardtanh_backward with min/max {ours}, but the mask it reads "
            f"was computed by {forward.name} with min/max {theirs}; the gradient would differ. Run both nodes as "
            f"the default variant.")


def _mask_view(step: VariantStep, mask: fx.Node) -> fx.Node:
    """`mask`, viewed as the backward views the activation it replaces (usually not at all)."""
    program = step.graph.program
    saved = step.head.args[1]
    value = program.value_of[saved]
    base = program.primary[value]

    def rebase(a: fx.Node) -> fx.Node:
        if a is base:
            return mask
        if program.value_of.get(a) == value:
            return step.g.node_copy(a, rebase)
        return step.resolve(a)

    return rebase(saved)


def _bitmask(step: VariantStep) -> dict[int, fx.Node]:
    """Rule `bitmask` (module docstring): rule `mask` with the mask packed 1 bit per element
    (`pack_zero_bits` / `unpack_zero_bits`); the backward then runs the same `masked_fill`."""
    from memplan.runtime.variants.kernels import masked_fill_holding, pack_zero_bits, unpack_zero_bits
    from memplan.runtime.variants.ops import VariantError, aten, head_node, schema_arg

    target = step.head.target
    forward = step.head if target in (aten.relu.default, aten.hardtanh.default) else \
        head_node(step.graph, step.variants.value(step.graph, _mask_input(step)).producer)
    if forward.target not in (aten.relu.default, aten.hardtanh.default):
        raise VariantError(f"variant 'bitmask' of node {step.spec.node} ({step.head.name}) runs {target}, which is "
                           f"not ReLU, hardtanh or their backward; the graph's variants do not match its program.")
    x = forward.args[0].meta["val"]
    order = bit_order(step, forward)
    if step.head is forward:
        step.copy_group()
        low, high = (0, None) if target is aten.relu.default else (schema_arg(forward, 1), schema_arg(forward, 2))
        return {step.spec.outputs[-1]: step.call(pack_zero_bits, step.resolve(forward.args[0]), low, high, order)}
    if target in (aten.threshold_backward.default, aten.hardtanh_backward.default):
        _check_backward(step)
        packed = step.values[_mask_input(step)]
        mask = _mask_view(step, step.call(unpack_zero_bits, packed, list(x.shape), list(x.stride()), order))
        step.copy_group(lambda: step.call(masked_fill_holding, step.resolve(step.head.args[0]), mask, packed))
        return {}
    raise VariantError(f"variant 'bitmask' of node {step.spec.node} ({step.head.name}) runs {target}, which is "
                       f"not the backward of {forward.name}; the graph's variants do not match its program.")


def bit_order(step: VariantStep, forward: fx.Node) -> list[int]:
    """The memory order of the input of ReLU / hardtanh `forward`, in which its bit mask is packed."""
    from memplan.runtime.variants.kernels import dense_order
    from memplan.runtime.variants.ops import VariantError

    x = forward.args[0].meta["val"]
    order = dense_order(list(x.shape), list(x.stride()))
    if order is None:
        raise VariantError(f"node {step.spec.node} ({step.head.name}): the input of {forward.name} has strides "
                           f"{list(x.stride())} with gaps or overlaps, which a bit mask in memory order cannot "
                           f"mirror; run it as the default or `mask` variant.")
    return order


MASK = Rule("mask", offer=_zero_mask, emit=_mask, bit_identical=True)
BITMASK = Rule("bitmask", offer=_zero_bitmask, emit=_bitmask, bit_identical=True)
