"""The device memory limit of `pipeline.toml` (`device_memory`, `optimizer`) as bytes: what a training step
may allocate once the resident tensors (parameters, buffers, batch, optimizer state) are counted.

A step fits when `resident + step peak <= limit_bytes`, the step peak counting everything the step allocates
(activations, gradients, temporaries): `runtime.measure.meter.PeakMeter(limit_bytes=..., resident_bytes=...)` raises
`runtime.measure.meter.DeviceMemoryExceeded` past it.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

from memplan.runtime.format.graph import OpGraph
from memplan.tasks.config import MemplanError, PipelineConfig
from memplan.tasks.solve.core.optimizer import OPTIMIZERS


class MemoryLimit(BaseModel):
    """A device memory limit in bytes, the optimizer whose state shares it, and whether a plan may be validated
    against eager's step on the host CPU without it when no reference fits it (tasks/fit/reference.py)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    limit_bytes: int
    optimizer: str = "sgd"
    host_reference: bool = True

    @property
    def states_per_parameter(self) -> int:
        """Tensors of optimizer state kept per parameter (`tasks.solve.core.optimizer.OPTIMIZERS`)."""
        return OPTIMIZERS[self.optimizer].state

    def resident_bytes(self, constant_bytes: int, parameter_bytes: int) -> int:
        """Bytes held through the step: the graph inputs (parameters, buffers, batch) and optimizer state."""
        return constant_bytes + self.states_per_parameter * parameter_bytes

    def graph_resident_bytes(self, graph: OpGraph) -> int:
        """`resident_bytes` of a captured step."""
        return self.resident_bytes(graph.constant_bytes, sum(v.bytes for v in graph.values if v.kind == "param"))

    def module_resident_bytes(self, model, batch) -> int:
        """`resident_bytes` of a model (its parameters and buffers) and a batch of tensors."""
        params = sum(p.numel() * p.element_size() for p in model.parameters())
        buffers = sum(b.numel() * b.element_size() for b in model.buffers())
        inputs = sum(t.numel() * t.element_size() for t in batch)
        return self.resident_bytes(params + buffers + inputs, params)


def memory_limit(config: PipelineConfig, device: str) -> MemoryLimit | None:
    """The limit `config` sets on `device` (a resolved device: `cpu`, `cuda:N`), None without `device_memory`;
    `device_memory = "device"` reads the GPU's free memory now."""
    setting = config.device_memory
    if setting is None:
        return None
    if setting == "device":
        if not device.startswith("cuda"):
            raise MemplanError(
                f"device_memory = \"device\" in pipeline.toml reads the GPU's free memory (torch.cuda.mem_get_info), "
                f"but this run is on {device}; give the memory as a size instead, e.g. device_memory = \"16 GiB\", "
                f"or run on a GPU.")
        import torch

        setting, _ = torch.cuda.mem_get_info(device)
    return MemoryLimit(limit_bytes=int(setting), optimizer=config.optimizer,
                       host_reference=config.validation.host_reference)


def check_resident_fits(config: PipelineConfig, limit: MemoryLimit | None) -> None:
    """Refuse, before any stage runs, a limit below what a model at one of its batch sizes keeps resident before
    its step allocates anything (parameters, buffers, batch, optimizer state): no plan can fit there. The models
    are built on the meta device (no memory, no weights)."""
    if limit is None:
        return
    import torch

    from memplan.tasks.models import build_model

    for spec, batch_size in config.model_batches():
        with torch.device("meta"):
            model = build_model(spec, config.seed)
        batch = [torch.empty((batch_size, *i.shape), dtype=getattr(torch, i.dtype), device="meta")
                 for i in spec.inputs]
        resident = limit.module_resident_bytes(model, batch)
        if resident > limit.limit_bytes:
            raise MemplanError(
                f"device_memory = {limit.limit_bytes:,} B is less than model {spec.name!r} at batch {batch_size} "
                f"keeps resident before its step allocates anything: {resident:,} B (parameters, buffers, the batch "
                f"and the optimizer's state: {limit.optimizer}, {limit.states_per_parameter} tensors per parameter), "
                f"so no plan fits; raise "
                f"device_memory above {resident:,} B plus the step's own peak, or lower batch_sizes.")
