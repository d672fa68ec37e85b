"""How many samples the tiny preset's DiT needs to learn the moving-shapes captions (issue 31).

Outside the runtime on purpose: a plain PyTorch loop on latents encoded once by the packaged shapes
VAE, with the preset's frozen random text encoder, Wan's flow-matching objective (shift 3) and the
same tracker as ``mmpipe eval``, so the figure is the model's sample efficiency, not the engine's
speed. Every ``--eval-every`` steps it generates the 96 captions of the grid (20 steps, guidance 1
and 3, seed 0) and scores them. Last line: JSON
``{"dit": {...}, "evals": [{"step", "samples", "train_s", "guidance": {g: [colour, shape, direction]}}]}``.

    python benchmarks/dit_learning.py --steps 3000 --layers 2 --heads 8 --lr 3e-3

``by_shape`` gives, per guidance scale, each shape's accuracy and its mean fill ratio (area /
bounding box: the tracker's circle-or-square measure, 0.79 and 0.99 on clean renders).
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from diffusers import AutoencoderKLWan, WanTransformer3DModel

from mmpipe.config import ModelConfig
from mmpipe.data import MovingShapesDataset, caption_vocabulary, frames_to_uint8
from mmpipe.data.shapes import COLORS, DIRECTIONS, SHAPES
from mmpipe.data.tracker import track
from mmpipe.eval import contact_sheet
from mmpipe.models.shapes_vae_train import whiten_latents
from mmpipe.models.wan import build_tiny_wan_pipeline

GRID = list(itertools.product(COLORS, SHAPES, DIRECTIONS))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=3000)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--schedule", choices=["constant", "cosine"], default="cosine")
    p.add_argument("--caption-dropout", type=float, default=0.1)
    p.add_argument("--layers", type=int, default=ModelConfig().dit_layers)
    p.add_argument("--heads", type=int, default=ModelConfig().dit_heads)
    p.add_argument(
        "--patch",
        type=int,
        default=None,
        help="the DiT's spatial patch size (default: the preset's, 2; 1: 4x the tokens)",
    )
    p.add_argument("--samples", type=int, default=1024, help="data set size (the preset's data.num_samples)")
    p.add_argument("--eval-every", type=int, default=1000)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--shift", type=float, default=3.0, help="flow shift, training and sampling (the preset's 3.0)")
    p.add_argument("--ema", type=float, default=0.0, help="EMA decay of the DiT weights evaluated (0: off)")
    p.add_argument("--guidance", type=float, nargs="+", default=[1.0, 3.0])
    p.add_argument(
        "--whiten", action="store_true", help="PCA-whiten the VAE's latents (shapes_vae_train.whiten_latents)"
    )
    p.add_argument("--vae", default=None, help="a VAE directory (save_pretrained) instead of the packaged shapes VAE")
    p.add_argument("--sheet", default=None, help="write the last eval's contact sheet (PNG) here")
    p.add_argument(
        "--latents",
        default=None,
        help="file to keep the encoded data set in between runs (stale once the VAE changes: delete it)",
    )
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    spec = ModelConfig(name="t2v_tiny", dit_layers=a.layers, dit_heads=a.heads, flow_shift=a.shift)
    pipe = build_tiny_wan_pipeline(spec, [*caption_vocabulary(), "blurry static"], seed=0)
    if a.vae:
        pipe.vae = AutoencoderKLWan.from_pretrained(a.vae).eval()
    if a.patch is not None:  # the preset's DiT config at another patch size, fresh random weights
        torch.manual_seed(0)
        config = {**pipe.transformer.config, "patch_size": (1, a.patch, a.patch)}
        pipe.transformer = WanTransformer3DModel.from_config(config)
    vae, dit = pipe.vae, pipe.transformer
    mean = torch.tensor(vae.config.latents_mean).view(1, -1, 1, 1, 1)
    std = torch.tensor(vae.config.latents_std).view(1, -1, 1, 1, 1)
    data = MovingShapesDataset(num_samples=a.samples, frames=17, height=64, width=64, seed=0)
    latents, captions = [], []
    with torch.no_grad():  # the frozen VAE once per sample, as the frozen-output cache does
        if a.latents and os.path.exists(a.latents):
            lat, captions = torch.load(a.latents)
        else:
            for i in range(0, a.samples, 16):
                rows = [data[j] for j in range(i, min(a.samples, i + 16))]
                z = vae.encode(torch.stack([r["video"] for r in rows])).latent_dist.mode()
                latents.append((z - mean) / std)
                captions += [r["caption"] for r in rows]
            lat = torch.cat(latents)
            if a.latents:
                torch.save((lat, captions), a.latents)
        distinct = sorted(set(captions))
        emb, _ = pipe.encode_prompt(distinct, do_classifier_free_guidance=False, max_sequence_length=16)
        empty, _ = pipe.encode_prompt([""], do_classifier_free_guidance=False, max_sequence_length=16)
    if a.whiten:
        raw = lat * std + mean
        a_zz, m_z = whiten_latents(vae, raw)
        lat = torch.einsum("ij,bj...->bi...", a_zz, raw - m_z.view(1, -1, 1, 1, 1))
    caption_of = torch.tensor([distinct.index(c) for c in captions])

    def lr_factor(s: int) -> float:
        warm = min(1.0, (s + 1) / 20)
        return warm * (0.5 * (1 + math.cos(math.pi * s / a.steps)) if a.schedule == "cosine" else 1.0)

    dit.train()
    opt = torch.optim.AdamW(dit.parameters(), lr=a.lr, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_factor)
    gen = torch.Generator().manual_seed(0)
    ema = [q.detach().clone() for q in dit.parameters()] if a.ema else []
    evals = []
    train_s = 0.0
    for step in range(1, a.steps + 1):
        t0 = time.perf_counter()
        idx = torch.randint(0, len(lat), (a.batch,), generator=gen)
        x0, ctx = lat[idx], emb[caption_of[idx]]
        drop = torch.rand(a.batch, generator=gen) < a.caption_dropout
        ctx = torch.where(drop.view(-1, 1, 1), empty.expand_as(ctx), ctx)
        u = torch.rand(a.batch, generator=gen)
        sigma = a.shift * u / (1 + (a.shift - 1) * u)  # the scheduler's shift
        noise = torch.randn(x0.shape, generator=gen)
        s = sigma.view(-1, 1, 1, 1, 1)
        pred = dit(hidden_states=(1 - s) * x0 + s * noise, timestep=sigma * 1000, encoder_hidden_states=ctx)[0]
        loss = F.mse_loss(pred, noise - x0)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(dit.parameters(), 1.0)
        opt.step()
        sched.step()
        if ema:
            with torch.no_grad():
                torch._foreach_lerp_(ema, [q.detach() for q in dit.parameters()], 1 - a.ema)
        train_s += time.perf_counter() - t0
        if step % 100 == 0:
            print(f"step {step} loss {loss.item():.4f} train {train_s:.0f} s", flush=True)
        if step % a.eval_every == 0 or step == a.steps:
            dit.eval()
            live = [q.detach().clone() for q in dit.parameters()]
            if ema:
                with torch.no_grad():
                    torch._foreach_copy_([q for q in dit.parameters()], ema)
            scores: dict[float, list[float]] = {}
            by_shape: dict[float, dict[str, dict[str, float]]] = {}
            confusion: dict[str, dict[str, int]] = {}
            for g in a.guidance:
                prompts = [f"a {c} {sh} moving {d}" for c, sh, d in GRID]
                with torch.no_grad():
                    out = pipe(
                        prompt=prompts,
                        negative_prompt=[""] * len(prompts) if g > 1 else None,
                        height=64,
                        width=64,
                        num_frames=17,
                        num_inference_steps=20,
                        guidance_scale=g,
                        max_sequence_length=16,
                        generator=torch.Generator().manual_seed(0),
                        output_type="np",
                    ).frames
                ok = np.zeros(3)
                shape_ok: dict[str, list[bool]] = {sh: [] for sh in SHAPES}
                fills: dict[str, list[float]] = {sh: [] for sh in SHAPES}
                sheet, cells = [], []
                for (c, sh, d), frames_THWC in zip(GRID, out, strict=True):
                    u8 = frames_to_uint8(frames_THWC)
                    v = track(u8)
                    ok += [v.color == c, v.shape == sh, v.direction == d]
                    shape_ok[sh].append(v.shape == sh)
                    fills[sh].append(v.fill_ratio)
                    sheet.append((u8[0], u8[-1]))
                    cells.append(
                        {"caption": f"a {c} {sh} moving {d}", "verdict": str(v)}
                        | {f"{k}_ok": x for k, x in v.matches(c, sh, d).items()}
                    )
                    if g == a.guidance[-1]:
                        row = confusion.setdefault(c, {})
                        row[str(v.color)] = row.get(str(v.color), 0) + 1
                scores[g] = [round(x, 3) for x in ok / len(GRID)]
                by_shape[g] = {
                    sh: {
                        "shape_acc": round(float(np.mean(shape_ok[sh])), 3),
                        "fill": round(float(np.mean(fills[sh])), 3),
                    }
                    for sh in SHAPES
                }
                if a.sheet and step == a.steps and g == a.guidance[-1]:
                    contact_sheet(sheet, cells, Path(a.sheet))
            with torch.no_grad():
                torch._foreach_copy_([q for q in dit.parameters()], live)
            evals.append(
                {
                    "step": step,
                    "samples": step * a.batch,
                    "train_s": round(train_s, 1),
                    "guidance": scores,
                    "by_shape": by_shape,
                    "colour_confusion": confusion,
                }
            )
            print(json.dumps(evals[-1]), flush=True)
            dit.train()
    print(
        json.dumps(
            {
                "dit": {"layers": a.layers, "heads": a.heads, "patch": dit.config.patch_size[-1]},
                "train": {"lr": a.lr, "schedule": a.schedule, "batch": a.batch, "shift": a.shift, "ema": a.ema},
                "evals": evals,
            }
        )
    )


if __name__ == "__main__":
    main()
