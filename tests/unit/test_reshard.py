"""Resharding regions: what each consumer rank assembles from the producer ranks' pieces is exactly
its shard, for every pair of layouts (whole, contiguous, zig-zag; data- and sequence-parallel)."""

from __future__ import annotations

import itertools

import pytest
import torch

from mmpipe.parallel.reshard import Region
from mmpipe.parallel.sequence import SequenceLayout

ROWS, LENGTH, DIM = 4, 13, 1


def _regions(layout: SequenceLayout | None, dp: int) -> list[Region]:
    """One region per rank: dp replicas of rows, each split by ``layout`` (None: whole)."""
    out = []
    for i in range(dp):
        rows = (i * ROWS // dp, (i + 1) * ROWS // dp)
        if layout is None:
            out.append(Region.whole(rows, DIM, LENGTH))
        else:
            out += [Region(rows, DIM, tuple(layout.ranges(LENGTH, j)), LENGTH) for j in range(layout.sp)]
    return out


LAYOUTS = [
    None,
    SequenceLayout(2, 1),
    SequenceLayout(1, 2, zigzag=True),
    SequenceLayout(2, 2, zigzag=True),
    SequenceLayout(3, 1),
]


@pytest.mark.parametrize(("src", "dst"), list(itertools.product(LAYOUTS, LAYOUTS)))
@pytest.mark.parametrize("dp", [(1, 1), (2, 1), (1, 2)])
def test_assembled_pieces_equal_the_shard(
    src: SequenceLayout | None, dst: SequenceLayout | None, dp: tuple[int, int]
) -> None:
    full = torch.arange(ROWS * LENGTH * 3, dtype=torch.float32).view(ROWS, LENGTH, 3)
    held = _regions(src, dp[0])
    local = [h.extract(full, h) if h.dim is None else _slice(full, h) for h in held]
    moved = 0
    for need in _regions(dst, dp[1]):
        buf = torch.full(need.shape(full), float("nan"))
        for h, x in zip(held, local, strict=True):
            piece = h.intersect(need)
            if piece.empty:
                continue
            value = h.extract(x, piece)
            moved += value.numel()
            need.add_into(buf, piece, value, accumulate=False)
        assert torch.equal(buf, _slice(full, need))  # every element written once, from the right place
    # with a whole (replicated) producer only one copy of each needed element moves
    if src is None and dp[0] == 1:
        assert moved == sum(r.shape(full).numel() for r in _regions(dst, dp[1]))


def _slice(full: torch.Tensor, region: Region) -> torch.Tensor:
    rows = full[region.rows[0] : region.rows[1]]
    return torch.cat([rows[:, a:b] for a, b in region.ranges], dim=DIM)


def test_gradient_pieces_accumulate() -> None:
    lay = SequenceLayout(1, 2, zigzag=True)
    held = Region.whole((0, ROWS), DIM, LENGTH)
    buf = torch.zeros(ROWS, LENGTH, 3)
    for j in range(2):
        need = Region((0, ROWS), DIM, tuple(lay.ranges(LENGTH, j)), LENGTH)
        piece = held.intersect(need)
        held.add_into(buf, piece, torch.ones(need.shape(buf)), accumulate=True)
        held.add_into(buf, piece, torch.ones(need.shape(buf)), accumulate=True)
    assert torch.equal(buf, torch.full_like(buf, 2.0))
