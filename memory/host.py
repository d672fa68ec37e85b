"""The host-memory tier: offloaded saved tensors in pinned host buffers, copied on a side stream.

For GPU runs (``mmpipe.memory.policy`` describes the policies and the other tier). Per saved
tensor of an offloaded block:

- forward (:meth:`HostTier.pack`): the side stream waits for the compute stream (the tensor is
  complete), copies the tensor's bytes into a pinned host buffer (``non_blocking``) and the
  tensor's memory is marked as used by the side stream (``record_stream``), so the caching
  allocator reuses it only once the copy is done. The forward never waits for a copy.
- backward: when the backward first asks an offloaded block for a tensor, the block's remaining
  tensors and those of the block that ran before it (whose backward comes next) are copied back on
  the side stream (:meth:`HostTier.prefetch`); :meth:`HostTier.unpack` makes the compute stream
  wait for that copy's event only. A tensor nobody prefetched is copied back there and then.

Every copy runs on the one side stream of its device, in the order issued: a buffer handed back to
the pool (when autograd drops the handle) may be refilled at once, since the next copy into it
comes after the copy out of it. Buffers are pooled (pinning memory is slow; the next step and
micro-batch save tensors of the same sizes), so after the first step nothing is pinned anew. The
pool's size classes are powers of two, as PyTorch's caching host allocator rounds pinned blocks
anyway: a tensor a little longer than last step's (a new video length or resolution bucket) reuses
its buffer. Whenever every buffer has come back (a step's backwards are done), the idle buffers of
classes that step did not use are let go, so a run whose shapes change does not pin ever more.

The same code runs on CPU tensors with plain host buffers and synchronous copies. That moves
nothing off the device (CPU runs offload to :class:`~mmpipe.memory.tiers.FileTier`); it is how
the CPU tests check the tier's bookkeeping, layouts and prefetch order.
"""

from __future__ import annotations

import time
import weakref
from collections import defaultdict
from collections.abc import Sequence

import torch

from mmpipe.memory.tiers import Tier, TierStats, _is_dense, _span, page_rounded

__all__ = ["HostTier", "size_class"]


