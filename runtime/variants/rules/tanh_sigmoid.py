"""Rule `sigmoid` on `aten.tanh` and on memplan's fused tanh-GELU (`memplan.gelu_tanh_inner`,
runtime/tracing/fused_gelu.py): the same tanh computed as `2 sigmoid(2 z) - 1`, which ATen's CPU kernels run
about 2.4x faster than its tanh (whether it is faster on a device is the profile's to say). Same
inputs, outputs and bytes; a variant of time only (MONeT's operator implementations differ in time as in
memory). Within the validation tolerance (2.5e-7 of the tanh), not bit-identical.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from memplan.runtime.variants.spec import Builder, Rule, VariantSpec

if TYPE_CHECKING:
    from torch import fx

    from memplan.runtime.variants.ops import VariantStep


# -- offer (torch-free: what the variants read, allocate and overwrite) ------------------------------


def _offer(b: Builder) -> None:
    """Rule `sigmoid` (module docstring): a tanh by its sigmoid identity."""
    for node in b.graph.nodes:
        if node.targets[0] in ("aten.tanh.default", "memplan.gelu_tanh_inner.default"):
            b.add(VariantSpec(node.id, "sigmoid", "sigmoid", tuple(dict.fromkeys(node.inputs)), tuple(node.outputs)))


# -- emit (the variant's code, torch imported when it runs) --------------------------------------


def _emit(step: VariantStep) -> dict[int, fx.Node]:
    """Rule `sigmoid` (module docstring): a tanh, or the fused GELU's, as `2 sigmoid(2 z) - 1`."""
    import torch
    from torch import fx

    from memplan.runtime.tracing.fused_gelu import gelu_tanh_inner_by_sigmoid, tanh_by_sigmoid
    from memplan.runtime.variants.ops import VariantError, aten

    head = step.head
    code = {aten.tanh.default: tanh_by_sigmoid,
            torch.ops.memplan.gelu_tanh_inner.default: gelu_tanh_inner_by_sigmoid}.get(head.target)
    if code is None:
        raise VariantError(f"variant 'sigmoid' of node {step.spec.node} ({head.name}) runs {head.target}, which is "
                           f"neither aten.tanh nor memplan's fused GELU tanh; the graph's variants do not match its "
                           f"program.")
    step.copy_group(lambda: step.call(code, *fx.node.map_arg(head.args, step.resolve)))
    return {}


SIGMOID = Rule("sigmoid", offer=_offer, emit=_emit, bit_identical=False)
