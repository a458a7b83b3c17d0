"""PeakMeter on CPU: exact byte counts for known allocation patterns, from the dispatch meter and from the
CPU allocator's (`allocator=True`) alike where no kernel makes buffers of its own; only the allocator's
sees buffers made outside the dispatcher."""

import pytest
import torch

from memplan.runtime.measure.meter import PeakMeter

MB = 1 << 20
METERS = pytest.mark.parametrize("allocator", [False, True], ids=["dispatch", "allocator"])


@METERS
def test_tensors_freed_in_the_block_but_allocated_before_it_do_not_count(allocator):
    before = torch.empty(MB, dtype=torch.uint8)
    with PeakMeter(allocator=allocator) as m:
        del before
        x = torch.empty(1000, dtype=torch.uint8)
    assert (m.peak_bytes, m.end_bytes) == (1000, 1000)
    del x


@METERS
def test_peak_counts_live_allocations_only(allocator):
    with PeakMeter(allocator=allocator) as m:
        a = torch.empty(MB, dtype=torch.uint8)
        b = torch.empty(2 * MB, dtype=torch.uint8)
        del a
        c = torch.empty(MB // 4, dtype=torch.float32)       # 1 MiB: reuses a's share of the budget
        del b, c
    assert m.peak_bytes == 3 * MB
    assert m.end_bytes == 0


def test_views_and_in_place_ops_allocate_nothing():
    """(The allocator meter also sees the 0-dim tensors that wrap `1` and `2`: 12 bytes.)"""
    x = torch.zeros(MB // 4)
    with PeakMeter() as m:
        v = x.view(-1, 4).t()
        x.add_(1)
        v.mul_(2)
    assert m.peak_bytes == 0


def test_tensors_allocated_before_the_block_are_not_counted_and_results_are():
    x = torch.randn(256, 256)
    with PeakMeter() as m:
        y = x @ x                                            # 256 KiB result, kept
        z = (y + 1).sum()                                    # a temporary of 256 KiB, then a scalar
    assert m.peak_bytes == 2 * 256 * 1024 + z.element_size()
    assert m.end_bytes == 256 * 1024 + z.element_size()


@METERS
def test_dtype_sizes_are_counted(allocator):
    with PeakMeter(allocator=allocator) as m:
        a = torch.ones(1000, dtype=torch.float64)
        b = torch.ones(1000, dtype=torch.bool)
        c = torch.ones(1000, dtype=torch.float16)
    assert m.peak_bytes == 8000 + 1000 + 2000
    del a, b, c


@METERS
def test_autograd_backward_is_seen(allocator):
    w = torch.randn(512, 512, requires_grad=True)
    x = torch.randn(64, 512)
    with PeakMeter(allocator=allocator) as m:
        (x @ w).relu().sum().backward()
    # w.grad (1 MiB) stays; while it is computed, the 128 KiB gradient of the ReLU input is live
    assert m.end_bytes >= 512 * 512 * 4
    assert m.peak_bytes >= 512 * 512 * 4 + 64 * 512 * 4


def test_unknown_device_is_refused():
    with pytest.raises(ValueError, match="cpu and cuda"):
        with PeakMeter("meta"):
            pass


def test_peak_without_leaves_out_the_storages_of_surviving_tensors():
    with PeakMeter() as m:
        a = torch.empty(1000)                               # 4000 B
        b = torch.empty(2000)                               # 8000 B: 12000 live
        del a                                               # 8000 live
        c = torch.empty(500)                                # 2000 B: 10000 live
    assert m.peak_bytes == 12000
    assert m.peak_without([b]) == 4000                      # a alone, then c alone
    assert m.peak_without([c]) == 12000
    assert m.peak_without([b, c]) == 4000


def test_the_two_meters_agree_on_a_training_step(helpers):
    model, loss_fn, batch = helpers.build("mlp")
    peaks = []
    for allocator in (False, True):
        model.zero_grad(set_to_none=True)
        with PeakMeter(allocator=allocator) as m:
            loss_fn(model, *batch).backward()
        peaks.append((m.peak_bytes, m.end_bytes))
    assert peaks[0] == peaks[1] and peaks[0][0] > 0


def test_only_the_allocator_meter_sees_buffers_made_outside_the_dispatcher():
    """torch.compile's inductor kernels allocate their buffers with `_empty_strided_cpu`, no ATen op."""
    empty = torch._C._dynamo.guards._empty_strided_cpu
    peaks = []
    for allocator in (False, True):
        with PeakMeter(allocator=allocator) as m:
            buffer = empty((MB,), (1,), torch.uint8)
            del buffer
        peaks.append(m.peak_bytes)
    assert peaks == [0, MB]
    with PeakMeter(allocator=True) as m:
        pass
    with pytest.raises(ValueError, match="dispatch meter"):
        m.peak_without([])


def test_the_allocator_meter_refuses_to_nest_in_another_profiler():
    with torch.profiler.profile(), pytest.raises(RuntimeError, match="another profiler session"):
        with PeakMeter(allocator=True):
            pass
