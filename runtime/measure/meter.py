"""Measured peak memory of a block: live tensor bytes allocated inside it.

CPU: a TorchDispatchMode sees every ATen op's results; a result whose storage is not one of the op's
input storages is a new allocation, counted until Python releases the storage (a finalizer on the
storage object, which PyTorch keeps unique per storage). Allocations inside a kernel that do not go
through the dispatcher are not seen, for eager PyTorch and memplan alike.
CUDA: `torch.cuda.max_memory_allocated` minus the bytes allocated when the block starts.
CPU with `allocator=True`: the CPU allocator's allocations and frees during the block, from torch.profiler's
memory events. It also sees buffers that bypass the dispatcher, as torch.compile's inductor kernels
allocate theirs (the dispatch meter saw 25 of 103 MiB of an inductor-compiled GPT-2 step), and kernels'
own small buffers (a wrapped scalar, a reduction's scratch), at the profiler's cost. On GPT-2's eager
step and its `aot_eager_decomp_partition`-compiled step the two agreed to the byte. As with the dispatch
meter, tensors allocated before the block never count: their frees are left out (`_block_deltas`).

A device memory limit (`limit_bytes`, with `resident_bytes` for the tensors alive before the block:
parameters, buffers, batch, optimizer state) makes the block fail as the device would: the CPU dispatch meter
raises `DeviceMemoryExceeded` (a `torch.OutOfMemoryError`) at the op whose result takes the bytes past the
limit, so a step that does not fit can be refused on a CPU; the other meters raise it when the block ends.
"""

from __future__ import annotations

import itertools
import os
import weakref
from collections import Counter
from typing import Iterable, Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class DeviceMemoryExceeded(torch.OutOfMemoryError):
    """A metered block allocated more than the device memory limit allows."""


def _exceeded(live: int, resident: int, limit: int, what: str = "") -> DeviceMemoryExceeded:
    return DeviceMemoryExceeded(
        f"out of device memory{what}: the step's {live:,} B allocated plus {resident:,} B resident (parameters, "
        f"buffers, batch, optimizer state) exceed the device memory limit {limit:,} B by {live + resident - limit:,} B; "
        f"run a plan that needs less memory, a smaller batch, or raise device_memory.")


class _StorageTracker(TorchDispatchMode):
    """Counts the bytes of storages created by ATen ops while the mode is active, and their peak. While
    active it also logs each allocation and release as (allocation number, +bytes / -bytes)."""

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        """Let torch.compile run inside the meter (a plain mode makes it fall back to eager); the compiled
        code's ATen calls at run time are still counted."""
        return True

    def __init__(self, limit_bytes: int | None = None, resident_bytes: int = 0) -> None:
        super().__init__()
        self.limit_bytes = limit_bytes
        self.resident_bytes = resident_bytes
        self.live = 0
        self.peak = 0
        self.active = True
        self.events: list[tuple[int, int]] = []
        self.numbers: dict[int, int] = {}          # storage address -> allocation number, while live

    def _release(self, key: int, number: int, nbytes: int) -> None:
        self.live -= nbytes
        if self.numbers.get(key) == number:
            del self.numbers[key]
        if self.active:
            self.events.append((number, -nbytes))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if self.active:
            seen = {t.untyped_storage()._cdata for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor):
                    storage = t.untyped_storage()
                    if storage._cdata not in seen:
                        seen.add(storage._cdata)
                        nbytes, number = storage.nbytes(), len(self.events)
                        self.live += nbytes
                        self.numbers[storage._cdata] = number
                        self.events.append((number, nbytes))
                        weakref.finalize(storage, self._release, storage._cdata, number, nbytes)
            self.peak = max(self.peak, self.live)
            if self.limit_bytes is not None and self.live + self.resident_bytes > self.limit_bytes:
                self.active = False       # the error unwinds the step; its releases are not this block's
                raise _exceeded(self.live, self.resident_bytes, self.limit_bytes, f" at {func}")
        return out


