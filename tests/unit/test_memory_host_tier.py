"""The host-memory tier (the GPU tier): bytes and layouts come back exactly, buffers are pooled, the
backward of a block prefetches the block before it, and the Wan DiT's gradients are bitwise those of
keeping everything, with several micro-batches in flight. On CPU the same code runs with plain
buffers and synchronous copies; the last test runs the pinned, side-stream path where CUDA is."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from test_memory_file_tier import _tensors, check_round_trip
from test_memory_policy import LAYERS, _inputs, _stage

from mmpipe.memory.host import HostTier, size_class
from mmpipe.memory.policy import BlockPolicy, apply_block_policies, count_saved_bytes


def test_every_tensor_comes_back_bitwise_in_its_layout() -> None:
    tier = HostTier()
    tensors = _tensors()
    check_round_trip(tier, tensors, [tier.pack(t) for t in tensors])


def test_buffers_are_pooled_so_later_steps_allocate_nothing() -> None:
    tier = HostTier()
    pool = []
    for step in range(3):
        handles = [tier.pack(torch.full((1000 + 10 * i,), float(step))) for i in range(5)]
        assert all(
            torch.equal(tier.unpack(h), torch.full((1000 + 10 * i,), float(step))) for i, h in enumerate(handles)
        )
        del handles
        pool.append(tier.pinned_bytes)
    assert pool[0] == pool[1] == pool[2] > 0
    assert tier.stats.out_bytes == 0


def test_changing_sizes_reuse_buffers_and_unused_classes_are_let_go() -> None:
    """Steps whose tensors grow a little (a longer video bucket) reuse the last step's buffers; once
    a step's buffers are all back, the classes it did not use leave the pool."""
    tier = HostTier()

    def run_step(numels: list[int]) -> int:
        handles = [tier.pack(torch.full((n,), float(n))) for n in numels]
        assert all(
            torch.equal(tier.unpack(h), torch.full((n,), float(n))) for h, n in zip(handles, numels, strict=True)
        )
        del handles
        return tier.pinned_bytes

    sizes = [run_step([3900 + 16 * step, 9000 + 16 * step]) for step in range(8)]
    assert sizes == [size_class(15_600) + size_class(36_000)] * 8  # one buffer per tensor, pinned once
    # a step of far larger tensors, then one back at the small sizes: only what each step used stays
    assert run_step([250_000]) == size_class(1_000_000)
    assert run_step([3900, 9000]) == size_class(15_600) + size_class(36_000)
    assert sum(len(v) for v in tier._free.values()) == 2
    # the pool's classes: powers of two, a page at least, each holding its tensor
    assert [size_class(n) for n in (1, 4096, 4097, 65536, 65537)] == [4096, 4096, 8192, 65536, 131072]


def _tagged(tier: HostTier, blocks: list[torch.nn.Module]) -> list[tuple[str, int]]:
    """Log ``("fetch", block)`` for every copy back and ``("ask", block)`` / ``("demand", block)`` for
    every unpack (``demand``: nothing was on its way, the backward waited for the whole copy)."""
    log: list[tuple[str, int]] = []
    current = [-1]
    for i, block in enumerate(blocks):
        block.register_forward_pre_hook(lambda m, a, i=i: current.__setitem__(0, i))
    block_of: dict[int, int] = {}
    pack, fetch, unpack = tier.pack, tier._fetch, tier.unpack

    def tagged_pack(t: torch.Tensor) -> Any:
        handle = pack(t)
        block_of[id(handle)] = current[0]
        return handle

    def tagged_fetch(handle: Any) -> Any:
        log.append(("fetch", block_of[id(handle)]))
        return fetch(handle)

    def tagged_unpack(handle: Any) -> torch.Tensor:
        alive = handle.loaded is not None and handle.loaded() is not None
        log.append(("ask" if handle.fetched is not None or alive else "demand", block_of[id(handle)]))
        return unpack(handle)

    tier.pack, tier._fetch, tier.unpack = tagged_pack, tagged_fetch, tagged_unpack  # type: ignore[method-assign]
    return log


