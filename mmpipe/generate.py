"""``mmpipe generate``: a prompt -> a GIF and an MP4 (a PNG for image families), with the DiT of a
trained run (``ckpt=RUN_DIR``; an image-to-video run takes its first frame, ``image=FILE``) or any
supported diffusers pipeline directory (``pipeline=DIR``).

``device=cpu`` computes in float32 as the run was saved; ``device=cuda`` (or ``auto`` on a GPU
machine) loads the pipeline onto the GPU in diffusers' Wan precision (bf16 text encoder and DiT,
their fp32-kept modules and the VAE float32; :func:`mmpipe.models.wan.place_graph`) and resolves the
run's ``model.kernels`` for CUDA (``auto``: mmpipe's Triton kernels).
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
from pathlib import Path
from typing import Any

import torch
from PIL import Image

from mmpipe.assemble.inference import (
    InferencePlacement,
    check_placement_for_model,
    latent_frames_of,
    parse_inference_placement,
)
from mmpipe.config import GenerateConfig
from mmpipe.data import frames_to_uint8, write_gif, write_mp4, write_png
from mmpipe.devices import DeviceType, resolve_device
from mmpipe.models.loading import from_diffusers
from mmpipe.models.pipeline_graph import PipelineGraph, check_family_dir
from mmpipe.report.recording import record_generation
from mmpipe.rundir import load_run_config, pipeline_dir
from mmpipe.runtime.inference import configure_denoiser, launch_ranks, place_inference_graph
from mmpipe.runtime.trained import check_trained_run, load_trained_graph
from mmpipe.stages.sampler import guidance_on

logger = logging.getLogger(__name__)


def generate(cfg: GenerateConfig) -> dict[str, Path]:
    """Render ``cfg.prompt`` with the trained run ``cfg.ckpt`` or the pipeline ``cfg.pipeline`` on
    ``cfg.device``; returns the written files: the GIF and the MP4 (a PNG for image families) and
    the generation's own run directory (its events, memory samples and trace, which ``mmpipe
    report`` reads). With ``nproc > 1`` the request runs on that many local CPU ranks, its stages
    placed by ``cfg.placement`` (checked, with the model's config files, before any rank starts)."""
    device = resolve_device(cfg.device)  # device=cuda without a GPU: refused before anything loads
    if cfg.nproc == 1 and cfg.placement is None:
        graph, call, out_dir, video = _prepare(cfg, device)
        configure_denoiser(graph, cfg.cache, compile=cfg.compile)
        return _render(graph, call, out_dir, video, cfg)
    if device is not DeviceType.CPU:
        raise ValueError(
            f"nproc={cfg.nproc} / placement: a request over several ranks runs on CPU ranks (gloo) today; "
            "use device=cpu, or nproc=1 on a GPU"
        )
    placement = parse_inference_placement(cfg.placement, cfg.nproc, guided=guidance_on(cfg.guidance))
    root = check_family_dir(cfg.pipeline) if cfg.pipeline is not None else _checked_run(cfg)[1]
    frames = cfg.frames or (load_run_config(Path(cfg.ckpt)).data.frames if cfg.ckpt else None)
    check_placement_for_model(
        placement, root, latent_frames_of(root, frames) if frames else None, cache_policy=cfg.cache.policy
    )
    logger.info("generate over %d ranks: %s", cfg.nproc, placement.describe())
    results = launch_ranks(_generate_rank, cfg.nproc, cfg, placement)
    written: dict[str, Path] = results[placement.decode[0]]
    return written


def _generate_rank(rank: int, world: int, cfg: GenerateConfig, placement: InferencePlacement) -> dict[str, Path] | None:
    """One rank of a multi-process generation: every rank runs the graph; the (first) decode rank
    writes the files."""
    torch.set_num_threads(cfg.threads or max(1, (os.cpu_count() or 1) // world))
    graph, call, out_dir, video = _prepare(cfg, DeviceType.CPU)
    place_inference_graph(graph, placement)
    configure_denoiser(graph, cfg.cache, compile=cfg.compile)
    if rank == placement.decode[0]:  # the rank that decodes writes the files
        return _render(graph, call, out_dir, video, cfg)
    output = "np" if rank in placement.decode else "latent"  # a rank without the decode stops before it
    with torch.no_grad():
        graph.generate(**call, seed=cfg.seed, output_type=output, progress=False)
    return None


def _checked_run(cfg: GenerateConfig) -> tuple[Path, Path]:
    """The trained run ``cfg.ckpt`` (checked) and its pipeline directory."""
    assert cfg.ckpt is not None  # GenerateConfig.__post_init__ requires one of them
    run_dir = Path(cfg.ckpt)
    check_trained_run(run_dir)
    model = load_run_config(run_dir).model
    root = pipeline_dir(model, run_dir)
    i2v = json.loads((root / "model_index.json").read_text()).get("_class_name") == "WanImageToVideoPipeline"
    if i2v:
        from mmpipe.models.wan_i2v import is_flf2v  # imported here: see mmpipe.models' I2V imports

        flf2v = is_flf2v(root)
    else:
        flf2v = False
    if model.kind == "u2g":
        if cfg.image is None:
            raise ValueError(
                f"ckpt={cfg.ckpt!r} is an understand-then-generate run: give the still it reads, image=FILE "
                "(and the instruction as the prompt, e.g. prompt='make it move left')"
            )
        if cfg.nproc > 1 or cfg.placement is not None or cfg.cache.policy != "none" or cfg.compile:
            raise ValueError(
                f"ckpt={cfg.ckpt!r}: an understand-then-generate run generates on one rank without "
                "placement, cache.policy or compile"
            )
    elif cfg.image is not None and not i2v:
        raise ValueError(f"image={cfg.image!r}: the trained run is text-to-video; image is for image-to-video runs")
    if cfg.image is None and i2v:
        raise ValueError(f"ckpt={cfg.ckpt!r} trained WanImageToVideoPipeline: give its first frame, image=FILE")
    if flf2v != (cfg.last_image is not None):
        raise ValueError(
            f"ckpt={cfg.ckpt!r} trained Wan FLF2V: give its last frame too, last_image=FILE"
            if flf2v
            else f"last_image={cfg.last_image!r}: the trained run is not a first-last-frame (FLF2V) one"
        )
    return run_dir, root


def _prepare(cfg: GenerateConfig, device: DeviceType) -> tuple[Any, dict[str, Any], Path, bool]:
    """The graph, the ``generate`` call, the output folder and whether the output is a video."""
    if cfg.pipeline is not None:
        return _prepare_pipeline(cfg, device)
    run_dir, _ = _checked_run(cfg)
    data = load_run_config(run_dir).data
    graph = load_trained_graph(run_dir, device)
    call = {
        "prompt": cfg.prompt,
        "negative_prompt": cfg.negative_prompt,
        "height": cfg.height or data.height,
        "width": cfg.width or data.width,
        "num_frames": cfg.frames or data.frames,
        "num_inference_steps": cfg.steps,
        "guidance_scale": cfg.guidance,
    }
    _images(cfg, call)  # an image-to-video run's (checked by _checked_run)
    return graph, call, Path(cfg.out) if cfg.out else run_dir / "samples", True


def _images(cfg: GenerateConfig, call: dict[str, Any]) -> None:
    """The call's ``image`` and ``last_image`` from ``cfg``'s files, where given."""
    for key in ("image", "last_image"):
        path = getattr(cfg, key)
        if path is not None:
            call[key] = Image.open(path).convert("RGB")


def _prepare_pipeline(cfg: GenerateConfig, device: DeviceType) -> tuple[Any, dict[str, Any], Path, bool]:
    """``pipeline=DIR``: the directory's family graph; sizes the config leaves unset are the
    pipeline's own defaults."""
    assert cfg.pipeline is not None
    root = check_family_dir(cfg.pipeline)  # a bad directory: refused before anything is written
    graph = from_diffusers(root, device=device.value)
    video = not isinstance(graph, PipelineGraph) or graph.family.output == "video"
    call: dict[str, Any] = {"prompt": cfg.prompt, "num_inference_steps": cfg.steps, "guidance_scale": cfg.guidance}
    if cfg.negative_prompt:
        call["negative_prompt"] = cfg.negative_prompt
    sizes = {"height": cfg.height, "width": cfg.width} | ({"num_frames": cfg.frames} if video else {})
    call |= {k: v for k, v in sizes.items() if v is not None}
    if not video and cfg.frames is not None:
        raise ValueError(f"frames={cfg.frames}: {graph.name} generates images")
    _images(cfg, call)
    bind = graph.bind if isinstance(graph, PipelineGraph) else None
    if bind is not None:
        bind(**call)  # an argument the family does not take: refused before anything is written
    return graph, call, Path(cfg.out) if cfg.out else root / "samples", video


def _render(graph: Any, call: dict[str, Any], out_dir: Path, video: bool, cfg: GenerateConfig) -> dict[str, Path]:
    stem = f"{_slug(cfg.prompt)}-seed{cfg.seed}"
    record_dir = out_dir / f"{stem}-run"
    out_dir.mkdir(parents=True, exist_ok=True)
    if record_dir.exists():  # a new recording, not appended to the last one's events
        shutil.rmtree(record_dir)
    with torch.no_grad(), record_generation(graph, record_dir, per_call=("denoise",)):
        out = graph.generate(**call, seed=cfg.seed, output_type="np")
    if not video:
        return {"png": write_png(frames_to_uint8(out[0][None])[0], out_dir / f"{stem}.png"), "run": record_dir}
    frames = frames_to_uint8(out[0])
    return {
        "gif": write_gif(frames, out_dir / f"{stem}.gif", fps=cfg.fps),
        "mp4": write_mp4(frames, out_dir / f"{stem}.mp4", fps=cfg.fps),
        "run": record_dir,
    }


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")[:60] or "sample"
