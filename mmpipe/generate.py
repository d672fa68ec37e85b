"""``mmpipe generate``: a prompt -> a GIF and an MP4, with the DiT of a trained run.

``device=cpu`` computes in float32 as the run was saved; ``device=cuda`` (or ``auto`` on a GPU
machine) loads the pipeline onto the GPU in diffusers' Wan precision (bf16 text encoder and DiT,
their fp32-kept modules and the VAE float32; :func:`mmpipe.pipelines.place_graph`) and resolves the
run's ``model.kernels`` for CUDA (``auto``: mmpipe's Triton kernels).
"""

from __future__ import annotations

import dataclasses
import re
import shutil
from pathlib import Path

import torch

from mmpipe.checkpoint import latest_checkpoint, load_latest_weights
from mmpipe.config import GenerateConfig, RunConfig
from mmpipe.data import frames_to_uint8, write_gif, write_mp4
from mmpipe.devices import DeviceType, resolve_device
from mmpipe.errors import loading_errors
from mmpipe.kernels import registry as kernels
from mmpipe.kernels.wan import use_kernels
from mmpipe.pipelines import T2VGraph, check_pipeline_dir, from_diffusers
from mmpipe.report.recording import record_generation
from mmpipe.train import load_run_config, pipeline_dir


def check_trained_run(run_dir: Path, *, key: str = "ckpt") -> None:
    """Refuse, before any weights load or worker starts, a ``run_dir`` that
    :func:`load_trained_graph` cannot use: no run config, a missing or unusable pipeline directory,
    or no checkpoint yet (``ValueError`` naming ``key``)."""
    cfg = load_run_config(run_dir)
    check_pipeline_dir(pipeline_dir(cfg.model, run_dir), key=f"{key}={str(run_dir)!r}: pipeline")
    if latest_checkpoint(run_dir) is None:
        raise ValueError(f"{key}={str(run_dir)!r}: the run has no checkpoint yet (train.ckpt_every saves them)")


def load_trained_graph(run_dir: Path, device: DeviceType = DeviceType.CPU) -> T2VGraph:
    """The run's inference graph on ``device`` (bf16 text encoder and DiT on CUDA, as
    :func:`~mmpipe.pipelines.place_graph` places them) with the DiT weights of its latest
    checkpoint and the run's ``model.kernels`` resolved for ``device``."""
    cfg = load_run_config(run_dir)
    choice = generation_kernels(cfg, device)  # an unavailable kernel is an error before any load
    with loading_errors(f"ckpt={str(run_dir)!r}"):
        graph = from_diffusers(
            pipeline_dir(cfg.model, run_dir), max_sequence_length=cfg.model.text_len, device=device.value
        )
        # The training graph's DiT stage is named "dit"; its weights become the denoiser's (DCP
        # copies the saved float32 tensors into the placed ones, casting to their dtype).
        load_latest_weights(run_dir, {"dit": graph.denoise.module})
    apply_kernels(graph, choice)
    return graph


def generation_kernels(cfg: RunConfig, device: DeviceType) -> kernels.KernelChoice:
    """The run's ``model.kernels`` resolved for the device that generates (``auto``: Triton on
    CUDA), not for the one it trained on: a run trained on CPU generates with Triton on a GPU."""
    choice = kernels.KernelChoice(**dataclasses.asdict(cfg.model.kernels))
    return kernels.resolve(choice, device.value)


def apply_kernels(graph: T2VGraph, choice: kernels.KernelChoice) -> None:
    """Install ``choice`` for this process and swap its kernels into the denoiser's DiT."""
    kernels.configure(choice)
    if choice != kernels.KernelChoice():
        use_kernels(graph.denoise.module, choice)


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
