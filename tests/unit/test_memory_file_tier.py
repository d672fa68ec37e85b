"""The file tier on its own: bytes come back exactly, regions are reused, the background writer is
bounded, and a tensor the backward needs before it was written is handed back as it is."""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

import mmpipe.memory.tiers as policy
from mmpipe.memory.tiers import FileTier, Tier


def _tensors() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(6, 5, 4, generator=gen)
    return [
        x,
        x.transpose(0, 2),  # not contiguous, dense: goes out as it is
        x.transpose(0, 2)[..., 1:],  # dense, from an offset into its storage
        x[2:],  # contiguous, from an offset
        x[:, 1],  # a strided view: gathered
        x[:1].expand(3, 5, 4),  # an expanded one: gathered
        torch.randn((), generator=gen, dtype=torch.float64),  # 0-dim
        torch.empty(0, 3),
        torch.randint(-100, 100, (7, 3), generator=gen, dtype=torch.int64),
        torch.randn(33, generator=gen).to(torch.bfloat16),
        torch.rand(5, generator=gen) > 0.5,
    ]


def test_every_tensor_comes_back_bitwise_and_the_file_is_gone(tmp_path: Path) -> None:
    tier = FileTier(tmp_path)
    assert not list(tmp_path.iterdir())  # the spill file is unlinked as soon as it is open
    tensors = _tensors()
    handles = [tier.pack(t) for t in tensors]
    tier.flush()
    assert tier.stats.unwritten_bytes == 0 and all(h.data is None for h in handles)  # memory released
    check_round_trip(tier, tensors, handles)


def check_round_trip(tier: Tier, tensors: list[torch.Tensor], handles: list[Any]) -> None:
    """Every handle unpacks to its tensor, bitwise and (when dense) in its layout, not the tensor
    itself; once the handles are gone nothing is out; a closed tier packs nothing."""
    for t, h in zip(tensors, handles, strict=True):
        got = tier.unpack(h)
        assert got.shape == t.shape and got.dtype == t.dtype and torch.equal(got, t)
        assert got.data_ptr() != t.data_ptr() or t.numel() == 0  # a copy, not the saved tensor
        if policy._is_dense(t):  # the layout the op saved comes back (its backward may rely on it)
            assert got.stride() == t.stride()
        else:
            assert got.is_contiguous()
    assert tier.stats.returned_bytes == tier.stats.offloaded_bytes == sum(t.numel() * t.element_size() for t in tensors)
    handles.clear()
    del got, h
    assert tier.stats.out_bytes == 0
    tier.close()
    with pytest.raises(RuntimeError, match="closed"):
        tier.pack(torch.ones(3))


def test_regions_are_reused_so_the_file_does_not_grow_step_after_step() -> None:
    tier = FileTier()
    sizes = []
    for step in range(4):
        saved = [tier.pack(torch.full((1024 + 256 * i,), float(step))) for i in range(5)]
        tier.flush()
        assert all(torch.equal(tier.unpack(h), torch.full((1024 + 256 * i,), float(step))) for i, h in enumerate(saved))
        sizes.append(os.fstat(tier._fd).st_size)  # type: ignore[arg-type]
        del saved
    assert sizes[0] > 0 and len(set(sizes)) == 1, sizes
    # regions of freed tensors serve later ones of the same size while others are still out
    a, b = tier.pack(torch.ones(1000)), tier.pack(torch.ones(1000))
    offset = a.region.offset
    tier.flush()  # (the writer holds a handle until it is written)
    del a
    c = tier.pack(torch.zeros(1000))
    assert c.region.offset == offset and b.region.offset != offset
    tier.flush()
    assert torch.equal(tier.unpack(b), torch.ones(1000)) and torch.equal(tier.unpack(c), torch.zeros(1000))
    tier.close()


def test_a_tensor_read_back_keeps_its_region_until_it_dies() -> None:
    """Read back tensors map the file: a later tensor must not be written over one still in use."""
    tier = FileTier()
    h = tier.pack(torch.full((2048,), 1.0))
    tier.flush()
    got = tier.unpack(h)
    taken = h.region.offset
    del h  # autograd is done with the handle; the tensor lives on (e.g. a gradient aliases it)
    later = tier.pack(torch.full((2048,), 2.0))
    tier.flush()
    assert later.region.offset != taken and torch.equal(got, torch.full((2048,), 1.0))
    got.add_(1.0)  # private: writes to the tensor do not reach the file
    assert torch.equal(tier.unpack(later), torch.full((2048,), 2.0))
    del got, later
    assert tier._regions == 0  # everything free: the next tensor starts at the file's beginning
    assert tier.pack(torch.ones(3)).region.offset == 0
    tier.close()


