"""The embedded default's VAE: a tiny Wan-architecture VAE trained on the moving-shapes clips.

A DiT trained on the latents of a random VAE learns something, but what it generates decodes to
noise. This VAE (``AutoencoderKLWan`` at a tiny width: 4x temporal and 8x spatial compression to
16 latent channels, as Wan 2.1's, with Wan 2.2's residual down / up blocks, whose pixel-average
shortcuts carry a flat region's colour that Wan 2.1's blocks lose at this width) is trained here
on the procedural moving-shapes clips with Wan's VAE objective minus its perceptual and
adversarial terms (reconstruction, here MSE; a small KL term), then frozen for the DiT. Its weights (under 1 MiB)
ship with the package (``mmpipe/models/weights/shapes_vae``), so ``make run`` needs neither a
download nor the hour and a half this training takes on a 2-core CPU; they are rebuilt
(:mod:`mmpipe.models.shapes_vae_train`) by the three commands of ``docs/cli.md`` (5-frame clips,
continued on 9- and then 17-frame clips; the same seeds and data give the same weights up to float
reassociation across CPUs). The
reconstruction PSNR on held-out clips (a dataset seed never trained on) is measured at the end and
written next to the weights (``metrics.json``); ``mmpipe eval`` measures it again.

Legend: B batch, C channels, T/H/W frames/height/width.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch
from diffusers import AutoencoderKLWan
from torch.utils.data import DataLoader

from mmpipe.data.shapes import MovingShapesDataset

WEIGHTS_DIR = Path(__file__).parent / "weights" / "shapes_vae"
# The architecture: Wan's VAE at base width 8 (Wan: 96), widths x1, x2, x2, x2, with Wan 2.2's
# residual blocks (``is_residual``; benchmarks/RESULTS.md, "What holds the colour and the VAE back").
CONFIG: dict[str, Any] = {
    "base_dim": 8,
    "z_dim": 16,
    "dim_mult": [1, 2, 2, 2],
    "num_res_blocks": 1,
    "temperal_downsample": [False, True, True],
    "is_residual": True,
}
# An ``AutoencoderKLWan``: mypy sees diffusers' lazily imported class without its methods.
WanVAE = Any
TRAIN_SEED, HELD_OUT_SEED = 1, 1_000_003  # dataset seeds: training clips, and clips never trained on


def shapes_vae_dir() -> Path:
    """The packaged weights directory (``AutoencoderKLWan.from_pretrained`` layout)."""
    if not (WEIGHTS_DIR / "config.json").is_file():
        raise FileNotFoundError(
            f"the trained moving-shapes VAE is missing from {WEIGHTS_DIR}; rebuild it with "
            "`python -m mmpipe.models.shapes_vae_train` (the commands are in docs/cli.md)"
        )
    return WEIGHTS_DIR


def load_shapes_vae() -> WanVAE:
    """The trained VAE, in eval mode."""
    return AutoencoderKLWan.from_pretrained(shapes_vae_dir()).eval()


def psnr_db(x: torch.Tensor, y: torch.Tensor) -> float:
    """PSNR of two videos in [-1, 1], on the [0, 1] scale (peak 1)."""
    mse = float(((x.clamp(-1, 1) - y.clamp(-1, 1)) / 2).pow(2).mean())
    return 10 * math.log10(1 / max(mse, 1e-12))


@torch.no_grad()
def reconstruction_psnr(
    vae: WanVAE, *, clips: int = 16, frames: int = 17, height: int = 64, width: int = 64, batch: int = 4
) -> float:
    """Mean PSNR (dB) of ``vae``'s reconstructions (posterior mode) of held-out moving-shapes clips."""
    data = MovingShapesDataset(num_samples=clips, frames=frames, height=height, width=width, seed=HELD_OUT_SEED)
    scores = []
    for sample in DataLoader(data, batch_size=batch):
        x_BCTHW = sample["video"]
        y_BCTHW = vae.decode(vae.encode(x_BCTHW).latent_dist.mode()).sample
        scores += [psnr_db(x, y) for x, y in zip(x_BCTHW, y_BCTHW, strict=True)]
    return sum(scores) / len(scores)
