"""Rotary position embedding over 3-D (frame, height, width) token positions, as the Wan DiT applies it.

Wan splits each head's channels into a time, a height and a width part (``t = D - 4 (D // 6)``,
``h = w = 2 (D // 6)`` channels) and rotates consecutive channel pairs ``(x[2i], x[2i + 1])`` by
``position * theta ** (-2j / part)``, with the token's frame, row or column as the position for
its part (diffusers' ``WanRotaryPosEmbed`` + ``apply_rotary_emb``). Eager PyTorch materialises
``(S, D)`` cosine and sine tables and runs six elementwise kernels per tensor; the Triton kernel
reads each token's cosines and sines from ``(F + H + W, D / 2)`` tables (one row per frame, row and
column of the grid, angles in float64) by its index in the ``(F, H, W)`` grid and rotates a tile of
a few tokens' heads in one read and one write, each head's channels as one contiguous run (vector
loads; the pairs are split in registers). The backward is the inverse rotation.

``token_offset`` is the index of the first token of ``x`` in the whole grid (a sequence-parallel
rank holding frames ``f0 ..`` passes ``f0 * H * W``).

Legend: B batch, S tokens, N heads, D head dim.
"""

from __future__ import annotations

import functools

import torch

from mmpipe.kernels._triton import AVAILABLE, can_run, output_like