@pytest.fixture
def held_writer(monkeypatch: pytest.MonkeyPatch) -> threading.Event:
    """The writer blocks before each write until the event is set."""
    go = threading.Event()
    write = policy._write_exactly

    def slow(fd: int, view: memoryview, offset: int) -> None:
        assert go.wait(30), "the test never released the writer"
        write(fd, view, offset)

    monkeypatch.setattr(policy, "_write_exactly", slow)
    return go


def test_the_backward_takes_a_tensor_not_written_yet(held_writer: threading.Event) -> None:
    tier = FileTier()
    t = torch.randn(64, 64)
    h = tier.pack(t)
    got = tier.unpack(h)  # the writer has not written it: the tensor itself comes back
    assert torch.equal(got, t) and got.data_ptr() == t.data_ptr()
    assert tier.stats.unwritten_bytes == tier.stats.returned_bytes == t.numel() * 4
    held_writer.set()
    tier.flush()
    del got
    assert torch.equal(tier.unpack(h), t)  # still whole after the write it raced with
    tier.close()


def test_the_forward_waits_once_the_writer_is_max_pending_bytes_behind(held_writer: threading.Event) -> None:
    tier = FileTier(max_pending_bytes=1 << 16)  # 64 KiB
    first = tier.pack(torch.ones(8192))  # 32 KiB: under the bound
    done: list[object] = []
    second = threading.Thread(target=lambda: done.append(tier.pack(torch.ones(16384))))  # 64 KiB more
    second.start()
    second.join(0.5)
    assert second.is_alive() and not done  # blocked behind the unwritten 32 KiB
    held_writer.set()
    second.join(30)
    assert done and tier.stats.pack_wait_s > 0
    tier.flush()
    assert torch.equal(tier.unpack(first), torch.ones(8192))
    tier.close()


def test_a_full_disk_keeps_the_tensor_and_the_next_pack_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    def full(fd: int, view: memoryview, offset: int) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(policy, "_write_exactly", full)
    tier = FileTier()
    t = torch.randn(100)
    h = tier.pack(t)
    with pytest.raises(RuntimeError, match=r"spill directory .*mmpipe-spill-.* failed: .*No space left"):
        tier.flush()
    with pytest.raises(RuntimeError, match="No space left"):
        tier.pack(torch.ones(3))
    assert torch.equal(tier.unpack(h), t)  # nothing lost
    tier.close()


def test_the_writer_hands_freed_memory_back_every_trim_bytes(monkeypatch: pytest.MonkeyPatch) -> None:
    """glibc keeps freed heap blocks resident; the writer calls ``malloc_trim`` once per
    ``TRIM_BYTES`` written out (it lowered torch 2.11's peak from +604 MB to +316 MB a CPU step)."""
    assert policy._malloc_trim() is not None  # glibc: the test machines' C library
    calls: list[int] = []
    monkeypatch.setattr(policy, "_malloc_trim", lambda: lambda: calls.append(1))
    monkeypatch.setattr(FileTier, "TRIM_BYTES", 1 << 20)
    tier = FileTier(batch_bytes=256 << 10)  # a batch a tensor; the writer checks after each batch
    handles = [tier.pack(torch.zeros(64 << 10)) for _ in range(10)]  # 256 KiB each: 2.5 MiB
    tier.flush()
    assert len(calls) == 2  # after the 4th and the 8th tensor (1 MiB each time)
    assert all(torch.equal(tier.unpack(h), torch.zeros(64 << 10)) for h in handles)
    tier.close()


def test_an_offloaded_block_starts_once_the_blocks_before_it_are_written(held_writer: threading.Event) -> None:
    """``block_at_a_time`` (the default): at most one block's tensors wait in memory for the writer
    (what the activation budget counts), however much ``max_pending_bytes`` would allow; without it
    the next block starts at once."""
    free = FileTier(block_at_a_time=False)
    free.open_scope(0)
    free.pack(torch.randn(64, 64))
    free.submit()
    free.open_scope(1)  # returns although the writer is held
    assert free._pending > 0
    tier = FileTier()
    tier.open_scope(0)
    tier.pack(torch.randn(64, 64))
    tier.submit()  # the block's end
    opened = threading.Event()
    thread = threading.Thread(target=lambda: (tier.open_scope(1), opened.set()))
    thread.start()
    assert not opened.wait(0.3), "block 1 started while block 0's tensors were still in memory"
    held_writer.set()
    assert opened.wait(10)
    thread.join()
    assert tier._pending == 0
    free.close()
    tier.close()
