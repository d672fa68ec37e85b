"""The embedded default's trained VAE: the packaged weights, and the training command that rebuilds them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from diffusers import AutoencoderKLWan

from mmpipe.data.shapes import MovingShapesDataset
from mmpipe.models.shapes_vae import CONFIG, load_shapes_vae, psnr_db, reconstruction_psnr, shapes_vae_dir
from mmpipe.models.shapes_vae_train import decode_unclamped, train_shapes_vae, whiten_latents


def test_packaged_vae_reconstructs_held_out_clips() -> None:
    vae = load_shapes_vae()
    assert {k: vae.config[k] for k in CONFIG} == CONFIG
    assert len(vae.config.latents_mean) == len(vae.config.latents_std) == CONFIG["z_dim"]
    # the figure the training command measured and shipped, measured again on the same 16 held-out
    # clips (float reassociation across CPUs moves it by far less than 0.05 dB)
    metrics = json.loads((shapes_vae_dir() / "metrics.json").read_text())
    psnr = reconstruction_psnr(vae)
    assert psnr == pytest.approx(metrics["held_out_psnr_db"], abs=0.05)
    random = AutoencoderKLWan(**CONFIG).eval()
    assert reconstruction_psnr(random, clips=4, frames=5) < psnr - 3.0  # what training bought


def test_unclamped_decode_is_the_decode_before_its_clamp() -> None:
    torch.manual_seed(0)
    vae = AutoencoderKLWan(**CONFIG).eval()
    video = MovingShapesDataset(num_samples=1, frames=5, height=32, width=32, seed=0)[0]["video"][None]
    with torch.no_grad():
        z = vae.encode(video).latent_dist.mode()
        assert torch.equal(decode_unclamped(vae, z).clamp(-1, 1), vae.decode(z).sample)
    assert psnr_db(video, video) > 100


def test_training_command_writes_a_loadable_vae_with_latent_statistics(tmp_path: Path) -> None:
    tiny = {"batch": 1, "train_frames": 1, "frames": 5, "height": 32, "width": 32, "progress": False}
    metrics = train_shapes_vae(tmp_path / "vae", steps=2, **tiny)
    vae = AutoencoderKLWan.from_pretrained(tmp_path / "vae")
    assert len(vae.config.latents_std) == CONFIG["z_dim"] and all(s > 0 for s in vae.config.latents_std)
    saved = json.loads((tmp_path / "vae" / "metrics.json").read_text())
    assert saved == metrics and saved["steps"] == 2
    assert vae.config.is_residual and saved["residual"]  # CONFIG's Wan 2.2 residual blocks
    old = train_shapes_vae(tmp_path / "wan21", steps=1, wan21_blocks=True, **tiny)
    assert not old["residual"] and not AutoencoderKLWan.from_pretrained(tmp_path / "wan21").config.is_residual


def test_whitening_keeps_reconstructions_and_whitens_the_latents() -> None:
    torch.manual_seed(0)
    vae = AutoencoderKLWan(**CONFIG).eval()
    video = torch.cat(
        [MovingShapesDataset(num_samples=4, frames=5, height=32, width=32, seed=1)[i]["video"][None] for i in range(4)]
    )
    with torch.no_grad():
        z = vae.encode(video).latent_dist.mode()
        before = decode_unclamped(vae, z)
        a, m = whiten_latents(vae, z)
        z_white = vae.encode(video).latent_dist.mode()
        after = decode_unclamped(vae, z_white)
    zd = CONFIG["z_dim"]
    # the encoder's new latents are A (z - m), and the decoder undoes it: the same reconstructions
    expect = torch.einsum("yz,bzthw->bythw", a, z - m[None, :, None, None, None])
    assert torch.allclose(z_white, expect, atol=1e-4)
    assert torch.allclose(after, before, atol=1e-4)
    # whitened: zero mean, identity covariance over channels (where the variance is above the floor)
    flat = z_white.transpose(0, 1).reshape(zd, -1).double()
    assert flat.mean(1).abs().max() < 1e-4
    cov = torch.cov(flat)
    assert torch.allclose(cov, torch.eye(zd, dtype=cov.dtype), atol=1e-3)
    assert list(vae.config.latents_mean) == [0.0] * zd and list(vae.config.latents_std) == [1.0] * zd
