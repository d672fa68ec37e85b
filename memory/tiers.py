"""Where offloaded activations go: the :class:`Tier` interface and :class:`FileTier`, a spill file
(page-aligned regions written by a background thread, read back through ``mmap``); the pinned
host-memory tier is :class:`mmpipe.memory.host.HostTier`."""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import dataclasses
import functools
import mmap
import os
import queue
import tempfile
import threading
import time
import weakref
from collections import defaultdict
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch


@dataclasses.dataclass
class TierStats:
    """What a tier moved: bytes handed out in all, bytes out now (and at most), bytes given back to
    the backward (read from the file, taken before they were written, or prefetched), seconds spent
    writing (in the background), reading, and the forward's waits on the writer."""

    offloaded_bytes: int = 0
    out_bytes: int = 0
    peak_out_bytes: int = 0
    returned_bytes: int = 0
    unwritten_bytes: int = 0  # of returned_bytes: taken before the writer wrote them
    prefetched_bytes: int = 0  # of returned_bytes: on their way back before the backward asked for them
    write_s: float = 0.0
    read_s: float = 0.0
    pack_wait_s: float = 0.0


class Tier:
    """Where offloaded saved tensors go: :meth:`pack` takes a tensor and returns a handle,
    :meth:`unpack` gives the tensor back for the backward. Subclasses keep :attr:`stats`.

    The tier also tracks the offloaded blocks of a forward (:meth:`open_scope`), so that the
    backward of one block can :meth:`prefetch` what the block before it saved."""

    stats: TierStats
    _last_scope: weakref.ref[_BlockScope] | None = None  # the newest block scope, while alive

    def pack(self, t: torch.Tensor) -> Any:
        """Move ``t`` out; returns the handle :meth:`unpack` takes."""
        raise NotImplementedError

    def unpack(self, handle: Any) -> torch.Tensor:
        """The tensor ``handle`` stands for, on its device, bitwise as packed."""
        raise NotImplementedError

    def prefetch(self, handles: Sequence[Any]) -> None:
        """Start bringing ``handles`` back ahead of their :meth:`unpack` (by default: nothing to do)."""

    def share(self, handle: Any) -> None:
        """Another op of the block saves the tensor ``handle`` holds: it will be unpacked once more."""

    def submit(self) -> None:
        """A block's forward ended: what it packed may go out now (by default it went at once)."""

    def flush(self) -> None:
        """Wait until everything packed so far is out."""

    def close(self) -> None:
        """Release what the tier holds (files, buffers, threads)."""

    def open_scope(self, block: int | None) -> _BlockScope:
        """A new offloaded block's forward: its scope, linked to the previous one when that ran
        earlier in the same forward (a lower block index), since its backward runs next."""
        previous = self._last_scope() if self._last_scope is not None else None
        if previous is None or block is None or previous.block is None or previous.block >= block:
            previous = None
        scope = _BlockScope(block, previous)
        self._last_scope = weakref.ref(scope)
        return scope


class _BlockScope:
    """One offloaded block's forward: weak references to its handles (autograd owns them), and the
    scope of the offloaded block that ran before it in the same forward."""

    def __init__(self, block: int | None, previous: _BlockScope | None) -> None:
        self.block, self.previous = block, previous
        self.handles: list[weakref.ref[Any]] = []
        self.started = False  # its backward asked for a first tensor

    def live(self) -> list[Any]:
        """The handles whose saved tensors the backward has not dropped yet."""
        return [h for ref in self.handles if (h := ref()) is not None]


_ALIGN = 4096  # regions and host buffers start on page boundaries


@functools.cache
def _malloc_trim() -> Callable[[], object] | None:
    """glibc's ``malloc_trim(0)``, or ``None`` where the C library has none (musl, macOS)."""

    try:
        trim = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return None
    trim.argtypes = [ctypes.c_size_t]
    return lambda: trim(0)


