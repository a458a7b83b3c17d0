"""Rule `inplace` on a forward ReLU (`aten.relu`) whose input is an activation read by nothing else in the
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
In-place copies get no arena address (refused; `runtime.execute.arena` runs the step as a fallback).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from memplan.runtime.variants.spec import Builder, Rule, VariantSpec, readers

if TYPE_CHECKING:
    from torch import fx

    from memplan.runtime.variants.ops import VariantStep


# -- offer (torch-free: what the variants read, allocate and overwrite) ------------------------------


def _offer(b: Builder) -> None:
    """Rule `inplace` (module docstring): ReLU forward into its input's storage, alone or with the mask /
    bitmask of rules `mask` / `bitmask` (which must run first to offer those combinations)."""
    g = b.graph
    read_by = readers(g)
    outputs = set(g.outputs)
    for node in g.nodes:
        if node.phase == "backward" or node.targets[0] != "aten.relu.default" or len(node.outputs) != 1 \
                or len(set(node.inputs)) != 1:
            continue
        (x,), out = tuple(dict.fromkeys(node.inputs)), node.outputs[0]
        if g.values[x].kind != "activation" or read_by.get(x) != [node.id] or x in outputs \
                or g.values[x].bytes != g.values[out].bytes:
            continue
        b.add(VariantSpec(node.id, "inplace", "inplace", (x,), (out,), 0, ((out, x),)))
        for rule in ("mask", "bitmask"):
            spec = b.specs.get(node.id, {}).get(rule)
            if spec is not None:
                b.add(VariantSpec(node.id, f"{rule}-inplace", "inplace", (x,), spec.outputs, spec.workspace,
                                  ((out, x),)))


# -- emit (the variant's code, torch imported when it runs) --------------------------------------


def _emit(step: VariantStep) -> dict[int, fx.Node]:
    """Rule `inplace` (module docstring): `relu_(x)` in place of `relu(x)`; `mask-inplace` / `bitmask-inplace`
    first compute the mask of rule `mask` (`le(x, 0)`) / `bitmask` (`pack_zero_bits`) from x, so the step holds
    x (then the output in its storage) and the mask, as the simulator charges."""
    from memplan.runtime.variants.kernels import pack_zero_bits
    from memplan.runtime.variants.ops import VariantError, aten
    from memplan.runtime.variants.rules.zero_mask import bit_order

    head, spec = step.head, step.spec
    if head.target is not aten.relu.default:
        raise VariantError(f"variant {spec.name!r} of node {spec.node} ({head.name}) runs {head.target}, which is "
                           f"not ReLU; the graph's variants do not match its captured program.")
    x = step.resolve(head.args[0])
    made = {}
    masks = {s.outputs[-1]: s.rule for s in step.variants.specs[spec.node].values() if s.rule in ("mask", "bitmask")}
    for v in spec.outputs[1:]:
        if masks.get(v) == "mask":
            made[v] = step.call(aten.le.Scalar, x, 0)
        elif masks.get(v) == "bitmask":
            made[v] = step.call(pack_zero_bits, x, 0, None, bit_order(step, head))
        else:
            raise VariantError(f"variant {spec.name!r} of node {spec.node} ({head.name}) allocates value {v}, which "
                               f"is neither its `mask` nor its `bitmask`; the graph's variants do not match.")
    step.copy_group(lambda: step.call(aten.relu_.default, x))
    return made


INPLACE = Rule("inplace", offer=_offer, emit=_emit, bit_identical=True)
