"""Sequence parallel attention: Ulysses, ring and both (2-D), forward and backward, on any process groups.

A stage replica of ``sp = ulysses x ring`` ranks splits its token sequence: ring block ``j`` (ring
rank ``j``) is contiguous for non-causal attention, and for causal attention the *zig-zag* pair of
chunks ``j`` and ``2 ring - 1 - j`` of ``2 ring`` (so every ring rank does the same causal work);
inside a ring block, the ``ulysses`` ranks hold consecutive sub-ranges. The sp index of a rank is
``ring_rank x ulysses + ulysses_rank`` (Ulysses groups are consecutive ranks: their all-to-alls
are the heavier traffic and belong in the fastest domain).

Lengths need not divide anything: splits are floor splits (shares differ by at most one token),
Ulysses pads each shard to the longest for its all-to-all and strips the padding after it, ring
blocks of different lengths merge through their LSEs, and a causal zig-zag split needs no mask
because every token of a chunk precedes every token of a later chunk. Head counts must divide the
Ulysses degree (a ``ValueError`` names both).

- **Ulysses** (DeepSpeed-Ulysses): all-to-all from sequence-split to head-split, local attention on
  the whole sequence for ``heads / ulysses`` heads, all-to-all back; each all-to-all is an autograd
  function whose backward is the inverse all-to-all.
- **Ring**: key/value blocks travel round the ring group with point-to-point ops posted before the
  block's compute (overlapped where the backend is asynchronous); partial outputs merge by LSE. The
  backward re-circulates key/values with their gradient accumulators, which return to their owner
  after a full turn (ring-flash-attention's scheme).
- **2-D**: Ulysses inside, ring across, as USP does.

Legend: B batch, H heads (h: this rank's heads), S this rank's tokens, N a ring block's tokens, D head dim.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh

from mmpipe.parallel.attention import (
    AttentionImpl,
    attention_backward,
    attention_with_lse,
    local_attention,
    masked_attention_backward,
    masked_attention_with_lse,
    select_backend,
)

Range = tuple[int, int]


# ---- layouts ------------------------------------------------------------------------------------
def split_range(length: int, parts: int, index: int) -> Range:
    """Share ``index`` of ``parts`` floor shares of ``range(length)``."""
    return index * length // parts, (index + 1) * length // parts


def ring_block(length: int, ring: int, j: int, *, zigzag: bool) -> list[Range]:
    """The token ranges of ring block ``j``: one contiguous range, or the zig-zag pair of chunks."""
    if not zigzag:
        return [split_range(length, ring, j)]
    return [split_range(length, 2 * ring, j), split_range(length, 2 * ring, 2 * ring - 1 - j)]


def _sub_ranges(ranges: Sequence[Range], lo: int, hi: int) -> list[Range]:
    """Positions ``[lo, hi)`` of the concatenation of ``ranges``, as ranges of the original axis."""
    out, offset = [], 0
    for a, b in ranges:
        s, e = max(a, a + lo - offset), min(b, a + hi - offset)
        if s < e:
            out.append((s, e))
        offset += b - a
    return out


@dataclasses.dataclass(frozen=True)
class SequenceLayout:
    """How a replica of ``ulysses x ring`` ranks splits a sequence (see the module docstring)."""

    ulysses: int = 1
    ring: int = 1
    zigzag: bool = False
    unit: int = 1  # split in whole units of this many tokens (e.g. the tokens of one latent frame)

    @property
    def sp(self) -> int:
        """Ranks per replica."""
        return self.ulysses * self.ring

    def _units(self, length: int) -> int:
        if length % self.unit:
            raise ValueError(f"a sequence of {length} tokens is not a whole number of {self.unit}-token units")
        return length // self.unit

    def _scale(self, ranges: list[Range]) -> list[Range]:
        return [(a * self.unit, b * self.unit) for a, b in ranges if a < b]

    def ring_ranges(self, length: int, j: int) -> list[Range]:
        """The token ranges of ring block ``j`` (both zig-zag chunks, possibly empty ones)."""
        return [
            (a * self.unit, b * self.unit) for a, b in ring_block(self._units(length), self.ring, j, zigzag=self.zigzag)
        ]

    def ranges(self, length: int, index: int) -> list[Range]:
        """The token ranges sp rank ``index`` holds (ascending positions, empty ranges dropped)."""
        j, u = divmod(index, self.ulysses)
        block = ring_block(self._units(length), self.ring, j, zigzag=self.zigzag)
        n = sum(b - a for a, b in block)
        return self._scale(_sub_ranges(block, *split_range(n, self.ulysses, u)))

    def size(self, length: int, index: int) -> int:
        """How many tokens sp rank ``index`` holds."""
        return sum(b - a for a, b in self.ranges(length, index))

    def positions(self, length: int, index: int, device: torch.device | str = "cpu") -> torch.Tensor:
        """The token positions of sp rank ``index``, as an int64 tensor."""
        return torch.cat(
            [torch.arange(a, b, device=device) for a, b in self.ranges(length, index)]
            or [torch.zeros(0, dtype=torch.int64, device=device)]
        )

    def shard(self, x: torch.Tensor, dim: int, index: int) -> torch.Tensor:
        """Sp rank ``index``'s part of the whole ``x`` along ``dim``."""
        pieces = [x.narrow(dim, a, b - a) for a, b in self.ranges(x.shape[dim], index)]
        return torch.cat(pieces, dim) if len(pieces) != 1 else pieces[0]


