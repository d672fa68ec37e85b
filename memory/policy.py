"""Per-block activation policies: keep, offload (saved tensors to a tier) or recompute.

A block's policy wraps its ``forward`` (the module is not copied): ``recompute`` runs it under
non-reentrant activation checkpointing (only the block's inputs stay; the block runs again in the
backward), ``selective`` the same but keeping the outputs of matmuls and attention (per-op
checkpointing: only the cheap element-wise ops run again), ``offload`` runs it under ``torch.autograd.graph.saved_tensors_hooks`` that move every
saved tensor of at least ``min_bytes`` that is not a parameter to a tier and bring it back when the
backward needs it. Both work with several micro-batches in flight: each saved tensor owns its
handle, whatever the order the backwards run in.

Tiers:

- :class:`FileTier`: a spill directory (for NVMe, and on CPU-only machines the tier that actually
  lowers resident memory). A tensor is written as raw bytes to its own file and read back, then the
  file is deleted.

Counters (:class:`TierStats`) report the bytes offloaded, the bytes currently out and the time spent
writing and reading, for the run's events.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import itertools
import os
import tempfile
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts


class BlockPolicy(enum.StrEnum):
    """What happens to the activations a block saves for its backward."""

    KEEP = "keep"
    OFFLOAD = "offload"
    RECOMPUTE = "recompute"
    SELECTIVE = "selective"  # recompute the cheap ops, keep the outputs of matmuls and attention


BLOCK_LETTERS = {
    "k": BlockPolicy.KEEP,
    "o": BlockPolicy.OFFLOAD,
    "r": BlockPolicy.RECOMPUTE,
    "s": BlockPolicy.SELECTIVE,
}
"""One letter per policy, as plans spell per-block lists (``DeviceGroup.blocks``)."""


@dataclasses.dataclass
class TierStats:
    """What a tier moved: bytes written out in all, bytes out now (and at most), seconds spent."""

    offloaded_bytes: int = 0
    out_bytes: int = 0
    peak_out_bytes: int = 0
    write_s: float = 0.0
    read_s: float = 0.0


class FileTier:
    """Saved tensors as raw bytes in files under ``directory`` (a fresh temporary one by default)."""

    def __init__(self, directory: str | Path | None = None) -> None:
        self._own = directory is None
        self.directory = Path(tempfile.mkdtemp(prefix="mmpipe-spill-") if directory is None else directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.stats = TierStats()
        self._ids = itertools.count()

    def pack(self, t: torch.Tensor) -> _Spilled:
        """Write ``t`` out; returns the handle :meth:`unpack` takes (its file goes with it)."""
        start = time.perf_counter()
        path = self.directory / f"{os.getpid()}-{next(self._ids)}.bin"
        t.detach().contiguous().cpu().view(torch.uint8).numpy().tofile(path)
        nbytes = t.numel() * t.element_size()
        self.stats.offloaded_bytes += nbytes
        self.stats.out_bytes += nbytes
        self.stats.peak_out_bytes = max(self.stats.peak_out_bytes, self.stats.out_bytes)
        self.stats.write_s += time.perf_counter() - start
        return _Spilled(self, path, t.shape, t.dtype, t.device, nbytes)

    def unpack(self, handle: _Spilled) -> torch.Tensor:
        """Read a packed tensor back (its file is deleted with the handle); a handle several saves
        share is read once while the tensor read is alive."""
        loaded = handle.loaded() if handle.loaded is not None else None
        if loaded is not None:
            return loaded
        start = time.perf_counter()
        raw = (
            torch.from_file(str(handle.path), size=handle.nbytes, dtype=torch.uint8)
            if handle.nbytes
            else torch.empty(0, dtype=torch.uint8)
        )
        self.stats.read_s += time.perf_counter() - start
        out = raw.view(handle.dtype).view(handle.shape).to(handle.device)
        handle.loaded = weakref.ref(out)
        return out

    def close(self) -> None:
        """Remove the spill directory if this tier made it."""
        if self._own:
            for p in self.directory.glob("*.bin"):
                p.unlink()
            self.directory.rmdir()


class _Spilled:
    """A saved tensor in a file. The file lives as long as the handle: autograd drops the handle
    after the backward that read it, or with a graph whose backward never ran."""

    def __init__(
        self, tier: FileTier, path: Path, shape: torch.Size, dtype: torch.dtype, device: torch.device, nbytes: int
    ) -> None:
        self.tier, self.path, self.shape, self.dtype, self.device, self.nbytes = (
            tier,
            path,
            shape,
            dtype,
            device,
            nbytes,
        )
        self.loaded: weakref.ref[torch.Tensor] | None = None  # the tensor last read back, while alive

    def __del__(self) -> None:
        self.path.unlink(missing_ok=True)
        self.tier.stats.out_bytes -= self.nbytes


@contextmanager
def offload_saved_tensors(tier: FileTier, *, min_bytes: int = 1 << 16) -> Iterator[None]:
    """Within the block, tensors autograd saves move to ``tier``, except parameters (they stay
    resident anyway) and tensors under ``min_bytes``. A tensor several ops save (a block's input to
    its query, key and value projections) goes out once: they share its handle."""
    written: dict[int, tuple[weakref.ref[torch.Tensor], _Spilled]] = {}  # id -> (the tensor, its handle)

    def pack(t: torch.Tensor) -> Any:
        if isinstance(t, nn.Parameter) or t.numel() * t.element_size() < min_bytes:
            return t
        hit = written.get(id(t))
        if hit is not None and hit[0]() is t:  # the same live tensor (an id alone may be reused)
            return hit[1]
        handle = tier.pack(t)
        written[id(t)] = (weakref.ref(t), handle)
        return handle

    def unpack(packed: Any) -> torch.Tensor:
        return packed if isinstance(packed, torch.Tensor) else tier.unpack(packed)

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        yield


def _offloaded(forward: Callable[..., Any], tier: FileTier, min_bytes: int) -> Callable[..., Any]:
    @functools.wraps(forward)
    def run(*args: Any, **kwargs: Any) -> Any:
        with offload_saved_tensors(tier, min_bytes=min_bytes):
            return forward(*args, **kwargs)

    return run


# Ops whose outputs selective checkpointing keeps: the expensive ones (FLOPs grow with the hidden
# size or the sequence), as torchtitan's selective activation checkpointing does.
_KEEP_OPS = {
    torch.ops.aten.mm.default,
    torch.ops.aten.addmm.default,
    torch.ops.aten.bmm.default,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
    torch.ops.aten._scaled_dot_product_flash_attention.default,
    torch.ops.aten._scaled_dot_product_efficient_attention.default,
}


def _keep_expensive(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in _KEEP_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def _recomputed(forward: Callable[..., Any], *, selective: bool = False) -> Callable[..., Any]:
    @functools.wraps(forward)
    def run(*args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            return forward(*args, **kwargs)
        if selective:
            contexts = functools.partial(create_selective_checkpoint_contexts, _keep_expensive)
            return checkpoint(forward, *args, use_reentrant=False, context_fn=contexts, **kwargs)
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)

    return run


def block_policies(blocks: int, recompute: float, offload: float) -> list[BlockPolicy]:
    """The policies a plan's fractions mean (``DeviceGroup.recompute`` / ``.offload``): ``recompute``
    of the blocks recomputed, ``offload`` of the rest offloaded. Offloaded blocks come first: their
    backward runs last, so their tensors have the longest to come back."""
    n_recompute = round(recompute * blocks)
    n_offload = round(offload * (blocks - n_recompute))
    keep = blocks - n_recompute - n_offload
    return [BlockPolicy.OFFLOAD] * n_offload + [BlockPolicy.RECOMPUTE] * n_recompute + [BlockPolicy.KEEP] * keep


def apply_block_policies(
    blocks: Sequence[nn.Module],
    policies: Sequence[BlockPolicy],
    *,
    tier: FileTier | None = None,
    min_bytes: int = 1 << 16,
) -> None:
    """Wrap each block's ``forward`` with its policy (in place). ``offload`` needs a ``tier``."""
    if len(blocks) != len(policies):
        raise ValueError(f"{len(policies)} block policies given for {len(blocks)} blocks")
    for block, policy in zip(blocks, policies, strict=True):
        match policy:
            case BlockPolicy.KEEP:
                continue
            case BlockPolicy.RECOMPUTE:
                block.forward = _recomputed(block.forward)  # type: ignore[method-assign]
            case BlockPolicy.SELECTIVE:
                block.forward = _recomputed(block.forward, selective=True)  # type: ignore[method-assign]
            case BlockPolicy.OFFLOAD:
                if tier is None:
                    raise ValueError("an offload policy needs a tier (e.g. FileTier(spill_dir))")
                block.forward = _offloaded(block.forward, tier, min_bytes)  # type: ignore[method-assign]
            case _:
                raise ValueError(f"unknown block policy {policy!r}")


@contextmanager
def count_saved_bytes() -> Iterator[list[int]]:
    """Count the bytes autograd keeps resident for the backward within the block (tensors the
    policies moved out or did not save are not counted). Yields a one-element list, filled on exit."""
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if not isinstance(t, nn.Parameter):
            storage = t.untyped_storage()
            seen[storage.data_ptr()] = max(seen.get(storage.data_ptr(), 0), storage.nbytes())
        return t

    total = [0]
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        yield total
    total[0] = sum(seen.values())
