"""The activation budget planner: per-block policies that fit a memory budget at the least added time.

Inputs come from the cost model (:class:`mmpipe.sched.cost.StageCost`, measured on the meta device:
activation bytes in and out of the repeated blocks, the blocks' inputs and FLOPs) and from the
pipeline: under 1F1B a rank holds the activations of several micro-batches at once, so the resident
estimate is ``inflight x`` one micro-batch's. Per block and micro-batch:

- keep: its saved bytes stay;
- recompute: only its input stays; the backward pays its forward FLOPs again;
- offload: nothing large stays; the step pays writing and reading its saved bytes at the tier's
  bandwidth (not overlapped on CPU, where the file tier is synchronous).

Blocks are alike, so the search is over counts ``(recompute, offload)``: exact, and at most
``(blocks + 1)^2`` candidates.
"""

from __future__ import annotations

import dataclasses

from mmpipe.memory.policy import BlockPolicy
from mmpipe.sched.cost import StageCost

# What the file tier is priced at: the order of a local NVMe's sequential write/read bandwidth.
FILE_TIER_BYTES_PER_S = 1e9


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


def resident_bytes(cost: StageCost, recompute: int, offload: int, *, inflight: int, fixed_bytes: int = 0) -> int:
    """Saved-activation bytes a rank holds with ``recompute`` / ``offload`` of the stage's blocks."""
    n = max(cost.blocks, 1)
    per_block = cost.block_activation_bytes / n
    per_input = cost.block_input_bytes / n
    outside = cost.activation_bytes - cost.block_activation_bytes
    kept = cost.blocks - recompute - offload
    one = outside + kept * per_block + recompute * per_input
    return int(inflight * one) + fixed_bytes


def choose_policies(
    cost: StageCost,
    *,
    budget_bytes: int,
    inflight: int,
    flops_per_s: float,
    offload_bytes_per_s: float,
    fixed_bytes: int = 0,
) -> PolicyChoice:
    """The cheapest ``(recompute, offload)`` counts whose resident bytes fit ``budget_bytes``.

    Raises ``ValueError`` naming the budget and the least the stage can hold when nothing fits.
    """
    if cost.blocks == 0:
        raise ValueError("the stage has no repeated blocks to recompute or offload")
    per_block_s = cost.block_flops / cost.blocks / flops_per_s
    per_block_io_s = 2 * cost.block_activation_bytes / cost.blocks / offload_bytes_per_s
    best: PolicyChoice | None = None
    least = None
    for r in range(cost.blocks + 1):
        for o in range(cost.blocks - r + 1):
            held = resident_bytes(cost, r, o, inflight=inflight, fixed_bytes=fixed_bytes)
            least = held if least is None else min(least, held)
            if held > budget_bytes:
                continue
            added = r * per_block_s + o * per_block_io_s
            if best is None or added < best.added_s or (added == best.added_s and held < best.resident_bytes):
                best = PolicyChoice(r, o, cost.blocks, held, added)
    if best is None:
        raise ValueError(
            f"no activation policy fits a budget of {budget_bytes / 2**30:.2f} GiB: at least "
            f"{(least or 0) / 2**30:.2f} GiB with {inflight} micro-batches in flight"
        )
    return best