def page_rounded(nbytes: int) -> int:
    """``nbytes`` (at least one) rounded up to whole pages: the size class tiers reuse space by."""
    return -(-max(nbytes, 1) // _ALIGN) * _ALIGN


class FileTier(Tier):
    """Saved tensors as raw bytes in one spill file under ``directory`` (a fresh temporary one by
    default), written by a background thread (see the module docstring)."""

    # Bytes freed between two malloc_trim calls: torch 2.11 (a CPU step, 581 MB offloaded) grew its
    # peak by 604 MB without them, by 316 MB with one every 64 MiB.
    TRIM_BYTES = 64 << 20

    def __init__(
        self,
        directory: str | Path | None = None,
        *,
        max_pending_bytes: int = 256 << 20,
        batch_bytes: int = 8 << 20,
        block_at_a_time: bool = True,
    ) -> None:
        self._own = directory is None
        self.directory = Path(tempfile.mkdtemp(prefix="mmpipe-spill-") if directory is None else directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.max_pending_bytes = max_pending_bytes
        self.batch_bytes = batch_bytes
        # an offloaded block's forward starts once the blocks before it are written: at most one
        # block's tensors wait in memory (what the activation budget counts), not max_pending_bytes
        self.block_at_a_time = block_at_a_time
        self.stats = TierStats()
        path = self.directory / f"{os.getpid()}-{id(self):x}.spill"
        self._fd: int | None = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        path.unlink()  # the space goes with the descriptor, whatever happens to the process
        self._lock = threading.Condition()
        self._free: dict[int, list[int]] = defaultdict(list)  # region size -> free offsets
        self._end = 0
        self._regions = 0  # taken: by handles, or by tensors mapped from them
        self._pending = 0  # bytes handed to the writer and not written yet
        # Tensors go to the writer in batches of about ``batch_bytes`` (and at each block's end): one
        # hand-off per tensor costs the forward more in thread switches than the batching delays.
        self._batch: list[_Spilled] = []
        self._batched = 0
        self._queue: queue.SimpleQueue[list[_Spilled] | None] = queue.SimpleQueue()
        self._writer: threading.Thread | None = None
        self._error: OSError | None = None  # the writer's, raised by the next pack or flush

    # -- the forward's side --------------------------------------------------------------------------
    def open_scope(self, block: int | None) -> _BlockScope:
        if self.block_at_a_time:
            self.flush()
        return super().open_scope(block)

    def pack(self, t: torch.Tensor) -> _Spilled:
        """Hand ``t`` to the writer; returns the handle :meth:`unpack` takes (its region goes with it)."""
        if self._fd is None:
            raise RuntimeError("this FileTier is closed")
        self._raise_write_error()
        data = t.detach()
        if not _is_dense(data):  # an expanded or strided view: its elements, gathered
            data = data.contiguous()
        data = data.cpu()  # a dense layout (a transposed q, k or v) goes out as it is, no copy
        nbytes = data.numel() * data.element_size()
        start = time.perf_counter()
        with self._lock:
            if self._pending + nbytes > self.max_pending_bytes:
                self.submit()  # what the writer is to catch up with must reach it first
            while self._pending and self._pending + nbytes > self.max_pending_bytes:
                self._lock.wait()
            self._pending += nbytes
            size = page_rounded(nbytes)
            free = self._free[size]
            offset = free.pop() if free else self._grow(size)
            self._regions += 1
            self.stats.offloaded_bytes += nbytes
            self.stats.out_bytes += nbytes
            self.stats.peak_out_bytes = max(self.stats.peak_out_bytes, self.stats.out_bytes)
            self.stats.pack_wait_s += time.perf_counter() - start
        handle = _Spilled(_Region(self, offset, size), data, data.stride(), t.device, nbytes)
        self._batch.append(handle)
        self._batched += nbytes
        if self._batched >= self.batch_bytes:
            self.submit()
        return handle

    def submit(self) -> None:
        """Hand the tensors packed since the last hand-off to the writer (a block's end does)."""
        if not self._batch:
            return
        if self._writer is None:
            self._writer = threading.Thread(target=self._write_loop, name="mmpipe-spill-writer", daemon=True)
            self._writer.start()
            # At interpreter exit the writer is stopped between tensors, not killed inside a torch op
            self._stop_writer = weakref.finalize(self, _stop_thread, self._queue, self._writer)
        batch, self._batch, self._batched = self._batch, [], 0
        self._queue.put(batch)

    def _grow(self, size: int) -> int:
        offset, self._end = self._end, self._end + size
        return offset

    # -- the backward's side -------------------------------------------------------------------------
    def unpack(self, handle: _Spilled) -> torch.Tensor:
        """The tensor back: the one still waiting to be written (its write is dropped), or read from
        the file. A handle several saves share is read once while the tensor read is alive."""
        loaded = handle.loaded() if handle.loaded is not None else None
        if loaded is not None:
            return loaded
        with self._lock:
            data = handle.data
            if data is not None and not handle.written:
                handle.keep = True  # the writer skips it (or its bytes are not read back)
            self.stats.returned_bytes += handle.nbytes
            if data is not None:
                self.stats.unwritten_bytes += handle.nbytes
        if data is None:
            if self._fd is None:
                raise RuntimeError("this FileTier was closed before the backward read its tensors")
            start = time.perf_counter()
            if handle.nbytes:
                # Mapped, not copied: the pages come from the page cache as the backward touches them
                # (several times faster than reading into fresh memory). The region stays taken while
                # the mapping lives; private, so nothing written to the tensor reaches the file.
                mapped = _Mapping(
                    self._fd,
                    handle.nbytes,
                    flags=mmap.MAP_PRIVATE,
                    prot=mmap.PROT_READ | mmap.PROT_WRITE,
                    offset=handle.region.offset,
                )
                mapped.region = handle.region
                flat = torch.frombuffer(mapped, dtype=torch.uint8).view(handle.dtype)
                data = flat.as_strided(handle.shape, handle.stride)
            else:
                data = torch.empty_strided(handle.shape, handle.stride, dtype=handle.dtype)
            self.stats.read_s += time.perf_counter() - start
        out = data.to(handle.device)
        handle.loaded = weakref.ref(out)
        return out

    # -- the writer ----------------------------------------------------------------------------------
    def _write_loop(self) -> None:
        # The writer runs at the lowest priority: the step's compute threads get the cores, and the
        # writer fills the gaps between their ops (benchmarks/memory.py on 2 cores, 512 tokens: +9 to +11 %
        # a step against keep-everything, +38 % with the writer at normal priority).
        with contextlib.suppress(OSError, AttributeError):  # (per-thread nice: Linux)
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
        freed = 0
        while (batch := self._queue.get()) is not None:
            batch.reverse()
            while batch:
                handle = batch.pop()
                with self._lock:
                    data, skip = handle.data, handle.keep
                elapsed, failed = 0.0, False
                flat: Any = None  # numpy arrays are buffers
                if not skip and data is not None and handle.nbytes and self._fd is not None and self._error is None:
                    start = time.perf_counter()
                    try:
                        flat = _span(data).view(torch.uint8).numpy()
                        _write_exactly(self._fd, memoryview(flat), handle.region.offset)
                    except OSError as err:  # a full disk: the tensor stays in memory, the next pack raises
                        self._error, failed = err, True
                    elapsed = time.perf_counter() - start
                nbytes = handle.nbytes
                with self._lock:
                    self.stats.write_s += elapsed
                    handle.written = True
                    handle.keep = handle.keep or failed or self._error is not None
                    if not handle.keep:
                        handle.data = None  # its memory goes now
                        freed += nbytes
                del handle, data, flat  # before anyone is told: a handle nobody else holds frees its region
                with self._lock:
                    self._pending -= nbytes
                    self._maybe_restart()
                    self._lock.notify_all()
            # The memory written out is free, but glibc keeps freed heap blocks resident (its mmap
            # threshold rises to each mapped block freed, up to 32 MiB, so later tensors come from
            # the heap): hand the free pages back, off the forward's path, every TRIM_BYTES freed.
            if freed >= self.TRIM_BYTES and (trim := _malloc_trim()) is not None:
                trim()
                freed = 0

    def _release(self, handle: _Spilled) -> None:
        with self._lock:
            self.stats.out_bytes -= handle.nbytes

    def _release_region(self, region: _Region) -> None:
        with self._lock:
            self._regions -= 1
            self._free[region.size].append(region.offset)
            self._maybe_restart()

    def _maybe_restart(self) -> None:
        """Everything came back: later tensors start again from the file's beginning (so tensors of
        changing sizes do not leave it ever longer)."""
        if self._regions == 0:
            self._free.clear()
            self._end = 0

    def flush(self) -> None:
        """Wait until every tensor packed so far is written."""
        self.submit()
        with self._lock:
            while self._pending:
                self._lock.wait()
        self._raise_write_error()

    def _raise_write_error(self) -> None:
        if self._error is not None:
            raise RuntimeError(
                f"writing saved activations to the spill directory {self.directory} failed: {self._error} "
                "(the tensors not written stayed in memory; free space there, or offload less)"
            ) from self._error

    def close(self) -> None:
        """Stop the writer, close the spill file and remove the directory if this tier made it."""
        self._batch, self._batched = [], 0
        if self._writer is not None:
            self._stop_writer()
            self._writer = None
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        if self._own:
            self.directory.rmdir()


def _stop_thread(work: queue.SimpleQueue[Any], thread: threading.Thread) -> None:
    work.put(None)
    thread.join()


def _is_dense(t: torch.Tensor) -> bool:
    """Whether ``t``'s elements fill its storage span exactly once (a permutation of a contiguous
    layout: transposes, not expansions or slices)."""
    order = sorted(range(t.dim()), key=lambda d: -t.stride()[d])
    return t.permute(order).is_contiguous()


def _span(t: torch.Tensor) -> torch.Tensor:
    """A dense tensor's storage span, as a 1-D tensor (its bytes in memory order)."""
    return t.as_strided((t.numel(),), (1,), t.storage_offset())


def _write_exactly(fd: int, view: memoryview, offset: int) -> None:
    done = 0
    while done < len(view):  # one pwrite moves at most about 2 GiB
        done += os.pwrite(fd, view[done:], offset + done)


class _Region:
    """A region of the spill file, free again when its last holder (the handle, a tensor mapped
    from it) lets go."""

    def __init__(self, tier: FileTier, offset: int, size: int) -> None:
        self.tier, self.offset, self.size = tier, offset, size

    def __del__(self) -> None:
        self.tier._release_region(self)


class _Mapping(mmap.mmap):
    """A region mapped for the backward (``torch.frombuffer`` keeps it alive with the tensor)."""

    region: _Region


class _Spilled:
    """A saved tensor in a region of the spill file (or still on its way there). The region lives as
    long as the handle: autograd drops the handle after the backward that read it, or with a graph
    whose backward never ran."""

    def __init__(
        self,
        region: _Region,
        data: torch.Tensor,
        stride: tuple[int, ...],
        device: torch.device,
        nbytes: int,
    ) -> None:
        self.tier, self.region, self.nbytes = region.tier, region, nbytes
        self.shape, self.stride, self.dtype, self.device = data.shape, stride, data.dtype, device
        self.data: torch.Tensor | None = data  # the bytes until written (or for good, once kept)
        self.written = False
        self.keep = False  # the backward took ``data`` before it was written
        self.loaded: weakref.ref[torch.Tensor] | None = None  # the tensor last read back, while alive

    def __del__(self) -> None:
        self.tier._release(self)