class PeakMeter:
    """`with PeakMeter(device) as m: ...` then `m.peak_bytes`: the peak of live tensor bytes allocated
    inside the block (tensors alive before it, such as parameters, are not counted). `m.end_bytes` is
    what the block left allocated. On CPU, `m.peak_without(tensors)` is the peak with the storages of
    `tensors` left out (tensors made in the block and still alive, e.g. the parameter gradients: the
    rest is activation memory). `allocator=True` reads the CPU allocator instead (module docstring).
    `limit_bytes`: the device memory limit, which the block's peak plus `resident_bytes` may not exceed
    (module docstring)."""

    def __init__(self, device: str | torch.device = "cpu", *, allocator: bool = False,
                 limit_bytes: int | None = None, resident_bytes: int = 0):
        if limit_bytes is not None and limit_bytes < resident_bytes:
            raise _exceeded(0, resident_bytes, limit_bytes, " before the step")
        self.device = torch.device(device)
        self.allocator = allocator
        self.limit_bytes = limit_bytes
        self.resident_bytes = resident_bytes
        self.peak_bytes = 0
        self.end_bytes = 0
        self._tracker: _StorageTracker | None = None
        self._profile: torch.profiler.profile | None = None
        self._start = 0

    def __enter__(self) -> "PeakMeter":
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self._start = torch.cuda.memory_allocated(self.device)
        elif self.device.type == "cpu" and self.allocator:
            if torch.autograd.profiler._is_profiler_enabled:
                raise RuntimeError("PeakMeter(allocator=True) reads the CPU allocator through a torch.profiler "
                                   "session of its own, and another profiler session is running: ending the "
                                   "inner one would end both. Measure outside that profiler, or with the "
                                   "dispatch meter (allocator=False), which does not see kernels' own scratch.")
            os.environ.setdefault("KINETO_LOG_LEVEL", "6")    # no kineto lines on stderr per block
            self._profile = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                                   profile_memory=True)
            self._profile.__enter__()
        elif self.device.type == "cpu":
            self._tracker = _StorageTracker(self.limit_bytes, self.resident_bytes)
            self._tracker.__enter__()
        else:
            raise ValueError(f"PeakMeter supports cpu and cuda devices, not {self.device}.")
        return self

    def peak_without(self, tensors) -> int:
        """The block's peak without the storages of `tensors` (CPU only; module docstring)."""
        if self._tracker is None:
            raise ValueError(f"peak_without needs the CPU dispatch meter, not {self.device}"
                             f"{' with allocator=True' if self.allocator else ''}.")
        left_out = {self._tracker.numbers.get(t.untyped_storage()._cdata) for t in tensors}
        live = peak = 0
        for number, delta in self._tracker.events:
            if number not in left_out:
                live += delta
                peak = max(peak, live)
        return peak

    def __exit__(self, *exc) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.peak_bytes = torch.cuda.max_memory_allocated(self.device) - self._start
            self.end_bytes = torch.cuda.memory_allocated(self.device) - self._start
        elif self._profile is not None:
            self._profile.__exit__(*exc)
            memory = [e for e in self._profile.profiler.kineto_results.events() if e.name() == "[memory]"]
            deltas = _block_deltas(e.nbytes() for e in sorted(memory, key=lambda e: e.start_ns()))
            live = list(itertools.accumulate(deltas, initial=0))
            self.peak_bytes, self.end_bytes = max(live), live[-1]
        else:
            self._tracker.__exit__(*exc)
            self._tracker.active = False
            self.peak_bytes = self._tracker.peak
            self.end_bytes = self._tracker.live
        if exc[0] is None and self.limit_bytes is not None and self.peak_bytes + self.resident_bytes > self.limit_bytes:
            raise _exceeded(self.peak_bytes, self.resident_bytes, self.limit_bytes, f" on {self.device}")


def _block_deltas(deltas: Iterable[int]) -> Iterator[int]:
    """The allocator's +bytes / -bytes events of a block without the frees of storages allocated before it:
    a free is the block's own only while an allocation of that size made in the block is live (the profiler
    usually leaves such frees out, but not always, e.g. after an earlier profiling session in the process)."""
    live: Counter[int] = Counter()
    for delta in deltas:
        if delta >= 0:
            live[delta] += 1
            yield delta
        elif live[-delta] > 0:
            live[-delta] -= 1
            yield delta