if AVAILABLE:
    import triton
    import triton.language as tl

    @triton.jit
    def _rope3d_kernel(
        x_ptr, out_ptr, cos_ptr, sin_ptr, axis_ptr,
        R, S, N, GF, GH, GW, token_offset,
        HALF: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_P: tl.constexpr,
        INVERSE: tl.constexpr,
    ):  # fmt: skip
        # BLOCK_S tokens (rows of the flattened batch) x BLOCK_N heads, every channel of each
        rows = tl.program_id(0).to(tl.int64) * BLOCK_S + tl.arange(0, BLOCK_S)  # row * N * D passes 2**31
        rmask = rows < R
        g = rows % S + token_offset
        f = g // (GH * GW)
        h = (g // GW) % GH
        w = g % GW
        p = tl.arange(0, BLOCK_P)
        pmask = p < HALF
        axis = tl.load(axis_ptr + p, mask=pmask, other=0)[None, :]
        # the table row of each channel pair's coordinate: frames, then rows, then columns
        trow = tl.where(axis == 0, f[:, None], tl.where(axis == 1, GF + h[:, None], GF + GH + w[:, None]))
        tmask = rmask[:, None] & pmask[None, :]
        cos = tl.load(cos_ptr + trow * HALF + p[None, :], mask=tmask, other=1.0)[:, None, :]  # the acc dtype
        sin = tl.load(sin_ptr + trow * HALF + p[None, :], mask=tmask, other=0.0)[:, None, :]
        if INVERSE:
            sin = -sin
        n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        d = tl.arange(0, 2 * BLOCK_P)  # channels, read as one contiguous run per head (vector loads)
        offs = rows[:, None, None] * N * 2 * HALF + n[None, :, None] * 2 * HALF + d[None, None, :]
        mask = rmask[:, None, None] & (n < N)[None, :, None] & (d < 2 * HALF)[None, None, :]
        x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(cos.dtype)
        x1, x2 = tl.split(tl.reshape(x, (BLOCK_S, BLOCK_N, BLOCK_P, 2)))  # the pairs (x[2i], x[2i + 1])
        y = tl.join(x1 * cos - x2 * sin, x1 * sin + x2 * cos)
        tl.store(out_ptr + offs, tl.reshape(y, (BLOCK_S, BLOCK_N, 2 * BLOCK_P)).to(out_ptr.dtype.element_ty), mask=mask)


TILE = 4096
"""Elements of ``x`` a program rotates (a few tokens' heads): 8 KiB in 16-bit, 32 a thread in its four
warps (four 16-byte loads and stores a thread in 16-bit)."""


def head_block(heads: int) -> int:
    """Heads a program takes: the largest power of two up to 16 that pads ``heads`` by at most an
    eighth (40 -> 8: five exact blocks, where one block of 64 would leave 37 % of the lanes idle)."""
    for b in (16, 8, 4, 2):
        if b < 2 * heads and 8 * (-(-heads // b) * b - heads) <= heads:
            return b
    return 1


@functools.cache
def _tables(head_dim: int, theta: float, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Per channel pair: its inverse frequency (float64) and the grid axis (0 frame, 1 row, 2 column)."""
    if head_dim % 2:
        raise ValueError(f"rope3d needs an even head dim, got {head_dim}")
    h_dim = w_dim = 2 * (head_dim // 6)
    t_dim = head_dim - h_dim - w_dim
    inv, axis = [], []
    for a, dim in enumerate((t_dim, h_dim, w_dim)):
        j = torch.arange(0, dim, 2, dtype=torch.float64)[: dim // 2]
        inv.append(1.0 / (theta ** (j / dim)))
        axis.append(torch.full((dim // 2,), a, dtype=torch.int32))
    return torch.cat(inv).to(device), torch.cat(axis).to(device)


@functools.lru_cache(maxsize=64)
def _trig_tables(
    head_dim: int, theta: float, grid: tuple[int, int, int], acc: torch.dtype, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Cosines and sines ``(F + H + W, D / 2)`` in ``acc``: row ``c`` of the frame, row and column
    blocks holds ``c * inv_freq`` for every channel pair (a pair reads the block of its axis).

    The angles are the reference's float64 products and the rounding to ``acc`` is the same, so the
    kernel's rotations equal eager PyTorch's (and diffusers') bit for bit; computing ``cos`` and
    ``sin`` once per grid coordinate instead of per token keeps float64 trigonometry out of the kernel
    (Triton 3.6 spilled ~1 KB a thread on it at sm_90, ``python -m mmpipe.kernels.aot``)."""
    inv, _ = _tables(head_dim, theta, device)
    pos = torch.cat([torch.arange(n, dtype=torch.float64, device=device) for n in grid])
    angle = pos[:, None] * inv[None, :]
    return angle.cos().to(acc), angle.sin().to(acc)


def rope3d_reference(
    x_BSND: torch.Tensor, grid: tuple[int, int, int], *, theta: float = 10000.0, token_offset: int = 0
) -> torch.Tensor:
    """Plain PyTorch: the angles in float64, the rotation in float32 (float64 for float64 inputs)."""
    _, S, _, D = x_BSND.shape
    inv, axis = _tables(D, theta, x_BSND.device)
    g = torch.arange(token_offset, token_offset + S, device=x_BSND.device)
    _, gh, gw = grid
    pos_S3 = torch.stack([g // (gh * gw), (g // gw) % gh, g % gw], dim=-1).to(torch.float64)
    angle_SP = pos_S3[:, axis.long()] * inv
    acc = torch.float64 if x_BSND.dtype == torch.float64 else torch.float32
    cos, sin = angle_SP.cos().to(acc)[None, :, None], angle_SP.sin().to(acc)[None, :, None]
    x1, x2 = x_BSND.to(acc).unflatten(-1, (-1, 2)).unbind(-1)
    return torch.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).flatten(-2).to(x_BSND.dtype)


@torch.library.custom_op("mmpipe::rope3d", mutates_args=())
def _rope3d(x: torch.Tensor, gh: int, gw: int, token_offset: int, theta: float, inverse: bool) -> torch.Tensor:
    if not can_run(x):
        raise RuntimeError("rope3d's Triton kernel needs CUDA tensors (or TRITON_INTERPRET=1 on CPU)")
    B, S, N, D = x.shape
    x = x.contiguous()
    out = output_like(x)  # poisoned in tests: an element the kernel misses stays NaN
    if x.numel():
        frames = (token_offset + S - 1) // (gh * gw) + 1
        acc = torch.float64 if x.dtype == torch.float64 else torch.float32
        cos, sin = _trig_tables(D, theta, (frames, gh, gw), acc, x.device)
        _, axis = _tables(D, theta, x.device)
        block_n, block_p = head_block(N), triton.next_power_of_2(D // 2)
        block_s = max(1, TILE // (block_n * 2 * block_p))
        grid = (triton.cdiv(B * S, block_s), triton.cdiv(N, block_n))
        _rope3d_kernel[grid](
            x, out, cos, sin, axis, B * S, S, N, frames, gh, gw, token_offset,
            HALF=D // 2, BLOCK_S=block_s, BLOCK_N=block_n, BLOCK_P=block_p, INVERSE=inverse,
            num_warps=4,
        )  # fmt: skip
    return out


@_rope3d.register_fake
def _(x, gh, gw, token_offset, theta, inverse):  # type: ignore[no-untyped-def]
    return torch.empty_like(x)


def _setup(ctx, inputs, output) -> None:  # type: ignore[no-untyped-def]
    _, ctx.gh, ctx.gw, ctx.token_offset, ctx.theta, ctx.inverse = inputs


def _backward(ctx, dout):  # type: ignore[no-untyped-def]
    # a rotation's transpose is the opposite rotation
    return _rope3d(dout, ctx.gh, ctx.gw, ctx.token_offset, ctx.theta, not ctx.inverse), None, None, None, None, None


_rope3d.register_autograd(_backward, setup_context=_setup)


def rope3d(
    x_BSND: torch.Tensor, grid: tuple[int, int, int], *, theta: float = 10000.0, token_offset: int = 0
) -> torch.Tensor:
    """Rotate ``x`` (``B, S, heads, D``) by its tokens' 3-D positions in the ``(F, H, W)`` ``grid``."""
    if x_BSND.ndim != 4:
        raise ValueError(f"rope3d expects x of shape (B, S, heads, D), got {tuple(x_BSND.shape)}")
    f, gh, gw = grid
    if token_offset + x_BSND.shape[1] > f * gh * gw:
        raise ValueError(
            f"rope3d: tokens {token_offset}..{token_offset + x_BSND.shape[1]} exceed the grid {grid} ({f * gh * gw})"
        )
    return _rope3d(x_BSND, gh, gw, token_offset, theta, False)