class HostTier(Tier):
    """Saved tensors in (pinned, where a GPU is present) host buffers; see the module docstring.

    ``pin``: pin the buffers (default: when CUDA is available; unpinned buffers make the device
    copies synchronous)."""

    def __init__(self, *, pin: bool | None = None) -> None:
        self.pin = torch.cuda.is_available() if pin is None else pin
        self.stats = TierStats()
        self.pinned_bytes = 0  # bytes of the host buffers allocated and not let go (held or pooled)
        self._free: dict[tuple[torch.device, int], list[torch.Tensor]] = defaultdict(list)
        self._taken: set[tuple[torch.device, int]] = set()  # classes taken since all buffers came back
        self._out = 0  # buffers held by handles
        self._streams: dict[torch.device, torch.cuda.Stream] = {}
        self._closed = False

    # -- the forward's side --------------------------------------------------------------------------
    def pack(self, t: torch.Tensor) -> _Hosted:
        """Start copying ``t`` into a host buffer; returns the handle :meth:`unpack` takes."""
        if self._closed:
            raise RuntimeError("this HostTier is closed")
        data = t.detach()
        if not _is_dense(data):  # an expanded or strided view: its elements, gathered
            data = data.contiguous()
        nbytes = data.numel() * data.element_size()
        start = time.perf_counter()
        host = self._buffer(data.device, nbytes)
        src = _span(data).view(torch.uint8)  # a dense layout (a transposed q, k or v) goes as it is
        stream = self._stream(data.device)
        if stream is not None:
            stream.wait_stream(torch.cuda.current_stream(data.device))  # the tensor is complete
            with torch.cuda.stream(stream):
                host[:nbytes].copy_(src, non_blocking=self.pin)
            data.record_stream(stream)  # its memory is reused only after the copy
        else:
            host[:nbytes].copy_(src)
        self.stats.write_s += time.perf_counter() - start
        self.stats.offloaded_bytes += nbytes
        self.stats.out_bytes += nbytes
        self.stats.peak_out_bytes = max(self.stats.peak_out_bytes, self.stats.out_bytes)
        return _Hosted(self, host, nbytes, data)

    def _buffer(self, device: torch.device, nbytes: int) -> torch.Tensor:
        key = (device, size_class(nbytes))
        self._taken.add(key)
        self._out += 1
        free = self._free[key]
        if free:
            return free.pop()
        self.pinned_bytes += key[1]
        return torch.empty(key[1], dtype=torch.uint8, pin_memory=self.pin and device.type == "cuda")

    def _give_back(self, device: torch.device, host: torch.Tensor) -> None:
        self._out -= 1
        if self._closed:
            return
        self._free[(device, host.numel())].append(host)
        if self._out == 0:  # every buffer is back: keep the classes this round used
            for key in [k for k in self._free if k not in self._taken]:
                self.pinned_bytes -= key[1] * len(self._free.pop(key))
            self._taken.clear()

    def _stream(self, device: torch.device) -> torch.cuda.Stream | None:
        if device.type != "cuda":
            return None
        if device not in self._streams:
            self._streams[device] = torch.cuda.Stream(device)
        return self._streams[device]

    # -- the backward's side -------------------------------------------------------------------------
    def prefetch(self, handles: Sequence[_Hosted]) -> None:
        """Start copying ``handles`` back to their devices (those not on their way already)."""
        for handle in handles:
            if handle.fetched is None and (handle.loaded is None or handle.loaded() is None):
                handle.fetched = self._fetch(handle)
                self.stats.prefetched_bytes += handle.nbytes

    def share(self, handle: _Hosted) -> None:
        """One more unpack of ``handle`` to come: a prefetched copy stays until the last one."""
        handle.unpacks += 1

    def _fetch(self, handle: _Hosted) -> tuple[torch.Tensor, torch.cuda.Event | None]:
        stream = self._stream(handle.device)
        if stream is None:
            flat = handle.host[: handle.nbytes].clone()
            event = None
        else:
            with torch.cuda.stream(stream):  # allocated and filled on the side stream
                flat = torch.empty(handle.nbytes, dtype=torch.uint8, device=handle.device)
                flat.copy_(handle.host[: handle.nbytes], non_blocking=self.pin)
                event = torch.cuda.Event()
                event.record(stream)
        return flat.view(handle.dtype).as_strided(handle.shape, handle.stride), event

    def unpack(self, handle: _Hosted) -> torch.Tensor:
        """The tensor back on its device. A handle several saves share is fetched once while the
        tensor fetched is alive."""
        loaded = handle.loaded() if handle.loaded is not None else None
        if loaded is not None:
            return loaded
        start = time.perf_counter()
        fetched = handle.fetched or self._fetch(handle)
        handle.unpacks -= 1
        # The last unpack lets go of the copy; earlier ones of a shared tensor keep it (without it, a
        # later op's unpack would copy it again if the first op's backward has dropped its tensor).
        handle.fetched = fetched if handle.unpacks > 0 else None
        out, event = fetched
        if event is not None:
            current = torch.cuda.current_stream(handle.device)
            current.wait_event(event)  # the compute stream waits for this copy only
            out.record_stream(current)  # made on the side stream, used (and freed) on this one
        self.stats.read_s += time.perf_counter() - start
        self.stats.returned_bytes += handle.nbytes
        handle.loaded = weakref.ref(out)
        return out

    def flush(self) -> None:
        """Wait until every copy issued so far is done."""
        for stream in self._streams.values():
            stream.synchronize()

    def close(self) -> None:
        """Wait for the copies in flight and drop the buffer pool."""
        self.flush()
        self._closed = True
        self._free.clear()


def size_class(nbytes: int) -> int:
    """The pool's buffer size for a tensor of ``nbytes``: a power of two, at least a page."""
    return 1 << (page_rounded(nbytes) - 1).bit_length()


class _Hosted:
    """A saved tensor in a host buffer; the buffer goes back to the pool when autograd drops the
    handle (after the backward that read it, or with a graph whose backward never ran)."""

    def __init__(self, tier: HostTier, host: torch.Tensor, nbytes: int, data: torch.Tensor) -> None:
        self.tier, self.host, self.nbytes = tier, host, nbytes
        self.shape, self.stride, self.dtype, self.device = data.shape, data.stride(), data.dtype, data.device
        self.fetched: tuple[torch.Tensor, torch.cuda.Event | None] | None = None  # prefetched, not yet asked for
        self.loaded: weakref.ref[torch.Tensor] | None = None  # the tensor last given back, while alive
        self.unpacks = 1  # unpacks to come: one per op that saved the tensor

    def __del__(self) -> None:
        self.tier.stats.out_bytes -= self.nbytes
        self.tier._give_back(self.device, self.host)
