"""Rule `native` on a convolution's weight gradient (`aten.convolution_backward` with output mask
`[False, True, bias]`, the weight-gradient node `runtime.capture` splits off): the same call with oneDNN
disabled (`torch.backends.mkldnn`'s flag, set for this call only), so that ATen's CPU backend runs its
native kernel (im2col of the whole batch, then one matrix product) where it would run oneDNN's. Same inputs,
outputs and bytes; the workspace and time differ: on resnet18's last stage (batch 8, 1 thread) oneDNN holds
about 9 MiB of scratch beside a 9 MiB gradient, the native kernel its 0.56 MiB im2col buffer. The im2col
buffer grows with the image (`N x C x kh x kw x H_out x W_out` elements), so the profile's measured time and
workspace decide where it pays (tasks/solve/core/fixed_variants.py `lean_choice`: where it needs less workspace;
the solver prices its time).
Another summation order than oneDNN's: within the validation tolerance, not bit-identical. Where ATen
does not use oneDNN for the shape (float64, a 1x1 kernel below 16 images on one thread) or on CUDA (the
flag steers CPU kernels only) it runs the default's kernel and is exact (the profile's `exact` column).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from memplan.runtime.variants.spec import Builder, Rule, VariantSpec

if TYPE_CHECKING:
    from torch import fx

    from memplan.runtime.variants.ops import VariantStep

_WEIGHT_GRADIENT = "aten.convolution_backward.default"


# -- offer (torch-free: what the variants read, allocate and overwrite) ------------------------------


def _offer(b: Builder) -> None:
    """Rule `native` (module docstring): a weight-gradient convolution backward by ATen's native kernel. The
    split node allocates the weight gradient (and the bias gradient), never a value of the input's shape."""
    g = b.graph
    for node in g.nodes:
        if node.targets[0] != _WEIGHT_GRADIENT or node.phase != "backward" or len(node.inputs) < 3:
            continue
        x, weight = (g.values[v].shape for v in node.inputs[1:3])
        shapes = [g.values[v].shape for v in node.outputs]
        if shapes and shapes[0] == weight and x not in shapes:
            b.add(VariantSpec(node.id, "native", "native", tuple(dict.fromkeys(node.inputs)), tuple(node.outputs)))


# -- emit (the variant's code, torch imported when it runs) --------------------------------------


def _emit(step: VariantStep) -> dict[int, fx.Node]:
    """Rule `native` (module docstring): the captured weight-gradient call with oneDNN off."""
    from memplan.runtime.variants.kernels import convolution_backward_native
    from memplan.runtime.variants.ops import VariantError, aten, schema_arg

    head = step.head
    if head.target is not aten.convolution_backward.default or schema_arg(head, 10)[0]:
        raise VariantError(f"variant 'native' of node {step.spec.node} ({head.name}) runs {head.target} with output "
                           f"mask {schema_arg(head, 10) if head.target is aten.convolution_backward.default else '?'}; "
                           f"it replaces only a weight-gradient convolution backward (mask [False, True, bias]). "
                           f"The graph's variants do not match its program.")
    args = [step.resolve_arg(schema_arg(head, i)) for i in range(len(head.target._schema.arguments))]
    step.copy_group(lambda: step.call(convolution_backward_native, *args))
    return {}


NATIVE = Rule("native", offer=_offer, emit=_emit, bit_identical=False)
