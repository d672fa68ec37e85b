"""Train the embedded default's VAE (:mod:`mmpipe.models.shapes_vae`) on the moving-shapes clips::

    python -m mmpipe.models.shapes_vae_train --out mmpipe/models/weights/shapes_vae

(a first run from scratch; the shipped weights are that run continued on longer clips with
``--init``: the three commands are in ``docs/cli.md``).

Legend: B batch, C channels, Z latent channels, T/H/W frames/height/width, t/h/w latent ones.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path
from typing import Any

import torch
from diffusers import AutoencoderKLWan
from torch.utils.data import DataLoader

from mmpipe.data.shapes import MovingShapesDataset
from mmpipe.models.shapes_vae import (
    CONFIG,
    TRAIN_SEED,
    WEIGHTS_DIR,
    WanVAE,
    reconstruction_psnr,
)

KL_WEIGHT = 1e-6  # Wan's VAE recipe keeps the KL term small next to reconstruction
LATENT_NOISE = 0.05  # around the posterior's mode: the decoder learns to tolerate latents slightly off it


def train_shapes_vae(
    out: Path,
    *,
    steps: int = 4000,
    batch: int = 4,
    lr: float = 2e-3,
    train_frames: int = 5,
    frames: int = 17,
    height: int = 64,
    width: int = 64,
    seed: int = 0,
    init: Path | None = None,
    data_seed: int = TRAIN_SEED,
    wan21_blocks: bool = False,
    progress: bool = True,
) -> dict[str, Any]:
    """Train the VAE from ``seed`` (or continue from the weights in ``init``) on ``train_frames``-frame
    clips of dataset seed ``data_seed``, save it to ``out`` with its PSNR on held-out
    ``frames``-frame clips; return the metrics. ``wan21_blocks``: Wan 2.1's down / up blocks instead
    of :data:`CONFIG`'s residual ones (the previously shipped architecture, for comparison)."""
    torch.manual_seed(seed)
    vae: WanVAE = (
        AutoencoderKLWan.from_pretrained(init)
        if init is not None
        else AutoencoderKLWan(**(CONFIG | ({"is_residual": False} if wan21_blocks else {})))
    )
    # Clips of 1 + 4 frames: the encoder's first-frame path and one 4-frame chunk of its causal
    # cache, as every longer clip is processed (chunk by chunk), at a third of 17 frames' cost.
    data = MovingShapesDataset(
        num_samples=steps * batch, frames=train_frames, height=height, width=width, seed=data_seed
    )
    loader = DataLoader(data, batch_size=batch, shuffle=False)
    opt = torch.optim.AdamW(vae.parameters(), lr=lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=steps, pct_start=0.05)
    gen = torch.Generator().manual_seed(seed)
    start = time.perf_counter()
    vae.train()
    for step, sample in enumerate(loader, 1):
        x_BCTHW = sample["video"]
        posterior = vae.encode(x_BCTHW).latent_dist
        # The pipeline encodes with the posterior's mode and decodes what the DiT denoised: train
        # on the mode, with a little noise so that the decoder tolerates latents slightly off it
        # (sampling at the initial posterior's unit variance drowns what the encoder says early on).
        z = posterior.mode() + LATENT_NOISE * torch.randn(posterior.mean.shape, generator=gen)
        y_BCTHW = decode_unclamped(vae, z)
        err = y_BCTHW - x_BCTHW
        # MSE, not Wan's L1: L1's optimum on these mostly-background frames is the background
        # everywhere, a plateau this small network stays on for hundreds of steps (measured)
        loss = err.pow(2).mean() + KL_WEIGHT * posterior.kl().mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(vae.parameters(), 1.0)
        opt.step()
        sched.step()
        if progress and (step % 50 == 0 or step == steps):
            psnr = 10 * math.log10(4 / max(float(err.detach().pow(2).mean()), 1e-12))
            print(
                f"step {step}/{steps}  loss {loss.item():.4f}  train psnr {psnr:.1f} dB  "
                f"{time.perf_counter() - start:.0f} s",
                flush=True,
            )
    vae.eval()
    set_latent_statistics(vae, height=height, width=width, frames=frames)
    metrics = {
        "held_out_psnr_db": round(reconstruction_psnr(vae, frames=frames, height=height, width=width), 2),
        "steps": steps,
        "batch": batch,
        "lr": lr,
        "data_seed": data_seed,
        "residual": bool(vae.config.is_residual),
        "train_seconds": round(time.perf_counter() - start, 1),
    }
    if init is not None and (init / "metrics.json").is_file():  # the training it continues
        metrics["continued_from"] = json.loads((init / "metrics.json").read_text())
    out.mkdir(parents=True, exist_ok=True)
    vae.save_pretrained(out)
    (out / "metrics.json").write_text(json.dumps(metrics, indent=1) + "\n")
    return metrics


