"""The activation budget planner: per-block policies that fit a memory budget at the least added time.

One search serves every caller: a run's ``memory.<stage>.policy=auto`` (``mmpipe.train``), the
layout planner's memory-policy search (``mmpipe.sched.planner``, for every configuration it
weighs) and ``benchmarks/memory.py``. Callers describe a stage's repeated blocks on one rank with a
:class:`BlockPricing` (from the cost model's :class:`~mmpipe.sched.cost.StageCost`, measured on the
meta device): per micro-batch, what a block saves and what recomputing or offloading it costs.
Under 1F1B a rank holds the activations of several micro-batches at once, so the resident estimate is
``inflight x`` one micro-batch's, plus the block the backward is working on (its saved bytes,
rematerialised or read back when they did not stay). Per block and micro-batch:

- keep: its saved bytes stay;
- recompute: only its input stays; the backward pays its forward again;
- offload: nothing large stays; the step pays writing and reading its saved bytes at the tier's
  bandwidth, less what the copies hide behind compute (``hidden_s``: the forward and backward on a
  GPU with copies on a side stream; none for the file tier, whose reads block the backward).

Blocks are alike, so the search is over counts ``(recompute, offload)``, and for each recompute
count the least offload count that fits is the cheapest (time only grows with it): exact, in
``blocks + 1`` steps.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Protocol

from mmpipe.memory.policy import BlockPolicy

# What the file tier (``mmpipe.memory.tiers.FileTier``, the CPU runtime's activation offload) is
# priced at: the order of a local NVMe's sequential write/read bandwidth.
FILE_TIER_BYTES_PER_S = 1e9


class BlockCosts(Protocol):
    """One sample's costs of a stage with repeated blocks (the cost model's ``StageCost`` is one)."""

    @property
    def blocks(self) -> int: ...
    @property
    def block_activation_bytes(self) -> float: ...
    @property
    def block_input_bytes(self) -> float: ...
    @property
    def activation_bytes(self) -> float: ...
    @property
    def block_flops(self) -> float: ...


__all__ = ["FILE_TIER_BYTES_PER_S", "BlockPricing", "PolicyChoice", "choose_policies"]


@dataclasses.dataclass(frozen=True)
class BlockPricing:
    """A stage's repeated blocks on one rank, per micro-batch: bytes each saves (``block_bytes``),
    its input (what recomputing it keeps), the saved bytes outside the blocks, and the seconds a
    block's recomputation and offload (out and back) add; ``hidden_s``: compute the tier's copies
    overlap with; ``tier_bytes``: what the tier holds at most (all micro-batches in flight);
    ``pending_blocks``: offloaded blocks whose saved bytes may still be in memory at once, waiting
    for the tier (the file tier: the block being written, see ``FileTier.block_at_a_time``)."""

    blocks: int
    block_bytes: float
    input_bytes: float
    outside_bytes: float
    recompute_s: float
    offload_s: float
    hidden_s: float = 0.0
    tier_bytes: float = math.inf
    pending_blocks: int = 0

    @classmethod
    def from_cost(
        cls,
        cost: BlockCosts,
        *,
        rows: float = 1.0,
        flops_per_s: float,
        offload_bytes_per_s: float,
        hidden_s: float = 0.0,
        tier_bytes: float = math.inf,
        pending_blocks: int = 0,
    ) -> BlockPricing:
        """From one sample's cost: ``rows`` samples' worth on the rank (a micro-batch's samples over
        its data-parallel and sequence-parallel split)."""
        n = max(cost.blocks, 1)
        block_bytes = rows * cost.block_activation_bytes / n
        return cls(
            blocks=cost.blocks,
            block_bytes=block_bytes,
            input_bytes=rows * cost.block_input_bytes / n,
            outside_bytes=rows * (cost.activation_bytes - cost.block_activation_bytes),
            recompute_s=rows * cost.block_flops / n / flops_per_s,
            offload_s=2 * block_bytes / offload_bytes_per_s,
            hidden_s=hidden_s,
            tier_bytes=tier_bytes,
            pending_blocks=pending_blocks,
        )

    def resident(self, recompute: int, offload: int, *, inflight: int, fixed_bytes: float = 0) -> float:
        """Saved-activation bytes a rank holds at most with ``recompute`` / ``offload`` of the blocks
        (plus ``fixed_bytes``: weights, optimizer state, whatever else the rank keeps): what stays
        between forward and backward for every micro-batch in flight, and the backward's working
        block: one block's saved bytes, produced again when it was recomputed or read back when it
        was offloaded (the cost model's ``transient``, ``mmpipe.sched.analytic``), and the offloaded
        blocks still waiting for the tier (``pending_blocks``)."""
        kept = self.blocks - recompute - offload
        one = self.outside_bytes + kept * self.block_bytes + recompute * self.input_bytes
        pending = min(offload, self.pending_blocks) * self.block_bytes
        return inflight * one + self.block_bytes + pending + fixed_bytes

    def resident_bytes(self, recompute: int, offload: int, *, inflight: int, fixed_bytes: float = 0) -> int:
        """:meth:`resident`, rounded up to whole bytes."""
        return math.ceil(self.resident(recompute, offload, inflight=inflight, fixed_bytes=fixed_bytes))

    def added_s(self, recompute: int, offload: int) -> float:
        """Seconds the policies add to a micro-batch's forward and backward."""
        return recompute * self.recompute_s + max(0.0, offload * self.offload_s - self.hidden_s)


@dataclasses.dataclass(frozen=True)
class PolicyChoice:
    """The chosen counts, what a rank then holds and what the policies cost per micro-batch."""

    recompute: int
    offload: int
    blocks: int
    resident_bytes: int
    added_s: float

    @property
    def fractions(self) -> tuple[float, float]:
        """``(recompute, offload)`` as a plan's ``DeviceGroup`` carries them (offload: of the kept blocks)."""
        kept = self.blocks - self.recompute
        return self.recompute / self.blocks, (self.offload / kept if kept else 0.0)

    def policies(self) -> list[BlockPolicy]:
        """Per block, in the runtime's order (see ``mmpipe.memory.policy.block_policies``)."""
        keep = self.blocks - self.recompute - self.offload
        return (
            [BlockPolicy.OFFLOAD] * self.offload + [BlockPolicy.RECOMPUTE] * self.recompute + [BlockPolicy.KEEP] * keep
        )


def choose_policies(
    pricing: BlockPricing,
    *,
    budget_bytes: float,
    inflight: int,
    fixed_bytes: float = 0,
    offload: bool = True,
) -> PolicyChoice:
    """The cheapest ``(recompute, offload)`` counts whose resident bytes fit ``budget_bytes``: for each
    recompute count the least offload that fits (offloading more never saves time); among equally
    cheap ones, the fewest bytes. ``offload=False``: recomputation only (a runtime with no tier).

    Raises ``ValueError`` naming the budget and the least the stage can hold when nothing fits.
    """
    n = pricing.blocks
    if n == 0:
        raise ValueError("the stage has no repeated blocks to recompute or offload")
    max_offload_by_tier = (
        n if pricing.tier_bytes == math.inf else int(pricing.tier_bytes // max(inflight * pricing.block_bytes, 1))
    )
    best: PolicyChoice | None = None
    least: float | None = None
    for r in range(n + 1):
        most = min(n - r, max_offload_by_tier) if offload else 0

        # each offloaded block takes its bytes off every micro-batch in flight: the least count that fits
        def held(o: int, r: int = r) -> float:
            return pricing.resident(r, o, inflight=inflight, fixed_bytes=fixed_bytes)

        over = held(0) - budget_bytes
        o = max(0, math.floor(over / (inflight * pricing.block_bytes))) if over > 0 and pricing.block_bytes else 0
        while o <= most and held(o) > budget_bytes:
            o += 1  # (the floor above starts one short at most, for rounding)
        least = held(min(o, most)) if least is None else min(least, held(min(o, most)))
        if o > most:
            continue
        added = pricing.added_s(r, o)
        if best is None or added < best.added_s or (added == best.added_s and held(o) < best.resident_bytes):
            best = PolicyChoice(r, o, n, math.ceil(held(o)), added)
    if best is None:
        raise ValueError(
            f"no activation policy fits a budget of {budget_bytes / 2**30:.3g} GiB: at least "
            f"{(least or 0) / 2**30:.3g} GiB with {inflight} micro-batch{'es' if inflight != 1 else ''} in flight"
        )
    return best
