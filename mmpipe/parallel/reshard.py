"""Which part of an edge tensor each rank holds or needs, and moving exactly the overlap.

A rank's part of one port's tensor for one micro-batch is a :class:`Region`: the rows of the
micro-batch (dim 0, the data-parallel split) and, for ports a sequence-parallel stage splits, the
token ranges along the port's sequence dim (its share under the stage's
:class:`~mmpipe.parallel.sequence.SequenceLayout`). A local tensor holding a region stores its rows
in order and its ranges concatenated in order along the dim. A transfer from a producer rank to a
consumer rank carries ``intersect(held, needed)``, so a replicated VAE output feeding a DiT split
over 4 ranks sends each of them its quarter, and a 2-way split feeding a 4-way one sends each
consumer rank the pieces of it that each producer rank holds, without gathering anything first.
"""

from __future__ import annotations

import dataclasses

import torch

from mmpipe.parallel.sequence import Range


@dataclasses.dataclass(frozen=True)
class Region:
    """Rows ``[start, stop)`` and, when ``dim`` is set, the ranges along ``dim`` (of ``length`` in all)."""

    rows: Range
    dim: int | None = None
    ranges: tuple[Range, ...] = ()
    length: int = 0

    @classmethod
    def whole(cls, rows: Range, dim: int | None = None, length: int = 0) -> Region:
        """All tokens of ``rows`` (``dim`` set when the other side of the edge splits it)."""
        return cls(rows, dim, ((0, length),) if dim is not None else (), length)

    @property
    def empty(self) -> bool:
        """Whether it holds no element."""
        return self.rows[1] <= self.rows[0] or (self.dim is not None and not self.ranges)

    def size(self) -> int:
        """Tokens along ``dim``."""
        return sum(b - a for a, b in self.ranges)

    def intersect(self, other: Region) -> Region:
        """The part both regions cover (possibly empty)."""
        rows = (max(self.rows[0], other.rows[0]), min(self.rows[1], other.rows[1]))
        if self.dim is None and other.dim is None:
            return Region(rows)
        a, b = (self if self.dim is not None else other), (other if other.dim is not None else self)
        assert b.dim in (None, a.dim), f"ports split along different dims {a.dim} and {b.dim}"
        theirs = b.ranges if b.dim is not None else ((0, a.length),)
        ranges = tuple(
            (max(x0, y0), min(x1, y1)) for x0, x1 in a.ranges for y0, y1 in theirs if max(x0, y0) < min(x1, y1)
        )
        return Region(rows, a.dim, tuple(sorted(ranges)), a.length)

    def _offsets(self, piece: Region) -> list[tuple[int, int]]:
        """``(offset in this region's concatenation, count)`` of each range of ``piece``."""
        out = []
        mine = self.ranges if self.dim is not None else ((0, piece.length),)
        for a, b in piece.ranges:
            offset = 0
            for x0, x1 in mine:
                if x0 <= a and b <= x1:
                    out.append((offset + a - x0, b - a))
                    break
                offset += x1 - x0
            else:
                raise AssertionError(f"range {(a, b)} not inside {self.ranges}")
        return out

    def extract(self, x: torch.Tensor, piece: Region) -> torch.Tensor:
        """The elements of ``piece`` (inside this region) from ``x``, a tensor holding this region."""
        x = x[piece.rows[0] - self.rows[0] : piece.rows[1] - self.rows[0]]
        if piece.dim is None:
            return x
        parts = [x.narrow(piece.dim, o, n) for o, n in self._offsets(piece)]
        if not parts:
            return x.narrow(piece.dim, 0, 0)
        return parts[0] if len(parts) == 1 else torch.cat(parts, piece.dim)

    def add_into(self, buf: torch.Tensor, piece: Region, value: torch.Tensor, *, accumulate: bool) -> None:
        """Write (or add) ``value``, the elements of ``piece``, into ``buf``, a tensor holding this region."""
        rows = buf[piece.rows[0] - self.rows[0] : piece.rows[1] - self.rows[0]]
        if piece.dim is None:
            spans = [(rows, value)]
        else:
            spans, at = [], 0
            for o, n in self._offsets(piece):
                spans.append((rows.narrow(piece.dim, o, n), value.narrow(piece.dim, at, n)))
                at += n
        for dst, src in spans:
            if accumulate:
                dst += src
            else:
                dst.copy_(src)

    def shape(self, like: torch.Tensor) -> torch.Size:
        """The shape of a tensor holding this region, with the other dims of ``like``."""
        shape = list(like.shape)
        shape[0] = self.rows[1] - self.rows[0]
        if self.dim is not None:
            shape[self.dim] = self.size()
        return torch.Size(shape)