# ---- the mesh -----------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class SequenceMesh:
    """This rank's place in its sequence-parallel replica and the groups it talks over."""

    layout: SequenceLayout
    index: int
    ulysses_group: dist.ProcessGroup | None
    ring_ranks: tuple[int, ...]  # global ranks of this rank's ring, in ring order
    ring_group: dist.ProcessGroup | None

    @classmethod
    def from_device_mesh(cls, mesh: DeviceMesh, *, zigzag: bool) -> SequenceMesh:
        """From a mesh with dimensions ``("ring", "ulysses")`` (this rank's replica); ``zigzag`` for causal."""
        ring, ulysses = mesh["ring"], mesh["ulysses"]
        layout = SequenceLayout(ulysses.size(), ring.size(), zigzag)
        ring_rank, ulysses_rank = ring.get_local_rank(), ulysses.get_local_rank()
        ring_pg = ring.get_group() if ring.size() > 1 else None
        ring_ranks = tuple(dist.get_process_group_ranks(ring_pg)) if ring_pg is not None else (dist.get_rank(),)
        return cls(
            layout,
            ring_rank * layout.ulysses + ulysses_rank,
            ulysses.get_group() if ulysses.size() > 1 else None,
            ring_ranks,
            ring_pg,
        )

    @property
    def ring_index(self) -> int:
        """This rank's position in its ring."""
        return self.index // self.layout.ulysses

    @property
    def ulysses_index(self) -> int:
        """This rank's position in its Ulysses group."""
        return self.index % self.layout.ulysses

    def with_zigzag(self, zigzag: bool) -> SequenceMesh:
        """The same groups with a causal (zig-zag) or contiguous split."""
        return dataclasses.replace(self, layout=dataclasses.replace(self.layout, zigzag=zigzag))


def check_heads(heads: int, ulysses: int, *, what: str = "attention") -> None:
    """Raise a ``ValueError`` naming both numbers unless ``ulysses`` divides ``heads``."""
    if heads % ulysses:
        raise ValueError(
            f"{what}: {heads} attention heads cannot be split over ulysses={ulysses} ranks "
            f"(the Ulysses degree must divide the head count; use ring parallelism for the rest)"
        )


# ---- Ulysses all-to-all -------------------------------------------------------------------------
def _all_to_all(parts: list[torch.Tensor], group: dist.ProcessGroup | None) -> list[torch.Tensor]:
    """Send ``parts[i]`` to rank ``i`` of ``group``; returns what each rank sent here (equal shapes)."""
    inp = torch.stack(parts).contiguous()
    out = torch.empty_like(inp)
    dist.all_to_all_single(out, inp, group=group)
    return list(out.unbind(0))


