"""Replay a compiled plan as one CUDA graph: `runtime.load(plan, model, loss_fn, cuda_graph=True)`.

A small step on a GPU is launch-bound: the executor runs one ATen kernel per op, and at a few milliseconds
a step the CPU's launches, not the GPU, set its time (docs/measurements/peers-gpu.md). A CUDA graph records the
step's kernels once and replays them with one launch. What changes for the caller, as for any captured code
(torch.cuda.graphs):

- Parameters and buffers must keep their storage between steps (optimizers update them in place). A step
  that finds one moved (`model.to`, `p.data = ...`) captures again.
- The batch is copied into the graph's own input tensors each step; the returned loss is a copy.
- A gradient the step leaves in an empty `p.grad` is the graph's output tensor, which the next replay
  rewrites: keep a copy to hold it across steps. A gradient still in `p.grad` at the next step (gradient
  accumulation) is set aside first, so accumulation is exact.
- The graph's memory pool keeps the step's memory between steps (what eager's caching allocator keeps too).
- Random ops replay the CUDA generator's philox stream as eager draws it. A plan that recomputes a random
  op cannot be captured (it resets the generator, which capture forbids): `ValueError` at the first step.

The first step for a batch shape runs the program once on the capture stream (lazy initialisation, e.g.
of cuBLAS and its workspace, cannot be captured), drops that run's results, restores the generator,
captures (`torch.cuda.graph` first returns the warm-up's cached blocks to the driver) and replays: its
peak is the step's own, plus, in the first capture of the process, the capture stream's cuBLAS workspace.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

from memplan.runtime.execute.grads import accumulate_grad, stealable


_STREAMS: dict[torch.device, torch.cuda.Stream] = {}


def capture_stream(device: torch.device) -> torch.cuda.Stream:
    """The one stream per device that warms up and captures every graph: kernels that take a per-stream
    workspace (cuBLAS) take it once per process, in the first warm-up, as eager's stream took its own."""
    if device not in _STREAMS:
        _STREAMS[device] = torch.cuda.Stream(device)
    return _STREAMS[device]


class GraphedStep:
    """`graphed(batch) -> loss`: one training step of `fn(*params, *buffers, *batch) -> (*new buffer values,
    loss, *gradients)` replayed as a CUDA graph that also writes the new values into `mutated`; gradients
    go to `grad_params` as `accumulate_grad` puts them."""

    def __init__(self, fn: Callable[..., Sequence[torch.Tensor]], params: list[torch.Tensor],
                 buffers: list[torch.Tensor], mutated: list[torch.Tensor], grad_params: list[torch.Tensor]):
        self.fn, self.params, self.buffers, self.mutated, self.grad_params = fn, params, buffers, mutated, grad_params
        self.graph: torch.cuda.CUDAGraph | None = None
        self.captures = 0

    def _storages(self) -> list[int]:
        return [t.data_ptr() for t in (*self.params, *self.buffers)]

    def _capture(self, batch: Sequence[torch.Tensor]) -> None:
        device = self.params[0].device if self.params else batch[0].device
        self.graph = self.loss = self.grads = None  # drop an earlier graph and its outputs before the warm-up
        with torch.cuda.device(device):
            self.inputs = [b.detach().clone() for b in batch]
            args = [*self.params, *self.buffers, *self.inputs]
            rng = torch.cuda.get_rng_state(device)
            stream = capture_stream(device)
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                self.fn(*args)
            torch.cuda.current_stream().wait_stream(stream)
            torch.cuda.set_rng_state(rng, device)
            graph = torch.cuda.CUDAGraph()         # torch.cuda.graph synchronizes and empties the cache first
            with torch.cuda.graph(graph, stream=stream):
                outs = self.fn(*args)
                for buf, new in zip(self.mutated, outs):
                    buf.copy_(new)
            n_mut = len(self.mutated)
            self.loss = outs[n_mut]
            self.grads = [(p, g, stealable(p, g)) for p, g in zip(self.grad_params, outs[n_mut + 1:])]
        self.graph, self.storages = graph, self._storages()
        self.captures += 1

    def __call__(self, batch: Sequence[torch.Tensor]) -> torch.Tensor:
        if self.graph is None or self._storages() != self.storages:
            self._capture(batch)
        for static, b in zip(self.inputs, batch):
            static.copy_(b)
        for p, g, _ in self.grads:
            if p.grad is g:                        # last step's gradient, not yet consumed: accumulate onto it
                p.grad = g.clone()
        self.graph.replay()
        for p, g, steal in self.grads:
            accumulate_grad(p, g, steal)
        return self.loss.clone()
