"""The implementation variant rules, one module each (its docstring says what the variant does, its
`offer` what it reads and allocates, its `emit` the code that runs it). A new variant is one module and
one line below.

The registry's order numbers the variant values (`runtime.variants.offered.graph_variants`): a new rule goes
last, so plans written before it keep their value ids. `inplace` reads the specs of `mask` and
`bitmask`, so it comes after them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Mapping

from memplan.runtime.variants.rules.attention_math import MATH
from memplan.runtime.variants.rules.conv_native import NATIVE
from memplan.runtime.variants.rules.norm_output import OUTPUT
from memplan.runtime.variants.rules.pool_compact import COMPACT
from memplan.runtime.variants.rules.relu_inplace import INPLACE
from memplan.runtime.variants.rules.tanh_sigmoid import SIGMOID
from memplan.runtime.variants.rules.zero_mask import BITMASK, MASK
from memplan.runtime.variants.spec import GraphVariants, Rule, VariantSpec

if TYPE_CHECKING:
    from torch import fx

    from memplan.runtime.format.graph import OpGraph

RULES: dict[str, Rule] = {rule.name: rule for rule in (MASK, OUTPUT, COMPACT, MATH, BITMASK, INPLACE, SIGMOID,
                                                          NATIVE)}


def emit_variant(g: fx.Graph, graph: OpGraph, variants: GraphVariants, spec: VariantSpec,
                 env: dict[fx.Node, fx.Node], resolve: Callable[[fx.Node], fx.Node],
                 values: Mapping[int, fx.Node]) -> dict[int, fx.Node]:
    """Emit node `spec.node` run as variant `spec` inside the FX graph `g` being built: the rule's `emit`
    copies or replaces the FX nodes of the node's captured group, filling `env` (captured FX node -> its
    copy), so later readers find the node's graph values as for a default step; returns the FX nodes of
    the variant values it allocates, by value id. The executor and `runtime.tracing.node_functions` share it."""
    from memplan.runtime.variants.ops import VariantError, VariantStep

    rule = RULES.get(spec.rule)
    if rule is None:
        raise VariantError(f"node {spec.node} ({graph.nodes[spec.node].name}) runs variant {spec.name!r} of rule "
                           f"{spec.rule!r}, which this runtime has no code for (known: {', '.join(RULES)}). "
                           f"Update memplan or plan without that variant.")
    return rule.emit(VariantStep(g, graph, variants, spec, env, resolve, values))