def decode_unclamped(vae: WanVAE, z_BZthw: torch.Tensor) -> torch.Tensor:
    """``vae.decode(z).sample`` before its final clamp to [-1, 1] (``AutoencoderKLWan._decode``'s
    frame-by-frame loop over the causal cache, untiled). Training through the clamp stalls: a
    pixel the decoder puts below -1 gets no gradient, so once the dark background pulls every
    output under -1, the shapes never appear (measured: 14-17 dB PSNR after 500 steps)."""
    if vae.config.patch_size is not None:
        raise ValueError("decode_unclamped: patchified (Wan 2.2) VAEs are not supported")
    vae.clear_cache()
    x_BCthw = vae.post_quant_conv(z_BZthw)
    frames = []
    for i in range(x_BCthw.shape[2]):
        vae._conv_idx = [0]
        frames.append(
            vae.decoder(x_BCthw[:, :, i : i + 1], feat_cache=vae._feat_map, feat_idx=vae._conv_idx, first_chunk=i == 0)
        )
    vae.clear_cache()
    return torch.cat(frames, 2)


@torch.no_grad()
def set_latent_statistics(vae: WanVAE, *, frames: int, height: int, width: int, clips: int = 64) -> None:
    """Record the per-channel mean and standard deviation of the latents of training clips in the
    VAE's config (``latents_mean`` / ``latents_std``, as Wan's VAE carries them): the pipeline
    normalises latents with them, so the DiT sees unit-scale latents."""
    data = MovingShapesDataset(num_samples=clips, frames=frames, height=height, width=width, seed=TRAIN_SEED)
    z_BZthw = torch.cat([vae.encode(b["video"]).latent_dist.mode() for b in DataLoader(data, batch_size=8)])
    z_ZN = z_BZthw.transpose(0, 1).reshape(z_BZthw.shape[1], -1)
    vae.register_to_config(
        latents_mean=[round(float(v), 5) for v in z_ZN.mean(1)], latents_std=[round(float(v), 5) for v in z_ZN.std(1)]
    )


@torch.no_grad()
def whiten_latents(vae: WanVAE, z_BZthw: torch.Tensor, *, floor: float = 1e-4) -> tuple[torch.Tensor, torch.Tensor]:
    """Reparametrise ``vae`` in place so that the posterior mode of the clips ``z_BZthw`` came from
    has zero mean and identity covariance across channels (PCA whitening), and record mean 0 /
    std 1 as its latent statistics.

    The transform is linear, so it folds exactly into the 1x1x1 convolutions around the latent:
    ``quant_conv``'s mean half becomes ``A (mu - m)`` and ``post_quant_conv`` takes ``A^-1 z' + m``
    (``A = L^-1/2 U^T`` from the latent covariance ``U L U^T``); every reconstruction is unchanged
    (float rounding apart). Why: this VAE spreads its latents over few directions (eigenvalues of the
    per-channel-normalised covariance from 6.3 down to 0.001), and hue sits in the small ones, which
    a diffusion model's noise drowns first and its loss weighs least. Whitened, every direction has
    unit variance, as the per-channel normalisation intends. The posterior's log-variance half is
    left as it is: only the mode is used (encode stages and training here take the mode). Directions
    with under ``floor`` of the largest variance are scaled as if they had that much. Returns
    ``(A, m)``: latents encoded before the change map to ``A (z - m)``."""
    z_ZN = z_BZthw.transpose(0, 1).reshape(z_BZthw.shape[1], -1).double()
    m_Z = z_ZN.mean(1)
    evals_Z, u_ZZ = torch.linalg.eigh(torch.cov(z_ZN))
    scale_Z = evals_Z.clamp_min(floor * float(evals_Z.max())).rsqrt()
    a_ZZ = scale_Z[:, None] * u_ZZ.T  # z' = A (z - m)
    a_inv_ZZ = u_ZZ / scale_Z[None, :]  # z = A^-1 z' + m
    zd = m_Z.numel()
    q_w, q_b = vae.quant_conv.weight, vae.quant_conv.bias  # (2Z, 2Z, 1, 1, 1): [mean; logvar] rows
    q_w[:zd, :, 0, 0, 0] = (a_ZZ @ q_w[:zd, :, 0, 0, 0].double()).to(q_w.dtype)
    q_b[:zd] = (a_ZZ @ (q_b[:zd].double() - m_Z)).to(q_b.dtype)
    p_w, p_b = vae.post_quant_conv.weight, vae.post_quant_conv.bias  # (Z, Z, 1, 1, 1)
    p_b.copy_((p_w[..., 0, 0, 0].double() @ m_Z + p_b.double()).to(p_b.dtype))
    p_w[..., 0, 0, 0] = (p_w[..., 0, 0, 0].double() @ a_inv_ZZ).to(p_w.dtype)
    vae.register_to_config(latents_mean=[0.0] * zd, latents_std=[1.0] * zd)
    return a_ZZ.float(), m_Z.float()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=WEIGHTS_DIR)
    p.add_argument("--steps", type=int, default=4000)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--train-frames", type=int, default=5, help="frames per training clip (4k+1)")
    p.add_argument("--init", type=Path, default=None, help="continue from these weights")
    p.add_argument("--data-seed", type=int, default=TRAIN_SEED, help="dataset seed of the training clips")
    p.add_argument(
        "--wan21-blocks",
        action="store_true",
        help="Wan 2.1's down / up blocks instead of Wan 2.2's residual ones (from scratch; the VAE shipped before)",
    )
    args = p.parse_args()
    metrics = train_shapes_vae(
        args.out,
        steps=args.steps,
        batch=args.batch,
        lr=args.lr,
        seed=args.seed,
        init=args.init,
        data_seed=args.data_seed,
        train_frames=args.train_frames,
        wan21_blocks=args.wan21_blocks,
    )
    print(json.dumps(metrics))


if __name__ == "__main__":
    main()
