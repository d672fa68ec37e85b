"""Frame-parallel Wan VAE decode (``mmpipe.parallel.vae``) on 2 and 3 gloo processes against the
single-process ``vae.decode(z).sample``; the decoder's causal receptive field against a perturbation;
the frame plan; bad input.

Every kept video frame is computed by the same ops on the same inputs as in the whole decode (one
latent frame per decoder call, two-frame caches), with one exception: ``post_quant_conv``, a 1x1x1
conv over all the frames a call is given, which the CPU kernel may block differently for a different
frame count (observed: bitwise equal for the long ranges, 1.3e-7 where a rank decodes one latent
frame alone). Hence a float32 tolerance of 2e-6, an order above that, while a misplaced frame or a
short halo errs by ~1e-1. A halo one latent frame short of the field errs by only ~2e-7 in float32
with these weights, below that tolerance, so the field's exact end is tested in float64 (where
reassociation is ~1e-16 and one frame short errs by ~1e-9).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from diffusers import AutoencoderKLWan
from workers import run_workers

from mmpipe.parallel.vae import (
    decode_frame_range,
    parallel_wan_decode,
    plan_frame_ranges,
    wan_decode_receptive_field,
    wan_temporal_factor,
)

# build_tiny_wan_pipeline's random VAE (vae_base_dim=4): Wan 2.1's block structure at width 4.
TINY = {"base_dim": 4, "z_dim": 16, "dim_mult": [1, 1, 1, 1], "num_res_blocks": 1}
# By hand for TINY, walking back from video frame 0 of a latent frame, in frame indices at each rate
# (num_res_blocks=1: 2 resnets = 4 kernel-3 convs an up block, each reaching 2 frames back): at 4
# frames a latent frame, conv_out 2 + up blocks 3 and 2 16 reach frame -18, i.e. frame -9 at 2 frames
# a latent frame; up block 1's upsampler conv 2 + its resnets 8 reach -19, i.e. latent frame -10;
# there, up block 0's upsampler conv 2 + resnets 8 + the mid block's 2 resnets 8 + conv_in 2 add 20.
TINY_FIELD = 30
H, W = 2, 3  # latent height and width: non-square (video 16 x 24)


def _vae(dtype: torch.dtype = torch.float32, **overrides: Any) -> AutoencoderKLWan:
    """TINY with the same random weights in every process; ``overrides`` change its config (e.g.
    ``is_residual=True``: Wan 2.2's residual up blocks)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        vae = AutoencoderKLWan(**(TINY | overrides), latents_mean=[0.0] * 16, latents_std=[1.0] * 16)
    # nn.Module's own cast: ModelMixin.to(dtype) logs a warning about fp32-kept modules (Wan has none)
    return vae.eval().type(dtype)


def _latents(frames: int, dtype: torch.dtype = torch.float32, size: tuple[int, int] = (H, W)) -> torch.Tensor:
    gen = torch.Generator().manual_seed(frames)
    return torch.randn(1, 16, frames, *size, generator=gen).to(dtype)


# (latent frames, halo; None: the receptive field). 5 and 9 (17 and 33 video frames) are shorter than
# the field, so the balanced plan gives every frame to rank 0 and the others gather nothing; 67 is long
# enough that later ranks start past frame 0 and decode a real halo (2 ranks: [0, 48) [48, 67) from 18;
# 3 ranks: [0, 42) [42, 54) [54, 67) from 12 and 24); 2 frames: more ranks than frames (halo 1 leaves
# rank 1 of 3 empty).
EXACT_CASES = [(5, None), (9, None), (67, None), (2, None), (2, 1)]
SHORT_HALO = (67, 4)
SUBGROUP = (67, -2)  # a label, not a halo: the exact decode on the group of global ranks 1 and 2


@torch.inference_mode()
def _decode_cases(rank: int, world: int) -> list[tuple[tuple[int, int | None], bool, float]]:
    vae = _vae()
    results, wants = [], {}
    for frames, halo in [*EXACT_CASES, SHORT_HALO]:
        z = _latents(frames)
        if frames not in wants:
            wants[frames] = vae.decode(z).sample
        want = wants[frames]
        got = parallel_wan_decode(vae, z, dist.group.WORLD, halo=halo)
        results.append(((frames, halo), got.shape == want.shape, float((got - want).abs().max())))
    if world == 3:  # a subgroup without global rank 0: ranks in the group, not global ranks, pick ranges
        sub = dist.new_group([1, 2])  # collective: every rank calls it
        if rank > 0:
            got, want = parallel_wan_decode(vae, _latents(67), sub), wants[67]
            results.append((SUBGROUP, got.shape == want.shape, float((got - want).abs().max())))
    return results


@pytest.mark.parametrize("world", [2, 3])
def test_parallel_decode_matches_whole_decode(world: int) -> None:
    results = run_workers(_decode_cases, world)
    for rank, rank_results in enumerate(results):
        errors = {case: err for case, _, err in rank_results}
        assert all(same_shape for _, same_shape, _ in rank_results), f"rank {rank}: shapes differ: {rank_results}"
        for case in EXACT_CASES + ([SUBGROUP] if world == 3 and rank > 0 else []):
            assert errors[case] <= 2e-6, f"rank {rank}, (frames, halo) = {case}: max error {errors[case]}"
        # a halo far short of the field (4 of 30 latent frames) is visibly wrong: the halo matters
        assert errors[SHORT_HALO] > 1e-2, f"rank {rank}: halo {SHORT_HALO[1]} error only {errors[SHORT_HALO]}"


def test_receptive_field_from_the_config() -> None:
    with torch.device("meta"):  # structure only: no weights allocated
        tiny, wan21 = _vae(), AutoencoderKLWan()  # diffusers' defaults are Wan 2.1's VAE
        residual = _vae(is_residual=True)
    assert (wan_decode_receptive_field(tiny), wan_temporal_factor(tiny)) == (TINY_FIELD, 4)
    # the residual blocks' shortcuts skip convs: the longest path, and so the field, is the same
    assert (wan_decode_receptive_field(residual), wan_temporal_factor(residual)) == (TINY_FIELD, 4)
    # Wan 2.1 (num_res_blocks=2, 6 convs an up block): 26 frames at rate 4, 14 at rate 2, 24 at rate 1
    assert (wan_decode_receptive_field(wan21), wan_temporal_factor(wan21)) == (38, 4)


@pytest.mark.parametrize("residual", [False, True], ids=["wan21-blocks", "residual-blocks"])
@torch.inference_mode()
def test_receptive_field_matches_a_perturbation(residual: bool) -> None:
    """In float64, so that the far end of the field (an effect of ~1e-9) cannot round away: a change
    to latent frame k moves the video frames of latent frame k + field and leaves those after it
    bitwise alone (same shapes, same kernels); a decode whose halo is the field matches the whole
    decode to float64 reassociation, one a frame short does not. Also for Wan 2.2's residual
    decoder, whose first chunk drops its shortcut's first frame (``DupUp3D(first_chunk=True)``) as
    a range decoded from a later latent frame does."""
    vae, k = _vae(torch.float64, is_residual=residual), 2
    field = wan_decode_receptive_field(vae)
    z = _latents(k + field + 2, torch.float64, size=(1, 2))  # 1 x 2 latent pixels: float64 convs are slow
    moved = z.clone()
    moved[:, :, k] += 1.0
    whole, changed = vae.decode(z).sample, vae.decode(moved).sample
    per_latent = (whole - changed).abs().amax(dim=(0, 1, 3, 4))[1:].view(-1, 4).amax(1)  # latent frames 1..
    assert per_latent[k + field - 1] > 0 and per_latent[k + field :].eq(0).all(), per_latent[k + field - 2 :]

    start = z.shape[2] - 1  # the last latent frame, decoded from start - halo > 0
    tail = whole[:, :, 1 + 4 * (start - 1) :]
    exact, short = (
        float((decode_frame_range(vae, z, start, z.shape[2], h) - tail).abs().max()) for h in (field, field - 1)
    )
    assert exact < 1e-13 < 1e-11 < short, (exact, short)


@torch.inference_mode()
def test_tiled_vae_splits_exactly() -> None:
    """With tiling on, a frame range with the full halo equals the tiled whole decode (each tile runs
    the same causal frame loop; blending is per frame)."""
    vae = _vae()
    # tiles of 2 x 2 latent pixels every 1: 2 x 3 overlapping tiles over the 2 x 3 latent, blended
    vae.enable_tiling(
        tile_sample_min_height=16, tile_sample_min_width=16, tile_sample_stride_height=8, tile_sample_stride_width=8
    )
    z = _latents(TINY_FIELD + 3)
    start = z.shape[2] - 2
    whole = vae.decode(z).sample
    assert torch.equal(decode_frame_range(vae, z, start, z.shape[2], TINY_FIELD), whole[:, :, 1 + 4 * (start - 1) :])


def test_plan_covers_every_frame_once_and_balances_the_halo() -> None:
    for frames, world, halo in [(67, 3, 30), (9, 2, 30), (2, 3, 0), (21, 8, 4), (100, 4, 0)]:
        ranges = plan_frame_ranges(frames, world, halo)
        assert ranges[0][0] == 0 and ranges[-1][1] == frames
        assert all(a[1] == b[0] and a[0] <= a[1] for a, b in zip(ranges, ranges[1:], strict=False))
        decoded = [stop - max(0, start - halo) for start, stop in ranges if stop > start]
        assert max(decoded) - min(decoded) <= 1 or frames <= halo, (frames, world, halo, ranges)
    assert plan_frame_ranges(9, 2, 30) == [(0, 9), (9, 9)]  # the last rank would decode from 0 anyway
    assert plan_frame_ranges(67, 2, 30) == [(0, 48), (48, 67)]  # both decode 48 and 49 latent frames


def test_bad_input_names_the_value() -> None:
    vae, z = _vae(), _latents(3)
    for halo in (-1, 0):  # even an approximate decode needs 1 frame of context to give 4 video frames a latent frame
        with pytest.raises(ValueError, match=rf"halo must be >= 1 latent frame .*, got {halo}$"):
            parallel_wan_decode(vae, z, None, halo=halo)
    with pytest.raises(ValueError, match="got 0$"):
        decode_frame_range(vae, z, 1, 3, 0)
    with pytest.raises(ValueError, match=r"\(16, 3, 2, 3\)"):
        parallel_wan_decode(vae, z[0], None)
    with pytest.raises(ValueError, match=r"\[2, 5\)"):
        decode_frame_range(vae, z, 2, 5, 0)
    with pytest.raises(ValueError, match="world=0"):
        plan_frame_ranges(3, 0, 0)
    with torch.inference_mode():
        assert torch.equal(parallel_wan_decode(vae, z, None), vae.decode(z).sample)  # no group: the plain decode


# ---- patch (row band) parallel decode: mmpipe.parallel.vae_patch -------------------------------
def _patch_vae(kind: str) -> AutoencoderKLWan:
    """``tiny``: TINY (Wan 2.1 blocks); ``shapes``: the packaged moving-shapes VAE; ``residual``:
    TINY with Wan 2.2's residual up blocks (``DupUp3D`` shortcuts); ``residual-patch``: that with
    the 2.2 VAE's 2x2 ``unpatchify`` of 12 output channels, as Wan2.2-TI2V-5B's VAE is laid out."""
    from mmpipe.models.shapes_vae import load_shapes_vae

    if kind == "shapes":
        return load_shapes_vae()
    residual_patch = {"patch_size": 2, "in_channels": 12, "out_channels": 12, "scale_factor_spatial": 16}
    overrides = {
        "tiny": {},
        "residual": {"is_residual": True},
        "residual-patch": {"is_residual": True, **residual_patch},
    }
    return _vae(**overrides[kind])


def _patch_worker(rank: int, world: int, z: torch.Tensor, kind: str) -> torch.Tensor:
    from mmpipe.parallel.vae_patch import patch_parallel_wan_decode

    torch.set_num_threads(1)
    vae = _patch_vae(kind)
    with torch.no_grad():
        return patch_parallel_wan_decode(vae, z, dist.new_group(list(range(world))))


@pytest.mark.parametrize(
    ("world", "rows", "kind"),
    [
        (2, 5, "tiny"),
        (3, 7, "tiny"),
        (2, 16, "shapes"),
        (3, 16, "shapes"),
        (2, 5, "residual"),
        (3, 7, "residual-patch"),
    ],
    ids=[
        "tiny-2ranks-odd-rows",
        "tiny-3ranks",
        "shapes-vae-2ranks",
        "shapes-vae-3ranks",
        "residual-2ranks-odd-rows",
        "residual-patch-3ranks",
    ],
)
def test_patch_parallel_decode_matches_whole(world: int, rows: int, kind: str) -> None:
    """Bands of rows (unequal where the rows do not divide) with one-row halos per convolution and
    the attention over the whole frame: the whole decode up to float reassociation (observed 0 to
    1e-6), while a missing halo row or a misplaced band errs by ~1e-1. Wan 2.2's residual decoder
    (its ``DupUp3D`` shortcuts, and its ``unpatchify`` where the VAE has a ``patch_size``) needs no
    more than Wan 2.1's: both are per pixel."""
    z = torch.randn(1, 16, 3, rows, 6, generator=torch.Generator().manual_seed(rows))
    vae = _patch_vae(kind)
    with torch.no_grad():
        whole = vae.decode(z, return_dict=False)[0]
    for rank, got in enumerate(run_workers(_patch_worker, world, z, kind)):
        assert got.shape == whole.shape
        torch.testing.assert_close(got, whole, rtol=0, atol=1e-5, msg=f"rank {rank}")


def test_patch_parallel_refuses_too_few_rows() -> None:
    with pytest.raises(AssertionError, match="cannot give each of 3 ranks a row"):
        run_workers(_patch_worker, 3, torch.randn(1, 16, 2, 2, 3), "tiny")
