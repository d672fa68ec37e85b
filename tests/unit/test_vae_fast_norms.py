"""stages.vae.fast_cpu_norms: the Wan VAE's RMS norms as a sum of squares on float32 CPU tensors."""

from __future__ import annotations

import copy
import functools

import torch
import torch.nn.functional as F
from diffusers.models.autoencoders.autoencoder_kl_wan import WanRMS_norm

from mmpipe.models.shapes_vae import load_shapes_vae
from stages.vae import WanVAEEncodeStage, fast_cpu_norms


def encode(vae: torch.nn.Module, video: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return vae.encode(video).latent_dist.mode()  # type: ignore[operator]


def test_norm_matches_f_normalize_channel_first_and_last() -> None:
    gen = torch.Generator().manual_seed(0)
    for channel_first, shape in ((True, (2, 24, 3, 8, 8)), (False, (2, 7, 24))):
        norm = WanRMS_norm(24, channel_first=channel_first, images=False, bias=True)
        with torch.no_grad():
            norm.gamma.uniform_(0.5, 1.5, generator=gen)
            norm.bias.uniform_(-0.5, 0.5, generator=gen)  # type: ignore[operator]
        x = torch.randn(shape, generator=gen) * 3
        x[0, ..., 0] = 0.0  # all-zero channel vectors: F.normalize's eps, not a division by zero
        want = norm(x)
        fast_cpu_norms(norm)
        got = norm(x)
        assert isinstance(norm.forward, functools.partial)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        assert torch.isfinite(got).all()
        dim = 1 if channel_first else -1
        expect = F.normalize(x, dim=dim) * norm.scale * norm.gamma + norm.bias
        torch.testing.assert_close(got, expect, rtol=1e-5, atol=1e-6)


def test_encode_within_float32_rounding_and_other_dtypes_untouched() -> None:
    vae = load_shapes_vae()
    video = torch.rand(2, 3, 5, 32, 32, generator=torch.Generator().manual_seed(1)) * 2 - 1
    want = encode(vae, video)
    want64 = encode(copy.deepcopy(vae).double(), video.double())
    fast_cpu_norms(vae)
    fast_cpu_norms(vae)  # again: nothing changes
    norms = [m for m in vae.modules() if isinstance(m, WanRMS_norm)]
    assert norms and all(isinstance(m.forward, functools.partial) for m in norms)
    assert all(not isinstance(m.forward.args[1], functools.partial) for m in norms)  # wrapped once
    torch.testing.assert_close(encode(vae, video), want, rtol=0, atol=1e-5)
    # float64 keeps diffusers' forward, bit for bit (a deep copy keeps the wrapping, rebound)
    fast64 = copy.deepcopy(vae).double()
    assert torch.equal(encode(fast64, video.double()), want64)


def test_the_encode_stage_uses_it() -> None:
    vae = load_shapes_vae()
    video = torch.rand(1, 3, 5, 32, 32, generator=torch.Generator().manual_seed(2)) * 2 - 1
    want = encode(vae, video)
    stage = WanVAEEncodeStage.from_module("vae", vae)
    assert not any(isinstance(m.forward, functools.partial) for m in vae.modules() if isinstance(m, WanRMS_norm))
    with torch.no_grad():
        latents = stage({"video": video})["latents"]  # builds the stage's module: the same VAE
    assert all(isinstance(m.forward, functools.partial) for m in vae.modules() if isinstance(m, WanRMS_norm))
    mean, inv_std = stage._mean_std(want)
    torch.testing.assert_close(latents, (want - mean) * inv_std, rtol=0, atol=1e-4)
