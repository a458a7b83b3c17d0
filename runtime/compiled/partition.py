"""A partitioner for inductor that recomputes the forward nodes a decision names (the compiled form)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from torch import fx
from torch._functorch.partitioners import _size_of, min_cut_rematerialization_partition
from torch._inductor.custom_graph_pass import CustomPartitionerFn
from torch.utils.checkpoint import CheckpointPolicy

from memplan.runtime.compiled.joint import read_joint
from memplan.runtime.compiled.records import Decision, JointGraph

Decide = Callable[[JointGraph], Decision]
"""Given a joint graph, what its compiled step recomputes and saves."""


@dataclass(frozen=True)
class Partitioned:
    """What one joint graph was cut into: the graph, the decision it was cut by, and what the forward saves for
    the backward: FX node names, the joint graph's values they are or alias, and their bytes (parameters and
    inputs included)."""

    joint: JointGraph
    decision: Decision
    saved: tuple[str, ...]
    saved_values: frozenset[int]
    saved_bytes: int

    @property
    def fingerprint(self) -> str:
        return self.joint.fingerprint

    @property
    def recomputed(self) -> frozenset[str]:
        """The forward nodes tagged for recomputation."""
        return self.decision.recompute


@dataclass
class DecidingPartitioner(CustomPartitionerFn):
    """`torch._inductor.config.custom_partitioner_fn`: tags the forward nodes `decide` names `MUST_RECOMPUTE` or
    `MUST_SAVE` and runs the min-cut partitioner, which keeps what the backward needs of the rest as cheaply as it
    can (a node tagged for recomputation is never saved, one tagged to save never recomputed; untagged ones, e.g.
    fusible pointwise ops, it may recompute). Each cut is recorded in `partitioned`, one per compiled region in
    compile order."""

    decide: Decide
    partitioned: list[Partitioned] = field(default_factory=list)

    def __call__(self, gm: fx.GraphModule, joint_inputs, **kwargs):
        joint, values = read_joint(gm.graph)
        decision = self.decide(joint)
        forward = {n.name: n for n in gm.graph.nodes if n.meta.get("partitioner_tag") == "is_forward"}
        unknown = sorted((decision.recompute | decision.save) - forward.keys())
        if unknown or decision.recompute & decision.save:
            raise ValueError(f"the compiled form was asked to recompute or save {unknown[:5]}, which are not forward "
                             f"nodes of this joint graph (fingerprint {joint.fingerprint[:12]}), or to do both to "
                             f"{sorted(decision.recompute & decision.save)[:5]}; plan for this graph again.")
        for names, policy in ((decision.recompute, CheckpointPolicy.MUST_RECOMPUTE),
                              (decision.save, CheckpointPolicy.MUST_SAVE)):
            for name in names:
                forward[name].meta["recompute"] = policy
        fw, bw = min_cut_rematerialization_partition(gm, joint_inputs, **kwargs)
        outputs = next(n for n in fw.graph.nodes if n.op == "output").args[0]
        saved = [a for a in outputs[kwargs["num_fwd_outputs"]:] if isinstance(a, fx.Node)]
        self.partitioned.append(Partitioned(joint, decision, tuple(a.name for a in saved),
                                            frozenset(v for a in saved for v in values.get(a.name, ())),
                                            sum(_size_of(a) for a in saved)))
        return fw, bw

    def uuid(self) -> None:
        """None: no compiled graph is cached, so each compile partitions again with this decision."""
        return None
