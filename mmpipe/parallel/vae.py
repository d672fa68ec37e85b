"""Frame-parallel decoding for Wan's causal video VAE (diffusers ``AutoencoderKLWan``).

Each rank of a group decodes a contiguous range of latent frames, preceded by ``halo`` latent frames
that it decodes only as context, drops the halo's video frames and all-gathers the pieces: every rank
returns the whole video, as ``vae.decode(z).sample`` would.

Why a halo, and why it is long. Wan's decoder runs one latent frame at a time, and each causal conv
carries the last two frames of its input over to the next call (``feat_cache``). A decode that starts
at latent frame ``p > 0`` treats ``p`` as the video's first frame: its causal convs see zero padding
instead of cached frames, and its temporal upsamplers take their first-frame path ("Rep": one frame
out, not two; the next two calls skip the cache). A kept video frame comes out the same (up to float
reassociation in ``post_quant_conv``, a 1x1x1 conv over all the frames given) whenever everything it
depends on lies in latent frames ``>= p``, so the halo must span the decoder's causal receptive field
(:func:`wan_decode_receptive_field`). That field is long, because every kernel-3 causal conv reaches
two frames back *at its temporal rate*, and most of the decoder's convs run at one frame per latent
frame: 38 latent frames for Wan 2.1's VAE (``num_res_blocks=2``, also Wan 2.2 A14B's; a residual
``is_residual=True`` decoder of that depth gives 38 too), 30 for the project's tiny and moving-shapes
VAEs (``num_res_blocks=1``). With the exact halo, the decode is exact but saves time only on videos
longer than the field (each rank decodes its share plus a whole field; below ``t = halo`` rank 0
decodes everything).

A shorter ``halo`` gives an approximate decode whose error depends on how fast the weights forget:
the trained moving-shapes VAE (field 30), decoding held-out clips, errs by at most 6e-2 with a halo
of 8, 9e-4 with 12, 5e-5 with 16 and 7e-7 (float32 noise) with 20 (``benchmarks/parallel_vae.py``
prints this curve), while random weights forget far more slowly (the tiny random VAE of the tests still
errs by 1e-1 with a halo of 10). Measure a model's own curve before choosing a short halo.
``halo >= 1`` always: a decode's first latent frame gives one video frame, not four.

Ranges are balanced for the halo: rank 0 has no halo, so it gets ``halo`` more frames than each of
the others and every rank decodes about ``(t + (world - 1) * halo) / world`` latent frames.

Tiling and slicing: ``vae.decode`` is called unchanged on each rank's latent frames, so
``use_slicing`` (per-sample) and ``use_tiling`` (spatial tiles, each decoded frame by frame with the
same causal cache, blended per frame) keep their meaning, and the result equals the tiled (or
sliced) whole decode with the same receptive field. The split is over frames only.

Legend: B batch, Z latent channels, t/h/w latent frames/height/width, C video channels,
T/H/W video frames/height/width.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from diffusers.models.autoencoders.autoencoder_kl_wan import AutoencoderKLWan, WanCausalConv3d, WanResample

from mmpipe.parallel.vae_patch import patch_parallel_wan_decode

Range = tuple[int, int]
# Even an approximate decode needs one latent frame of context: the frame a decode starts at is the
# video's first and gives one video frame instead of ``wan_temporal_factor`` (4).
_HALO_AT_LEAST_ONE = (
    "halo must be >= 1 latent frame (a decode's first latent frame gives 1 video frame, not 4), got {halo}"
)


def _temporal_layers(vae: AutoencoderKLWan) -> list[tuple[int, bool]]:
    """``(frames looked back, doubles the frame rate)`` for each causal conv of the decoder, in the
    order the decoder applies them. ``modules()`` yields them in registration order, which for Wan's
    decoder blocks is the forward order of every module with a temporal extent (attention and
    spatial resampling, registered out of order, mix no frames)."""
    upsamplers = {
        id(m.time_conv) for m in vae.decoder.modules() if isinstance(m, WanResample) and m.mode == "upsample3d"
    }
    layers = []
    for m in vae.decoder.modules():
        if isinstance(m, WanCausalConv3d):
            assert m.stride[0] == 1, "Wan's decoder convs have temporal stride 1"
            layers.append((m.kernel_size[0] - 1, id(m) in upsamplers))
    return layers


def wan_temporal_factor(vae: AutoencoderKLWan) -> int:
    """Video frames per latent frame after the first (which gives one): 2 per temporal upsampler.
    Read from the decoder rather than ``config.scale_factor_temporal``, which a custom config may not
    keep in step with ``temperal_downsample``."""
    return 2 ** sum(doubles for _, doubles in _temporal_layers(vae))


def wan_decode_receptive_field(vae: AutoencoderKLWan) -> int:
    """The number of preceding latent frames that the video frames of one latent frame depend on:
    the halo that makes a frame-split decode exact.

    Derived from the decoder's structure, in the steady state (far from the first frame): start at
    the first video frame of latent frame 0 (the earliest-reaching one, at index 0 of the output
    rate) and walk the causal convs backwards; each moves back ``kernel - 1`` frames at its rate, and
    each temporal upsampler maps output frame ``f`` to input frame ``f // 2`` (both of its output
    frames come from one input frame) after its own conv. The field is minus the latent frame
    reached. The tests confirm it by perturbing one latent frame (in float64): the output changes
    ``receptive_field`` latent frames later and not one frame further.
    """
    frame = 0
    for lookback, doubles in reversed(_temporal_layers(vae)):
        if doubles:
            frame = frame // 2  # floor: frame is negative
        frame -= lookback
    return -frame


def _video_frames(latent_frames: int, factor: int) -> int:
    """Frames that decoding ``latent_frames`` (from a first frame) gives."""
    return 0 if latent_frames == 0 else 1 + factor * (latent_frames - 1)


def plan_frame_ranges(frames: int, world: int, halo: int) -> list[Range]:
    """Contiguous latent-frame ranges, one a rank, balanced so that each rank decodes about as many
    frames, halo included: rank 0 (no halo) gets about ``halo`` more than the others. With ``halo >=
    frames`` rank 0 gets everything (the last rank would have to decode from frame 0 anyway)."""
    if frames < 1 or world < 1 or halo < 0:
        raise ValueError(f"need frames >= 1, world >= 1, halo >= 0; got frames={frames}, world={world}, halo={halo}")
    cuts = [min(frames, (r * frames + (world - r) * halo) // world) for r in range(1, world)]
    bounds = [0, *cuts, frames]
    return [(bounds[r], bounds[r + 1]) for r in range(world)]


def decode_frame_range(vae: AutoencoderKLWan, z_BZthw: torch.Tensor, start: int, stop: int, halo: int) -> torch.Tensor:
    """The video frames of latent frames ``[start, stop)`` of ``vae.decode(z_BZthw).sample``, decoded
    from latent frame ``max(0, start - halo)``: exact when ``halo`` is at least the receptive field,
    and of the right length when it is at least 1. ``(B, C, 0, H, W)`` frames cannot be made without
    decoding, so the range must not be empty."""
    if not 0 <= start < stop <= z_BZthw.shape[2]:
        raise ValueError(f"latent frame range [{start}, {stop}) is empty or outside [0, {z_BZthw.shape[2]})")
    if start > 0 and halo < 1:
        raise ValueError(_HALO_AT_LEAST_ONE.format(halo=halo))
    first = max(0, start - halo)
    video_BCTHW = vae.decode(z_BZthw[:, :, first:stop], return_dict=False)[0]
    skip = _video_frames(start - first, wan_temporal_factor(vae))
    return video_BCTHW[:, :, skip:]


def _all_gather_frames(
    piece_BCTHW: torch.Tensor | None, like: torch.Tensor, lengths: list[int], group: dist.ProcessGroup
) -> torch.Tensor:
    """Every rank's video frames, concatenated in rank order (``lengths``: frames per rank, which
    every rank knows from the plan). ``all_gather`` wants equal shapes, so each piece is zero-padded
    to the longest; a rank without frames cannot know ``(B, C, H, W)`` without decoding, so one small
    gather of the pieces' shapes comes first. ``like`` gives the dtype and device of the buffers."""
    bchw = (0, 0, 0, 0) if piece_BCTHW is None else (*piece_BCTHW.shape[:2], *piece_BCTHW.shape[3:])
    shape_4 = torch.tensor(bchw, dtype=torch.int64, device=like.device)
    shapes_4 = [torch.empty_like(shape_4) for _ in lengths]
    dist.all_gather(shapes_4, shape_4, group=group)
    b, c, h, w = (int(v) for v in torch.stack(shapes_4).amax(0))
    padded_BCTHW = like.new_zeros(b, c, max(lengths), h, w)
    if piece_BCTHW is not None:
        padded_BCTHW[:, :, : piece_BCTHW.shape[2]] = piece_BCTHW
    gathered = [torch.empty_like(padded_BCTHW) for _ in lengths]
    dist.all_gather(gathered, padded_BCTHW, group=group)
    return torch.cat([g[:, :, :n] for g, n in zip(gathered, lengths, strict=True)], dim=2)


