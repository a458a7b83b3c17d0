"""Implementation variants of operator nodes: which ones a graph offers, what each reads and allocates.

Torch-free: planners and the plan checker see variants as data (`runtime.variants.spec`). Each rule is
one module of `runtime.variants.rules` (registry `RULES`): what its variants read and allocate, and the code
the executor emits for them (`runtime.variants.ops.emit_variant`; kernels in `runtime.variants.kernels`).

A node's **default** variant is the captured ATen op (the node as the graph lists it). A non-default
variant computes the same values the node's readers need, but may read other values, allocate extra
values and need another workspace (MONeT, Gupta et al. 2021: an operator's implementations differ in
what the backward keeps, D_k^l, and in workspace and time). Values that only variants allocate are
**variant values**: ids `len(graph.values)`, `len(graph.values) + 1`, ... in the order `graph_variants`
lists them, a pure function of the graph, so plans name them by id like any other value.

Rules shipped: `mask` and `bitmask` (ReLU / hardtanh backward from a zero mask), `output` (normalization
backward from its output), `compact` (max-pool window positions), `math` (attention saving its
probabilities), `inplace` (ReLU into its input's storage), `sigmoid` (tanh by its sigmoid identity),
`native` (a convolution's weight gradient by ATen's native CPU kernel instead of oneDNN's); each module's
docstring says how it works and how exact it is.

A convolution's backward split into weight- and input-gradient nodes (MONeT appendix D) is not a variant:
`runtime.capture` always splits it (docs/plan-format.md).
"""

from __future__ import annotations

from memplan.runtime.format.graph import OpGraph
from memplan.runtime.variants.rules import RULES
from memplan.runtime.variants.spec import DEFAULT, Builder, GraphVariants, VariantSpec

__all__ = ["BIT_IDENTICAL_RULES", "DEFAULT", "GraphVariants", "RULES", "VariantSpec", "graph_variants"]

BIT_IDENTICAL_RULES = tuple(name for name, rule in RULES.items() if rule.bit_identical)
"""The rules whose code gives ATen's bits: a plan using only these trains exactly like eager."""


def graph_variants(graph: OpGraph, rules: tuple[str, ...] | None = None) -> GraphVariants:
    """The variants `graph` offers under `rules` (default: every rule in `RULES`). Every rule runs, in
    registry order, and the specs of those not chosen are dropped, so variant value ids do not depend on
    `rules`: a plan made with some rules names the values that `graph_variants(graph)` (the executor's,
    the plan checker's) numbers alike. A dropped rule's values stay listed, allocated by no variant."""
    unknown = [name for name in rules or () if name not in RULES]
    if unknown:
        raise KeyError(f"unknown variant rule {unknown[0]!r}; known rules: {', '.join(RULES)}.")
    b = Builder(graph)
    for name, rule in RULES.items():
        kept = {node: dict(specs) for node, specs in b.specs.items()}
        rule.offer(b)
        if rules is not None and name not in rules:
            b.specs = kept
    return GraphVariants(len(graph.values), tuple(b.values), b.specs)
