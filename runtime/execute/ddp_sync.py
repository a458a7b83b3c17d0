"""The executor under DistributedDataParallel: the gradient all-reduce DDP's reducer would do, run by the plan.

The executor computes the gradients in its own program, so DDP's autograd hooks never fire. `GradientSync`
takes their place for a `DistributedDataParallel`-wrapped model: the program calls `launch(*gradients)` right
after the schedule step where a bucket's last gradient becomes final (`runtime.format.schedule.gradient_buckets`:
buckets of at most DDP's `bucket_bytes_cap`, in the order the planned backward finishes the gradients), which
copies them into one flat buffer and starts its all-reduce (`dist.all_reduce(..., async_op=True)` on DDP's
`process_group`), and `finish(work, *gradients)` at the end of the step waits, divides by the group's size
(DDP's average) and copies the result back. Communication overlaps the rest of the planned backward, as with
DDP. Parameters DDP ignores (`parameters_to_ignore`) are not reduced; a parameter with no gradient in the
captured graph (unused: the same graph on every rank) is skipped on every rank and its `.grad` is left as it
was. Inside `ddp.no_sync()` nothing is reduced (gradient accumulation), as with DDP. With
`broadcast_buffers` (DDP's default), rank 0's buffers are broadcast before each step, as DDP's forward does.
Before its first step the executor has the ranks confirm they hold the same plan (`check_plan`): buckets
follow the planned backward, so ranks with different plans could all-reduce buffers of different sizes.
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from memplan.runtime.format.graph import OpGraph
from memplan.runtime.format.jsonio import sha256_hex
from memplan.runtime.format.plan import Plan, PlanError
from memplan.runtime.format.schedule import gradient_buckets
from memplan.runtime.variants.offered import GraphVariants


class GradientSync:
    """DDP's gradient all-reduce and buffer broadcast for the executor (module docstring)."""

    def __init__(self, ddp: DistributedDataParallel):
        if getattr(ddp, "_comm_hooks", None) or getattr(ddp, "_delay_all_reduce_params", None):
            raise ValueError("runtime.load runs DistributedDataParallel's all-reduce itself (the executor bypasses "
                             "autograd, so DDP's reducer never fires), and this DDP object has a communication hook "
                             "(register_comm_hook) or delayed all-reduce parameters, which it does not run. Wrap the "
                             "model in DDP without them, or train in the policy form (runtime.apply), which keeps "
                             "DDP's reducer.")
        self.ddp = ddp
        self.group = ddp.process_group
        self.cap_bytes = int(ddp.bucket_bytes_cap)
        self.ignored = frozenset(ddp.parameters_to_ignore)

    def reduce_points(self, graph: OpGraph, plan: Plan, variants: GraphVariants,
                      names: Sequence[str]) -> dict[int, list[tuple[int, ...]]]:
        """Schedule step -> the gradient output indices of each bucket launched right after it. Gradient output
        j is value `graph.outputs[1 + j]`, of the parameter named `names[j]`; ignored parameters are left out."""
        io = [None if "compute" not in step else _Step(*variants.io(graph, step["compute"], step.get("impl")))
              for step in plan.schedule]
        reduced = [j for j, name in enumerate(names) if name not in self.ignored]
        grads = [graph.outputs[1 + j] for j in reduced]
        dtypes = {graph.values[g].dtype for g in grads}
        if len(dtypes) > 1:
            raise ValueError(f"the executor under DistributedDataParallel all-reduces gradients in flat buckets of one "
                             f"dtype, and this model's gradients have dtypes {sorted(map(str, dtypes))}. Cast the "
                             f"model to one dtype, list the others in DDP's parameters_to_ignore, or train in the "
                             f"policy form (runtime.apply).")
        nbytes = [graph.values[g].bytes for g in grads]
        points: dict[int, list[tuple[int, ...]]] = {}
        for bucket in gradient_buckets(io, grads, nbytes, self.cap_bytes):
            points.setdefault(bucket.step, []).append(tuple(reduced[k] for k in bucket.members))
        return points

    def check_plan(self, plan: Plan) -> None:
        """Refuse, on every rank, unless every rank of the group holds the same plan (`plan_digest`); one
        small all-gather, before any other collective of the step."""
        digests: list[str | None] = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(digests, plan_digest(plan), group=self.group)
        if len(set(digests)) > 1:
            ranks = ", ".join(f"rank {r}: {d}" for r, d in enumerate(digests))
            raise PlanError(f"the ranks hold different plans ({ranks}; digests of each plan's graph fingerprint and "
                            f"schedule), and each rank's all-reduces follow its own plan: load the same plan file "
                            f"on every rank.")

    def broadcast_buffers(self) -> None:
        """Rank 0's buffers to every rank, before the step (DDP's `broadcast_buffers`)."""
        if not self.ddp.broadcast_buffers or not self.ddp.require_forward_param_sync:
            return
        for name, buf in self.ddp.module.named_buffers():
            if name not in self.ignored:
                dist.broadcast(buf, src=dist.get_global_rank(self.group, 0), group=self.group)

    def launch(self, *grads: torch.Tensor) -> tuple[torch.Tensor, dist.Work] | None:
        """Copy `grads` into one flat buffer and start its all-reduce; None inside `ddp.no_sync()`."""
        if not self.ddp.require_backward_grad_sync:
            return None
        flat = torch.empty(sum(g.numel() for g in grads), dtype=grads[0].dtype, device=grads[0].device)
        offset = 0
        for g in grads:
            flat[offset:offset + g.numel()].view_as(g).copy_(g)
            offset += g.numel()
        return flat, dist.all_reduce(flat, group=self.group, async_op=True)

    def finish(self, launched: tuple[torch.Tensor, dist.Work] | None, *grads: torch.Tensor) -> None:
        """Wait for a bucket's all-reduce and write the average over the group back into `grads`."""
        if launched is None:
            return
        flat, work = launched
        work.wait()
        flat.div_(dist.get_world_size(self.group))
        offset = 0
        for g in grads:
            g.copy_(flat[offset:offset + g.numel()].view_as(g))
            offset += g.numel()


def plan_digest(plan: Plan) -> str:
    """12 hex digits of the SHA-256 of what the step runs of `plan`: its graph fingerprint and schedule."""
    return sha256_hex({"fingerprint": plan.fingerprint, "schedule": plan.schedule})[:12]


class _Step(NamedTuple):
    inputs: Sequence[int]
    outputs: Sequence[int]