def _pad_to(x: torch.Tensor, length: int, dim: int) -> torch.Tensor:
    if x.shape[dim] == length:
        return x
    pad = list(x.shape)
    pad[dim] = length - x.shape[dim]
    return torch.cat([x, x.new_zeros(pad)], dim)


def _seq_to_heads(x_BHSD: torch.Tensor, group: dist.ProcessGroup | None, sizes: Sequence[int]) -> torch.Tensor:
    """``(B, H, S_mine, D) -> (B, H / U, sum(sizes), D)``: gather the sequence, scatter the heads."""
    longest = max(sizes)
    parts = [_pad_to(p, longest, 2) for p in x_BHSD.chunk(len(sizes), dim=1)]
    got = _all_to_all(parts, group)
    return torch.cat([p[:, :, :n] for p, n in zip(got, sizes, strict=True)], dim=2)


def _heads_to_seq(
    x_BhND: torch.Tensor, group: dist.ProcessGroup | None, sizes: Sequence[int], mine: int
) -> torch.Tensor:
    """The inverse of :func:`_seq_to_heads`: ``(B, H / U, sum(sizes), D) -> (B, H, sizes[mine], D)``."""
    longest = max(sizes)
    parts = [_pad_to(p, longest, 2) for p in x_BhND.split(list(sizes), dim=2)]
    got = _all_to_all(parts, group)
    return torch.cat([p[:, :, : sizes[mine]] for p in got], dim=1)


class _SeqToHeads(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, group: dist.ProcessGroup | None, sizes: tuple[int, ...], mine: int
    ) -> torch.Tensor:  # type: ignore[override]
        ctx.group, ctx.sizes, ctx.mine = group, sizes, mine
        return _seq_to_heads(x, group, sizes)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        return _heads_to_seq(grad, ctx.group, ctx.sizes, ctx.mine), None, None, None


class _HeadsToSeq(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, group: dist.ProcessGroup | None, sizes: tuple[int, ...], mine: int
    ) -> torch.Tensor:  # type: ignore[override]
        ctx.group, ctx.sizes = group, sizes
        return _heads_to_seq(x, group, sizes, mine)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        return _seq_to_heads(grad, ctx.group, ctx.sizes), None, None, None


def seq_to_heads(x_BHSD: torch.Tensor, mesh: SequenceMesh, length: int) -> torch.Tensor:
    """Ulysses' first all-to-all (differentiable): this rank's tokens of all heads -> its ring block of
    ``H / ulysses`` heads."""
    lay = mesh.layout
    first = mesh.ring_index * lay.ulysses
    sizes = tuple(lay.size(length, first + u) for u in range(lay.ulysses))
    return _SeqToHeads.apply(x_BHSD, mesh.ulysses_group, sizes, mesh.ulysses_index)


def heads_to_seq(x_BhND: torch.Tensor, mesh: SequenceMesh, length: int) -> torch.Tensor:
    """The inverse of :func:`seq_to_heads` (differentiable)."""
    lay = mesh.layout
    first = mesh.ring_index * lay.ulysses
    sizes = tuple(lay.size(length, first + u) for u in range(lay.ulysses))
    return _HeadsToSeq.apply(x_BhND, mesh.ulysses_group, sizes, mesh.ulysses_index)