def test_the_backward_of_a_block_prefetches_the_block_before_it() -> None:
    tier = HostTier()
    stage = _stage()
    blocks = list(stage.module.blocks)  # type: ignore[union-attr]
    apply_block_policies(blocks, [BlockPolicy.OFFLOAD] * LAYERS, tier=tier, min_bytes=0)
    log = _tagged(tier, blocks)
    stage.forward(stage.module, _inputs(), seed=3)["loss"].backward()
    asks = [b for kind, b in log if kind != "fetch"]
    assert sorted(set(asks)) == list(range(LAYERS))
    assert not [entry for entry in log if entry[0] == "demand"], log  # every tensor was on its way
    asked = {b: [i for i, e in enumerate(log) if e[0] != "fetch" and e[1] == b] for b in range(LAYERS)}
    for b in range(LAYERS - 1):
        fetches = [i for i, e in enumerate(log) if e == ("fetch", b)]
        later_blocks = [i for c in range(b + 2, LAYERS) for i in asked[c]]
        # Block b comes back as block b + 1's backward starts (its first unpack logs after the hook's
        # prefetch): after every block above b + 1 has finished, before block b + 1 asks for anything.
        assert fetches and min(fetches) > max(later_blocks, default=-1) and max(fetches) < min(asked[b + 1]), (b, log)
    assert tier.stats.prefetched_bytes == tier.stats.returned_bytes > 0


def test_prefetch_does_not_cross_micro_batches() -> None:
    """Two micro-batches in flight: the first block of the second forward does not link to the last
    block of the first (its backward does not come next)."""
    tier = HostTier()
    scopes = [tier.open_scope(i) for i in range(3)] + [tier.open_scope(i) for i in range(3)]
    assert [s.previous for s in scopes[:3]] == [None, scopes[0], scopes[1]]
    assert [s.previous for s in scopes[3:]] == [None, scopes[3], scopes[4]]


@pytest.mark.parametrize("order", ["in order", "reversed"])
def test_gradients_are_bitwise_identical_with_micro_batches_in_flight(order: str) -> None:
    def run(policies: list[BlockPolicy] | None) -> tuple[dict[str, torch.Tensor], int, HostTier]:
        stage, tier = _stage(), HostTier()
        if policies is not None:
            apply_block_policies(list(stage.module.blocks), policies, tier=tier, min_bytes=0)  # type: ignore[union-attr]
        with count_saved_bytes() as held:
            losses = [stage.forward(stage.module, _inputs(), seed=s)["loss"] for s in (3, 4)]
        for loss in losses if order == "in order" else losses[::-1]:
            loss.backward()
        return {k: p.grad for k, p in stage.module.named_parameters()}, held[0], tier  # type: ignore[misc]

    ref, keep_bytes, _ = run(None)
    mixed = [BlockPolicy.OFFLOAD, BlockPolicy.OFFLOAD, BlockPolicy.RECOMPUTE, BlockPolicy.OFFLOAD]
    got, held, tier = run(mixed)
    assert got.keys() == ref.keys()
    assert all(torch.equal(got[k], ref[k]) for k in ref), [k for k in ref if not torch.equal(got[k], ref[k])]
    assert tier.stats.offloaded_bytes > 0 and tier.stats.out_bytes == 0  # everything came back
    assert held < keep_bytes / 2  # three of four blocks moved out, one recomputed


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the pinned, side-stream path needs a CUDA device")
def test_on_cuda_the_gradients_are_bitwise_identical_and_the_copies_are_pinned() -> None:  # pragma: no cover
    def grads(tier: HostTier | None) -> dict[str, torch.Tensor]:
        stage = _stage()
        stage.module.to("cuda")
        if tier is not None:
            apply_block_policies(list(stage.module.blocks), [BlockPolicy.OFFLOAD] * LAYERS, tier=tier, min_bytes=0)  # type: ignore[union-attr]
        inputs = {k: v.cuda() for k, v in _inputs().items()}
        stage.forward(stage.module, inputs, seed=3)["loss"].backward()
        torch.cuda.synchronize()
        return {k: p.grad for k, p in stage.module.named_parameters()}  # type: ignore[misc]

    tier = HostTier()
    assert tier.pin
    # Bitwise equality needs run-to-run deterministic kernels: SDPA's math backend (its memory-
    # efficient backward, what float32 gets, may add with atomics) and deterministic cuDNN convolutions.
    from torch.nn.attention import SDPBackend, sdpa_kernel

    cudnn = torch.backends.cudnn.deterministic
    torch.backends.cudnn.deterministic = True
    try:
        with sdpa_kernel(SDPBackend.MATH):
            ref, again, got = grads(None), grads(None), grads(tier)
    finally:
        torch.backends.cudnn.deterministic = cudnn
    assert all(torch.equal(again[k], ref[k]) for k in ref), "the reference itself is not deterministic"
    assert all(torch.equal(got[k], ref[k]) for k in ref)
    assert tier.stats.prefetched_bytes == tier.stats.returned_bytes == tier.stats.offloaded_bytes > 0
    assert all(b.is_pinned() for pool in tier._free.values() for b in pool)
