"""Rule `math` on the CPU flash attention (`aten._scaled_dot_product_flash_attention_for_cpu`) and its
backward: the math backend, whose forward keeps the attention probabilities (B x H x L x S) instead of
the log-sum-exp and whose backward reads them, not the output. With fewer key/value heads than query
heads (grouped-query or multi-query attention, SDPA's `enable_gqa`), each key/value head serves its group
of query heads as in ATen, without repeating keys and values. Within the validation tolerance.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from memplan.runtime.variants.spec import DTYPE_BYTES, Builder, Rule, VariantSpec, readers

if TYPE_CHECKING:
    from torch import fx

    from memplan.runtime.variants.ops import VariantStep


# -- offer (torch-free: what the variants read, allocate and overwrite) ------------------------------


_ATTENTION = {"aten._scaled_dot_product_flash_attention_for_cpu.default":
              "aten._scaled_dot_product_flash_attention_for_cpu_backward.default"}


def _offer(b: Builder) -> None:
    """Rule `math` (module docstring): attention as softmax(q k^T) v, saving the probabilities."""
    g = b.graph
    read_by = readers(g)
    for node in g.nodes:
        backward_target = _ATTENTION.get(node.targets[0])
        if backward_target is None or node.phase == "backward":
            continue
        out, lse = (g.values[v] for v in node.outputs[:2])
        users = read_by.get(lse.id, [])
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


# -- emit (the variant's code, torch imported when it runs) --------------------------------------


def _emit(step: VariantStep) -> dict[int, fx.Node]:
    """Rule `math` (module docstring): attention by the math backend instead of the fused flash kernel."""
    import operator

    from memplan.runtime.variants.kernels import attention_math_backward, attention_math_forward
    from memplan.runtime.variants.ops import VariantError, aten, schema_arg

    head = step.head
    if schema_arg(head, 3 if "backward" not in head.target.name() else 6) != 0:
        raise VariantError(f"node {step.spec.node} ({head.name}) runs attention with dropout; the math variant "
                           f"would draw another dropout mask. Run it as the default variant.")
    if head.target is aten._scaled_dot_product_flash_attention_for_cpu.default:
        probs_value = step.variants.value(step.graph, step.spec.outputs[-1])
        made = {}

        def forward():
            made["call"] = step.call(attention_math_forward, *(step.resolve(a) for a in head.args[:3]),
                                     schema_arg(head, 4), step.resolve_arg(schema_arg(head, 5)), schema_arg(head, 6),
                                     list(head.meta["val"][0].stride()), list(probs_value.shape))
            return made["call"]
        step.copy_group(forward)
        return {probs_value.id: step.call(operator.getitem, made["call"], 1)}
    if head.target is aten._scaled_dot_product_flash_attention_for_cpu_backward.default:
        probs = step.values[next(v for v in step.spec.inputs if v >= step.variants.num_graph_values)]
        step.copy_group(lambda: step.call(attention_math_backward, *(step.resolve(a) for a in head.args[:4]), probs,
                                          schema_arg(head, 9), [list(t.stride()) for t in head.meta["val"]]))
        return {}
    raise VariantError(f"variant 'math' of node {step.spec.node} ({head.name}) runs {head.target}, which is not "
                       f"the CPU flash attention or its backward; the graph's variants do not match its program.")


MATH = Rule("math", offer=_offer, emit=_emit, bit_identical=False)