def parallel_wan_decode(
    vae: AutoencoderKLWan, z_BZthw: torch.Tensor, group: dist.ProcessGroup | None, *, halo: int | None = None
) -> torch.Tensor:
    """``vae.decode(z_BZthw).sample`` (clamped to [-1, 1] as diffusers does), its latent frames split
    over the ranks of ``group``; every rank passes the same whole ``z_BZthw`` (de-normalised, as
    ``WanPipeline`` passes it) and gets the whole video ``(B, C, T, H, W)``.

    ``halo`` (latent frames decoded as context before each rank's range) defaults to
    :func:`wan_decode_receptive_field`, which makes the result equal to the whole decode up to float
    reassociation; a shorter one trades exactness for less work. ``group=None`` or a group of one
    rank decodes the whole, without collectives. Ranks beyond the number of frames (or, with a long
    halo, all but the first) get no frames and still take part in the gather.
    """
    if z_BZthw.dim() != 5 or z_BZthw.shape[2] < 1:
        raise ValueError(f"latents must be (B, Z, t, h, w) with t >= 1, got shape {tuple(z_BZthw.shape)}")
    if halo is not None and halo < 1:
        raise ValueError(_HALO_AT_LEAST_ONE.format(halo=halo))
    if group is None or dist.get_world_size(group) == 1:
        return vae.decode(z_BZthw, return_dict=False)[0]
    halo = wan_decode_receptive_field(vae) if halo is None else halo
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    ranges = plan_frame_ranges(z_BZthw.shape[2], world, halo)
    factor = wan_temporal_factor(vae)
    # every rank's share of the video: latent frame 0 gives 1 frame, every later one ``factor``
    lengths = [_video_frames(stop, factor) - _video_frames(start, factor) for start, stop in ranges]
    start, stop = ranges[rank]
    piece_BCTHW = decode_frame_range(vae, z_BZthw, start, stop, halo) if stop > start else None
    return _all_gather_frames(piece_BCTHW, z_BZthw, lengths, group)


#: how a parallel decode splits a video: row bands (exact, :mod:`mmpipe.parallel.vae_patch`) or
#: latent frames (exact with the whole receptive field as halo, approximate with less)
DECODE_SPLITS = ("rows", "frames")


def split_wan_decode(
    vae: AutoencoderKLWan,
    z_BZthw: torch.Tensor,
    group: dist.ProcessGroup | None,
    *,
    split: str = "rows",
    halo: int | None = None,
) -> torch.Tensor:
    """``vae.decode(z_BZthw).sample`` over ``group``'s ranks, split by ``split`` (``halo``: frames only)."""
    if split == "rows":
        if halo is not None:
            raise ValueError(f"halo={halo}: a split by rows needs no halo (it exchanges one row per convolution)")
        return patch_parallel_wan_decode(vae, z_BZthw, group)
    if split == "frames":
        return parallel_wan_decode(vae, z_BZthw, group, halo=halo)
    raise ValueError(f"split={split!r}: expected one of {list(DECODE_SPLITS)}")
