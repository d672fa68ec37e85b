"""``mmpipe generate``: a prompt -> a GIF and an MP4, with the DiT of a trained run.

``device=cpu`` computes in float32 as the run was saved; ``device=cuda`` (or ``auto`` on a GPU
machine) loads the pipeline onto the GPU in diffusers' Wan precision (bf16 text encoder and DiT,
their fp32-kept modules and the VAE float32; :func:`mmpipe.models.wan.place_graph`) and resolves the
run's ``model.kernels`` for CUDA (``auto``: mmpipe's Triton kernels).
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import torch

from mmpipe.config import GenerateConfig
from mmpipe.data import frames_to_uint8, write_gif, write_mp4
from mmpipe.devices import resolve_device
from mmpipe.report.recording import record_generation
from mmpipe.rundir import load_run_config
from mmpipe.runtime.trained import check_trained_run, load_trained_graph


def generate(cfg: GenerateConfig) -> dict[str, Path]:
    """Render ``cfg.prompt`` with the trained run ``cfg.ckpt`` on ``cfg.device``; returns the
    written files: the GIF, the MP4 and the generation's own run directory (its events, memory
    samples and trace, which ``mmpipe report`` reads)."""
    assert cfg.ckpt is not None  # GenerateConfig.__post_init__ requires it
    device = resolve_device(cfg.device)  # device=cuda without a GPU: refused before anything loads
    run_dir = Path(cfg.ckpt)
    check_trained_run(run_dir)
    data = load_run_config(run_dir).data
    graph = load_trained_graph(run_dir, device)
    out_dir = Path(cfg.out) if cfg.out else run_dir / "samples"
    stem = f"{_slug(cfg.prompt)}-seed{cfg.seed}"
    record_dir = out_dir / f"{stem}-run"
    out_dir.mkdir(parents=True, exist_ok=True)
    if record_dir.exists():  # a new recording, not appended to the last one's events
        shutil.rmtree(record_dir)
    with torch.no_grad(), record_generation(graph, record_dir, per_call=("denoise",)):
        video = graph.generate(
            cfg.prompt,
            cfg.negative_prompt,
            height=cfg.height or data.height,
            width=cfg.width or data.width,
            num_frames=cfg.frames or data.frames,
            num_inference_steps=cfg.steps,
            guidance_scale=cfg.guidance,
            seed=cfg.seed,
        )
    frames = frames_to_uint8(video[0])
    return {
        "gif": write_gif(frames, out_dir / f"{stem}.gif", fps=cfg.fps),
        "mp4": write_mp4(frames, out_dir / f"{stem}.mp4", fps=cfg.fps),
        "run": record_dir,
    }


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")[:60] or "sample"
