"""Patch-parallel decoding for Wan's video VAE: each rank decodes a band of rows, exactly.

Splitting by frames needs a halo as long as the decoder's causal receptive field (30-38 latent
frames, :mod:`mmpipe.parallel.vae`), longer than most videos. Splitting by *rows* needs almost none:
every spatial operation of the Wan decoder is local (3x3 convolutions, nearest-exact 2x upsampling,
the per-pixel RMS norm over channels) except the middle block's per-frame self-attention. So, as
xDiT's DistVAE does, each rank of the group runs the unmodified decoder on its band of latent rows
with three hooks installed for the call:

- every convolution with a spatial kernel (``WanCausalConv3d``, the upsamplers' ``Conv2d``) first
  takes ``k // 2`` rows from each neighbouring band (one ``all_gather`` of every band's edge rows;
  zeros beyond the image's edges, the padding the convolution would add) and pads only the width;
- each attention block gathers the whole frame, attends, and keeps its band's rows (the middle
  block's attention runs at the latent resolution: the cheapest place to be whole);
- the causal feature cache needs nothing: each rank caches its own band, and the halo of a
  cached-and-new input is taken after the cache is prepended, exactly as the whole decode pads it.

Band boundaries double with every upsampler, so a band stays a band; the bands' videos are
gathered at the end and every rank returns the whole video. Wan 2.2's residual decoder
(``is_residual=True``) needs no more: its up blocks' shortcut (``DupUp3D``) repeats each pixel's
channels into the 2x2 (x2 in time) pixels it becomes, and the 2.2 VAE's ``unpatchify`` spreads each
pixel's channels over a ``patch_size`` square, both per pixel, so a band's rows map to the
corresponding rows of the output. The result equals ``vae.decode``'s up to float reassociation
(convolutions over a band may block differently than over the whole).

Legend: B batch, Z latent channels, C channels, t/h/w latent frames/rows/columns, T/H/W video's.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any, cast

import torch
import torch.distributed as dist
import torch.nn.functional as F
from diffusers.models.autoencoders.autoencoder_kl_wan import AutoencoderKLWan, WanAttentionBlock, WanCausalConv3d
from torch import nn

from mmpipe.parallel.sequence import split_range


class _Bands:
    """The group's row bands and the exchanges between them."""

    def __init__(self, group: dist.ProcessGroup, rows: int) -> None:
        self.group = group
        self.world, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.rows = [split_range(rows, self.world, r) for r in range(self.world)]  # at the latent rate

    def halo(self, x: torch.Tensor, dim: int, k: int) -> torch.Tensor:
        """``x`` (this rank's band along ``dim``) with ``k`` rows of each neighbour's band on either
        side (zeros at the image's edges)."""
        if k == 0:
            return x
        n = x.shape[dim]
        if n < k:
            raise ValueError(f"a band of {n} rows is thinner than the {k}-row halo its convolution needs")
        edges = torch.stack([x.narrow(dim, 0, k), x.narrow(dim, n - k, k)]).contiguous()
        got = [torch.empty_like(edges) for _ in range(self.world)]
        dist.all_gather(got, edges, group=self.group)
        zeros = torch.zeros_like(edges[0])
        above = got[self.rank - 1][1] if self.rank > 0 else zeros
        below = got[self.rank + 1][0] if self.rank < self.world - 1 else zeros
        return torch.cat([above, x, below], dim)

    def whole(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        """Every band of ``x`` along ``dim``, in order (bands may differ by a row: padded for the gather)."""
        sizes = [b - a for a, b in self.rows]
        scale = x.shape[dim] // sizes[self.rank] if sizes[self.rank] else 1
        sizes = [s * scale for s in sizes]
        longest = max(sizes)
        pad = list(x.shape)
        pad[dim] = longest - x.shape[dim]
        padded = torch.cat([x, x.new_zeros(pad)], dim) if pad[dim] else x
        got = [torch.empty_like(padded) for _ in range(self.world)]
        dist.all_gather(got, padded.contiguous(), group=self.group)
        return torch.cat([g.narrow(dim, 0, s) for g, s in zip(got, sizes, strict=True)], dim)

    def mine(self, whole: torch.Tensor, dim: int, band: int) -> torch.Tensor:
        """This rank's rows of ``whole``, whose band along ``dim`` this rank holds ``band`` rows of."""
        sizes = [b - a for a, b in self.rows]
        scale = band // sizes[self.rank]
        start = sum(sizes[: self.rank]) * scale
        return whole.narrow(dim, start, band)


def _pads(conv: WanCausalConv3d) -> list[int]:
    """The causal conv's F.pad amounts ``(w, w, h, h, 2 t, 0)`` (diffusers keeps them in ``_padding``)."""
    return [int(p) for p in cast(Any, conv)._padding]


def _conv3d_forward(conv: WanCausalConv3d, bands: _Bands) -> Any:
    k = _pads(conv)[2]  # the height padding the whole decode adds: the rows each side needs

    def forward(x: torch.Tensor, cache_x: torch.Tensor | None = None) -> torch.Tensor:
        padding = _pads(conv)
        if cache_x is not None and padding[4] > 0:
            x = torch.cat([cache_x.to(x.device), x], dim=2)
            padding[4] -= cache_x.shape[2]
        x = bands.halo(x, 3, k)
        padding[2] = padding[3] = 0
        return nn.Conv3d.forward(conv, F.pad(x, padding))

    return forward


def _conv2d_forward(conv: nn.Conv2d, bands: _Bands) -> Any:
    k_h, k_w = (int(p) for p in cast(tuple[int, int], conv.padding))

    def forward(x: torch.Tensor) -> torch.Tensor:
        x = F.pad(bands.halo(x, 2, k_h), (k_w, k_w, 0, 0))
        return F.conv2d(x, conv.weight, conv.bias, conv.stride, 0, conv.dilation, conv.groups)

    return forward


def _attention_forward(block: WanAttentionBlock, bands: _Bands) -> Any:
    inner = type(block).forward

    def forward(x_BCthw: torch.Tensor) -> torch.Tensor:
        whole = bands.whole(x_BCthw, 3)
        return bands.mine(inner(block, whole), 3, x_BCthw.shape[3])

    return forward


@contextlib.contextmanager
def _banded(vae: AutoencoderKLWan, bands: _Bands) -> Iterator[None]:
    """The decoder's spatial operations made band-aware for the block (instance ``forward``s)."""
    patched: list[nn.Module] = []
    try:
        for module in vae.decoder.modules():
            if isinstance(module, WanCausalConv3d) and _pads(module)[2] > 0:
                module.forward = _conv3d_forward(module, bands)  # type: ignore[method-assign]
            elif isinstance(module, nn.Conv2d) and module.padding != (0, 0):
                pad = cast(tuple[int, int], module.padding)
                if pad[0] != pad[1] or module.stride != (1, 1):
                    raise ValueError(f"patch-parallel decode: unexpected Conv2d {module} in the decoder")
                module.forward = _conv2d_forward(module, bands)  # type: ignore[method-assign]
            elif isinstance(module, WanAttentionBlock):
                module.forward = _attention_forward(module, bands)  # type: ignore[method-assign]
            else:
                continue
            patched.append(module)
        yield
    finally:
        for module in patched:
            del module.forward


def check_patch_parallel(vae: AutoencoderKLWan) -> None:
    """Refuse a Wan VAE set to decode in tiles (the band split replaces the tiling)."""
    if vae.use_tiling:
        raise ValueError("patch-parallel decode splits rows itself: turn the VAE's tiling off")


def patch_parallel_wan_decode(
    vae: AutoencoderKLWan, z_BZthw: torch.Tensor, group: dist.ProcessGroup | None
) -> torch.Tensor:
    """``vae.decode(z_BZthw).sample`` with its rows split over ``group``'s ranks; every rank passes
    the same whole (de-normalised) latents and gets the whole video. ``None`` or a group of one
    decodes the whole. A band needs at least one latent row per rank."""
    if group is None or dist.get_world_size(group) == 1:
        return vae.decode(z_BZthw, return_dict=False)[0]
    check_patch_parallel(vae)
    bands = _Bands(group, z_BZthw.shape[3])
    if any(b - a < 1 for a, b in bands.rows):
        raise ValueError(
            f"patch-parallel decode: {z_BZthw.shape[3]} latent rows cannot give each of {bands.world} ranks a row"
        )
    a, b = bands.rows[bands.rank]
    with _banded(vae, bands):
        band_BCTHW = vae.decode(z_BZthw[:, :, :, a:b], return_dict=False)[0]
    return bands.whole(band_BCTHW, 3)
