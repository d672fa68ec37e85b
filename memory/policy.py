"""Per-block activation policies: keep, offload (saved tensors to a tier) or recompute.

A block's policy wraps its ``forward`` (the module is not copied): ``recompute`` runs it under
non-reentrant activation checkpointing (only the block's inputs stay; the block runs again in the
backward), ``selective`` the same but keeping the outputs of matmuls and attention (per-op
checkpointing: only the cheap element-wise ops run again), ``offload`` runs it under ``torch.autograd.graph.saved_tensors_hooks`` that move every
saved tensor of at least ``min_bytes`` that is not a parameter to a tier and bring it back when the
backward needs it. Both work with several micro-batches in flight: each saved tensor owns its
handle, whatever the order the backwards run in.

Tiers (:class:`~mmpipe.memory.tiers.Tier`: ``pack`` a tensor into a handle, ``unpack`` it back, ``prefetch`` handles the
backward will soon need):

- :class:`~mmpipe.memory.host.HostTier`: pinned host memory, for GPU runs. Copies to the host run on
  a side stream (the forward does not wait for them), and when the backward reaches an offloaded
  block it starts copying back the tensors of the block that ran before it, so they arrive while
  this block's backward computes.
- :class:`~mmpipe.memory.tiers.FileTier`: a spill file (for NVMe, and on CPU-only machines the tier that actually
  lowers resident memory). One file per tier, opened and unlinked at once (nothing is left behind,
  even by a killed process); a tensor takes a region of it, and regions are reused by later tensors
  of the same size (rewriting cached pages is about twice as fast as growing a file, and the
  tensors of the next step or micro-batch have the same sizes). A background thread writes, so the
  forward goes on while its saved tensors go out; the tensor stays referenced until its bytes are
  written (at most ``max_pending_bytes`` of them: beyond that the forward waits), and a backward
  that needs a tensor still waiting to be written takes it as it is. Its reads are mappings the
  backward faults in as it touches them, so it has nothing to prefetch.

Counters (:class:`~mmpipe.memory.tiers.TierStats`) report the bytes offloaded, the bytes currently out and the seconds
spent writing (the writer thread's), reading (the backward waits on them) and waiting for the writer
(the forward), for the run's events.
"""

from __future__ import annotations

import enum
import functools
import weakref
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from mmpipe.memory.tiers import Tier


def repeated_blocks(module: nn.Module) -> list[nn.Module]:
    """Members of the module's ``ModuleList``s of two or more same-class modules (outermost lists)."""
    found: list[nn.Module] = []
    inside: set[int] = set()
    for _, m in module.named_modules():
        if id(m) in inside:
            for c in m.children():
                inside.add(id(c))
            continue
        if isinstance(m, nn.ModuleList) and len(m) >= 2 and len({type(c) for c in m}) == 1:
            found += list(m)
            for sub in m.modules():
                inside.add(id(sub))
    return found


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


def is_parameter(t: torch.Tensor) -> bool:
    """A parameter or a view of one (``weight.t()``, which linear layers save): its memory is the
    parameter's, so moving it out frees nothing (the cost model does not count it either)."""
    return isinstance(t, nn.Parameter) or isinstance(t._base, nn.Parameter)


@contextmanager
def offload_saved_tensors(tier: Tier, *, min_bytes: int = 1 << 16, block: int | None = None) -> Iterator[None]:
    """Within the block, tensors autograd saves move to ``tier``, except parameters (they stay
    resident anyway) and tensors under ``min_bytes``. A tensor several ops save (a block's input to
    its query, key and value projections) goes out once: they share its handle.

    ``block``: the block's index in its stack. When the backward first asks this block for a tensor,
    the tier prefetches the rest of the block's tensors and those of the offloaded block that ran
    before it in the same forward (a lower index), whose backward comes next."""
    written: dict[int, tuple[weakref.ref[torch.Tensor], Any]] = {}  # id -> (the tensor, its handle)
    scope = tier.open_scope(block)

    def pack(t: torch.Tensor) -> Any:
        if is_parameter(t) or t.numel() * t.element_size() < min_bytes:
            return t
        hit = written.get(id(t))
        if hit is not None and hit[0]() is t:  # the same live tensor (an id alone may be reused)
            tier.share(hit[1])
            return hit[1]
        handle = tier.pack(t)
        written[id(t)] = (weakref.ref(t), handle)
        scope.handles.append(weakref.ref(handle))
        return handle

    def unpack(packed: Any) -> torch.Tensor:
        if isinstance(packed, torch.Tensor):
            return packed
        if not scope.started:
            scope.started = True
            tier.prefetch(scope.live())
            if scope.previous is not None:
                tier.prefetch(scope.previous.live())
        return tier.unpack(packed)

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        try:
            yield
        finally:
            tier.submit()  # the block's tensors go out while the next block runs


def _offloaded(forward: Callable[..., Any], tier: Tier, min_bytes: int, block: int) -> Callable[..., Any]:
    @functools.wraps(forward)
    def run(*args: Any, **kwargs: Any) -> Any:
        with offload_saved_tensors(tier, min_bytes=min_bytes, block=block):
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
    tier: Tier | None = None,
    min_bytes: int = 1 << 16,
) -> None:
    """Wrap each block's ``forward`` with its policy (in place). ``offload`` needs a ``tier``
    (:class:`FileTier` on CPU, :class:`~mmpipe.memory.host.HostTier` on GPU)."""
    if len(blocks) != len(policies):
        raise ValueError(f"{len(policies)} block policies given for {len(blocks)} blocks")
    for index, (block, policy) in enumerate(zip(blocks, policies, strict=True)):
        match policy:
            case BlockPolicy.KEEP:
                continue
            case BlockPolicy.RECOMPUTE:
                block.forward = _recomputed(block.forward)  # type: ignore[method-assign]
            case BlockPolicy.SELECTIVE:
                block.forward = _recomputed(block.forward, selective=True)  # type: ignore[method-assign]
            case BlockPolicy.OFFLOAD:
                if tier is None:
                    raise ValueError("an offload policy needs a tier (FileTier(spill_dir) on CPU, HostTier() on GPU)")
                block.forward = _offloaded(block.forward, tier, min_bytes, index)  # type: ignore[method-assign]
            case _:
                raise ValueError(f"unknown block policy {policy!r}")


@contextmanager
def count_saved_bytes() -> Iterator[list[int]]:
    """Count the bytes autograd keeps resident for the backward within the block (tensors the
    policies moved out or did not save are not counted). Yields a one-element list, filled on exit."""
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if not is_parameter(t):
            storage = t.untyped_storage()
            seen[storage.data_ptr()] = max(seen.get(storage.data_ptr(), 0), storage.nbytes())
        return t

    total = [0]
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        yield total
    total[0] = sum(seen.values())