# ---- ring attention -----------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class _Ring:
    """One ring's static bookkeeping: block sizes, zig-zag first-chunk sizes, neighbours."""

    ranks: tuple[int, ...]
    group: dist.ProcessGroup | None
    j: int
    sizes: tuple[int, ...]  # tokens of each ring block
    firsts: tuple[int, ...]  # tokens of each block's first zig-zag chunk (== sizes when contiguous)
    causal: bool
    queries: int  # this rank's queries: its block, plus any replicated tail (non-causal only)

    @property
    def n(self) -> int:
        return len(self.ranks)

    def pairs(self, src: int) -> tuple[slice, slice, bool] | None:
        """(query rows, key rows, causal) of this rank's block against block ``src``; ``None``: no work."""
        mine, theirs = self.sizes[self.j], self.sizes[src]
        if not self.causal:
            q, kv, causal = slice(0, self.queries), slice(0, theirs), False
        elif src == self.j:  # the concatenated zig-zag pair is in position order: plain causal
            q, kv, causal = slice(0, mine), slice(0, theirs), True
        elif src < self.j:  # every query follows src's first chunk and precedes its second
            q, kv, causal = slice(0, mine), slice(0, self.firsts[src]), False
        else:  # only this block's second chunk follows (all of) block src
            q, kv, causal = slice(self.firsts[self.j], mine), slice(0, theirs), False
        if q.stop <= q.start or kv.stop <= kv.start:
            return None
        return q, kv, causal


def _make_ring(mesh: SequenceMesh, length: int, causal: bool, tail: int = 0) -> _Ring:
    blocks = [mesh.layout.ring_ranges(length, j) for j in range(mesh.layout.ring)]
    sizes = tuple(sum(b - a for a, b in blk) for blk in blocks)
    return _Ring(
        mesh.ring_ranks,
        mesh.ring_group,
        mesh.ring_index,
        sizes,
        tuple(blk[0][1] - blk[0][0] for blk in blocks),
        causal,
        sizes[mesh.ring_index] + tail,
    )


def _exchange(
    ring: _Ring, tensors: Sequence[torch.Tensor], recv_shapes: Sequence[torch.Size]
) -> tuple[list[dist.Work], list[torch.Tensor]]:
    """Post sends of ``tensors`` to the next rank and receives of ``recv_shapes`` from the previous one."""
    nxt, prev = ring.ranks[(ring.j + 1) % ring.n], ring.ranks[(ring.j - 1) % ring.n]
    bufs = [torch.empty(s, dtype=t.dtype, device=t.device) for s, t in zip(recv_shapes, tensors, strict=True)]
    works = []
    for b in bufs:  # receives posted before sends
        if b.numel():
            works.append(dist.irecv(b, src=prev, group=ring.group))
    for t in tensors:  # contiguous already (the callers' kv and accumulators): the works read them in place
        if t.numel():
            works.append(dist.isend(t, dst=nxt, group=ring.group))
    return [w for w in works if w is not None], bufs


def _prefetch(ring: _Ring, kv: list[torch.Tensor], step: int) -> tuple[list[dist.Work], list[torch.Tensor]]:
    """Post the exchange of the key/value block this rank works on at ``step + 1``; the buffers it
    fills (``kv`` itself after the last step: nothing moves then)."""
    if step + 1 == ring.n:
        return [], kv
    n = ring.sizes[(ring.j - step - 1) % ring.n]
    return _exchange(ring, kv, [_with_len(t.shape, n) for t in kv])


def _wait(works: list[dist.Work]) -> None:
    for w in works:
        w.wait()


def _with_len(shape: torch.Size, n: int) -> torch.Size:
    return torch.Size((*shape[:2], n, *shape[3:]))


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        ring: _Ring,
        impl: AttentionImpl,
        scale: float,
        k_tail: torch.Tensor | None = None,
        v_tail: torch.Tensor | None = None,
        bias_tail: torch.Tensor | None = None,
    ) -> torch.Tensor:
        acc = torch.promote_types(q.dtype, torch.float32)
        out = torch.zeros(q.shape[:3] + v.shape[3:], dtype=acc, device=q.device)
        lse = torch.full(q.shape[:3], float("-inf"), dtype=acc, device=q.device)
        if k_tail is not None:  # the replicated tail's keys: once, on every rank, before the ring turns
            assert v_tail is not None and bias_tail is not None
            out, lse = masked_attention_with_lse(
                q.to(acc), k_tail.to(acc), v_tail.to(acc), bias_tail.to(acc), scale=scale
            )
        kv = [k.contiguous(), v.contiguous()]
        for step in range(ring.n):
            src = (ring.j - step) % ring.n
            works, nxt = _prefetch(ring, kv, step)
            sel = ring.pairs(src)
            if sel is not None:
                qs, ks, causal = sel
                o_b, l_b = attention_with_lse(
                    impl,
                    q[:, :, qs].contiguous(),
                    kv[0][:, :, ks].contiguous(),
                    kv[1][:, :, ks].contiguous(),
                    causal=causal,
                    scale=scale,
                )
                new = torch.logaddexp(lse[:, :, qs], l_b.to(acc))
                out[:, :, qs] = out[:, :, qs] * torch.exp(lse[:, :, qs] - new).unsqueeze(-1) + o_b.to(acc) * torch.exp(
                    l_b.to(acc) - new
                ).unsqueeze(-1)
                lse[:, :, qs] = new
            _wait(works)
            kv = nxt
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse, k_tail, v_tail, bias_tail)
        ctx.ring, ctx.impl, ctx.scale = ring, impl, scale
        return out

    @staticmethod
    def backward(ctx: Any, dout: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        q, k, v, out, lse, k_tail, v_tail, bias_tail = ctx.saved_tensors
        ring, impl, scale = ctx.ring, ctx.impl, ctx.scale
        acc = torch.promote_types(q.dtype, torch.float32)
        dout = dout.contiguous()
        dq = torch.zeros(q.shape, dtype=acc, device=q.device)
        dk_tail = dv_tail = None
        if k_tail is not None:
            dq_t, dk_tail, dv_tail = masked_attention_backward(
                dout.to(acc),
                q.to(acc),
                k_tail.to(acc),
                v_tail.to(acc),
                out.to(acc),
                lse,
                bias_tail.to(acc),
                scale=scale,
            )
            dq += dq_t
            dk_tail, dv_tail = dk_tail.to(k_tail.dtype), dv_tail.to(v_tail.dtype)
        kv = [k.contiguous(), v.contiguous()]
        dkv_works: list[dist.Work] = []
        dkv_in: list[torch.Tensor] = []
        for step in range(ring.n):
            src = (ring.j - step) % ring.n
            kv_works, nxt = _prefetch(ring, kv, step)
            dk = torch.zeros(kv[0].shape, dtype=acc, device=q.device)
            dv = torch.zeros(kv[1].shape, dtype=acc, device=q.device)
            sel = ring.pairs(src)
            if sel is not None:
                qs, ks, causal = sel
                dq_b, dk_b, dv_b = attention_backward(
                    impl,
                    dout[:, :, qs].contiguous(),
                    q[:, :, qs].contiguous(),
                    kv[0][:, :, ks].contiguous(),
                    kv[1][:, :, ks].contiguous(),
                    out[:, :, qs].contiguous(),
                    lse[:, :, qs].contiguous(),
                    causal=causal,
                    scale=scale,
                )
                dq[:, :, qs] += dq_b
                dk[:, :, ks] += dk_b
                dv[:, :, ks] += dv_b
            if step > 0:  # the accumulators of block src, from the ranks it visited before
                _wait(dkv_works)
                dk += dkv_in[0]
                dv += dkv_in[1]
            # Pass block src's accumulators on; after the last step they reach src itself, and this
            # rank receives its own block's complete gradient from the previous rank.
            prev_len = ring.sizes[(ring.j - step - 1) % ring.n]
            dkv_works, dkv_in = _exchange(
                ring, [dk, dv], [_with_len(dk.shape, prev_len), _with_len(dv.shape, prev_len)]
            )
            _wait(kv_works)
            kv = nxt
        _wait(dkv_works)
        dk_own, dv_own = dkv_in
        return dq.to(q.dtype), dk_own.to(k.dtype), dv_own.to(v.dtype), None, None, None, dk_tail, dv_tail, None


# ---- the public entry point ---------------------------------------------------------------------
def sequence_parallel_attention(
    q_BHSD: torch.Tensor,
    k_BHSD: torch.Tensor,
    v_BHSD: torch.Tensor,
    *,
    mesh: SequenceMesh,
    length: int,
    causal: bool = False,
    scale: float | None = None,
    impl: AttentionImpl | None = None,
) -> torch.Tensor:
    """Attention over the whole sequence of ``length`` tokens, given this rank's shard of it.

    ``q/k/v`` hold the tokens ``mesh.layout.ranges(length, mesh.index)`` (with ``zigzag == causal``)
    of all heads; returns the output for the same tokens. Differentiable in ``q``, ``k`` and ``v``.
    """
    lay = mesh.layout
    if lay.zigzag != causal and lay.ring > 1:
        raise ValueError(f"a {'causal' if causal else 'non-causal'} ring needs zigzag={causal} in its layout")
    impl = impl or select_backend(device=q_BHSD.device)
    scale = 1.0 / math.sqrt(q_BHSD.shape[-1]) if scale is None else scale
    if lay.ring > 1 and not impl.returns_lse:
        attention_with_lse(impl, q_BHSD, k_BHSD, v_BHSD, causal=causal, scale=scale)  # raises, naming the backend
    if lay.ulysses > 1:
        check_heads(q_BHSD.shape[1], lay.ulysses)
        check_heads(k_BHSD.shape[1], lay.ulysses, what="attention keys/values")
        if q_BHSD.shape == k_BHSD.shape == v_BHSD.shape:  # one all-to-all for the three (data moves only)
            batch = q_BHSD.shape[0]
            qkv = seq_to_heads(torch.cat([q_BHSD, k_BHSD, v_BHSD]), mesh, length)
            q_BHSD, k_BHSD, v_BHSD = qkv[:batch], qkv[batch : 2 * batch], qkv[2 * batch :]
        else:
            q_BHSD, k_BHSD, v_BHSD = (seq_to_heads(t, mesh, length) for t in (q_BHSD, k_BHSD, v_BHSD))
    if lay.ring > 1:
        out = _RingAttention.apply(q_BHSD, k_BHSD, v_BHSD, _make_ring(mesh, length, causal), impl, scale)
    else:
        out = local_attention(q_BHSD, k_BHSD, v_BHSD, causal=causal, scale=scale, impl=impl)
    return heads_to_seq(out, mesh, length) if lay.ulysses > 1 else out


class _GatherHeads(torch.autograd.Function):
    """All-gather of the heads of a value every rank of the Ulysses group then uses alike; its
    gradient arrives as per-rank shares (each rank's own tokens' use), summed before the slice."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup | None, size: int, mine: int) -> torch.Tensor:  # type: ignore[override]
        parts = [torch.empty_like(x) for _ in range(size)]
        dist.all_gather(parts, x.contiguous(), group=group)
        ctx.group, ctx.mine, ctx.heads = group, mine, x.shape[1]
        return torch.cat(parts, dim=1)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad[:, ctx.mine * ctx.heads : (ctx.mine + 1) * ctx.heads], None, None, None


def joint_sequence_parallel_attention(
    q_BHSD: torch.Tensor,
    k_BHSD: torch.Tensor,
    v_BHSD: torch.Tensor,
    tail_valid_BL: torch.Tensor,
    *,
    mesh: SequenceMesh,
    length: int,
    scale: float | None = None,
    impl: AttentionImpl | None = None,
) -> torch.Tensor:
    """Non-causal attention over a split sequence of ``length`` tokens *plus* a replicated tail of
    ``L`` tokens (text, in joint text-video attention), whose keys ``tail_valid_BL`` marks valid.

    ``q/k/v`` hold this rank's tokens followed by the whole tail (``L = tail_valid_BL.shape[1]``);
    returns the output for the same tokens. The tail's queries see every token and its keys are
    seen by every query; each rank computes the tail's outputs in full (it is short), and their
    gradients arrive as per-rank shares like every replicated value's.
    """
    lay = mesh.layout
    if lay.zigzag:
        raise ValueError("joint attention with a replicated tail is non-causal; the layout must be contiguous")
    impl = impl or select_backend(device=q_BHSD.device)
    scale = 1.0 / math.sqrt(q_BHSD.shape[-1]) if scale is None else scale
    tail = tail_valid_BL.shape[1]
    (qs, qt), (ks, kt), (vs, vt) = (t.split([t.shape[2] - tail, tail], dim=2) for t in (q_BHSD, k_BHSD, v_BHSD))
    if lay.ulysses > 1:
        check_heads(q_BHSD.shape[1], lay.ulysses)
        qs, ks, vs = (seq_to_heads(t, mesh, length) for t in (qs, ks, vs))
        h, u = qs.shape[1], mesh.ulysses_index
        qt, kt, vt = (t[:, u * h : (u + 1) * h] for t in (qt, kt, vt))
    bias_B11L = torch.zeros(tail_valid_BL.shape, dtype=torch.float32, device=q_BHSD.device)
    bias_B11L = bias_B11L.masked_fill(~tail_valid_BL, float("-inf"))[:, None, None, :]
    q_all = torch.cat([qs, qt], dim=2)
    if lay.ring > 1:
        out = _RingAttention.apply(q_all, ks, vs, _make_ring(mesh, length, False, tail), impl, scale, kt, vt, bias_B11L)
    else:
        keys_bias = torch.cat([bias_B11L.new_zeros((*bias_B11L.shape[:3], ks.shape[2])), bias_B11L], dim=-1)
        k_all, v_all = torch.cat([ks, kt], dim=2), torch.cat([vs, vt], dim=2)
        out = F.scaled_dot_product_attention(q_all, k_all, v_all, attn_mask=keys_bias.to(q_all.dtype), scale=scale)
    out_s, out_t = out.split([out.shape[2] - tail, tail], dim=2)
    if lay.ulysses > 1:
        out_s = heads_to_seq(out_s, mesh, length)
        out_t = _GatherHeads.apply(out_t, mesh.ulysses_group, lay.ulysses, mesh.ulysses_index)
    return torch.cat([out_s, out_t], dim=2)


# ---- moving whole tensors between layouts -------------------------------------------------------
class _GatherSeq(torch.autograd.Function):
    """All-gather of a sequence-split tensor; backward keeps this rank's slice of the gradient (what
    follows the gather must be computed identically on every rank of the replica)."""

    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, mesh: SequenceMesh, length: int, dim: int, group: dist.ProcessGroup | None
    ) -> torch.Tensor:  # type: ignore[override]
        lay = mesh.layout
        sizes = [lay.size(length, i) for i in range(lay.sp)]
        longest = max(sizes)
        parts = [torch.empty_like(_pad_to(x.movedim(dim, 2), longest, 2)) for _ in sizes]
        dist.all_gather(parts, _pad_to(x.movedim(dim, 2), longest, 2).contiguous(), group=group)
        full = torch.empty((*parts[0].shape[:2], length, *parts[0].shape[3:]), dtype=x.dtype, device=x.device)
        for i, p in enumerate(parts):
            offset = 0
            for a, b in lay.ranges(length, i):
                full[:, :, a:b] = p[:, :, offset : offset + b - a]
                offset += b - a
        ctx.mesh, ctx.dim = mesh, dim
        return full.movedim(2, dim)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        return ctx.mesh.layout.shard(grad, ctx.dim, ctx.mesh.index), None, None, None, None


def gather_sequence(
    x: torch.Tensor, mesh: SequenceMesh, length: int, *, dim: int, group: dist.ProcessGroup | None
) -> torch.Tensor:
    """The whole sequence on every rank of the replica (``group``: all its ranks), in position order."""
    return _GatherSeq.apply(x, mesh, length, dim, group)
