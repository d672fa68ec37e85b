"""Serving on one GPU: ``mmpipe serve device=cuda`` with its defaults, against diffusers' ``WanPipeline``
one request after another and batched, side by side in one run.

Wan2.1-T2V-1.3B's architecture (``model=wan1_3b_t2v``: UMT5-XXL, the 30-layer DiT, the Wan VAE) with
random weights, built on the device by ``build_full_wan_pipeline`` and saved once with
``save_pretrained`` (safetensors) into a temporary directory, which every side loads: 832x480,
17 frames, 10 steps, guidance 5; ``--requests`` requests (prompt ``i % 4``, seed ``1000 + i``, an
empty negative prompt) on every side:

* **diffusers, sequential**: ``WanPipeline.from_pretrained(dir, torch_dtype=torch.bfloat16)`` with a
  float32 ``AutoencoderKLWan`` (diffusers' documented Wan loading), ``pipe(...)`` per request, one
  after another, in this process;
* **diffusers, batched**: the same pipeline, ``--clients`` prompts per call (``prompt=[...]``,
  ``negative_prompt=[...]``, one CPU generator per request), calls one after another; each request's
  latency is its call's;
* **mmpipe**: the engine of ``mmpipe serve pipeline=DIR device=cuda`` with its default placement
  and batching (on one GPU: one group running every stage, continuous batching of the DiT) behind
  the real HTTP server; ``--clients`` concurrent ``openai`` clients send the requests, each client
  one after another (create, poll every 10 ms, download the MP4), as ``benchmarks/serve.py`` does.

Each side is warmed up once with 2 steps (diffusers batched and mmpipe with ``--clients`` requests at
once). The baseline's GPU memory is freed before the server starts. ``throughput_vs_best_baseline``
is mmpipe's requests/s over the better diffusers figure; ``p50_s`` / ``p99_s`` are per-request
latencies; ``max_abs_diff`` compares each served video's frames (uint8 levels, before MP4 encoding)
with diffusers' sequential frames of the same seed (``max_abs_diff_batched_baseline``: diffusers'
batched frames against its sequential ones). Progress goes to stderr; the last stdout line is one
JSON object. SIGTERM (a caller's time limit) prints the JSON of what was measured and exits 124.

    python benchmarks/gpu_serve.py                      # the H200 run (about 2 minutes)
    python benchmarks/gpu_serve.py --device cpu --tiny  # the CPU rehearsal (a tiny architecture, float32)
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import importlib.util
import json
import signal
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

import numpy as np
import torch

from mmpipe.config import ModelConfig, ServeConfig, compose_config, from_dict
from mmpipe.data import frames_to_uint8
from mmpipe.devices import resolve_device
from mmpipe.models.wan import build_full_wan_pipeline

PROMPTS = [
    "a red fox running through fresh snow in a quiet pine forest at sunrise",
    "a blue sailboat crossing a calm bay under a pink evening sky",
    "a green parrot landing on a wooden fence in light rain",
    "a yellow taxi driving down a busy city street at night with neon signs",
]
WARMUP_STEPS = 2
SEED0 = 1000
# --tiny: the preset's layout at toy widths (CPU rehearsal of the code path, not of the speed)
TINY_ARCH = {
    "text": {"vocab_size": 512, "d_model": 64, "d_kv": 8, "d_ff": 128, "num_layers": 2, "num_heads": 8},
    "vae": {"base_dim": 16, "num_res_blocks": 1},
    "dit": {"num_attention_heads": 2, "attention_head_dim": 32, "text_dim": 64, "ffn_dim": 128, "num_layers": 2},
}
TINY_SIZE = {"height": 64, "width": 96, "frames": 9}
STARTED = time.perf_counter()
REPORT: dict[str, Any] = {}  # filled as measured; what a SIGTERM still prints
FRAMES: dict[str, dict[int, np.ndarray]] = {}  # side -> request -> uint8 frames


class _Deadline(Exception):
    """SIGTERM arrived (the caller's time limit): stop measuring, report what was measured."""


def _deadline(signum: int, frame: Any) -> None:
    raise _Deadline


def log(message: str) -> None:
    """Progress on stderr, with the seconds since start."""
    print(f"[{time.perf_counter() - STARTED:7.1f}s] {message}", file=sys.stderr, flush=True)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line; ``--tiny`` fills the sizes not given with ``TINY_SIZE``."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    p.add_argument("--tiny", action="store_true", help="the preset shrunk to toy widths (CPU rehearsal)")
    p.add_argument("--model", default="wan1_3b_t2v", help="architecture preset (configs/model)")
    p.add_argument("--height", type=int, default=None, help="default 480 (64 with --tiny)")
    p.add_argument("--width", type=int, default=None, help="default 832 (96 with --tiny)")
    p.add_argument("--frames", type=int, default=None, help="default 17 (9 with --tiny)")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--guidance", type=float, default=5.0)
    p.add_argument("--requests", type=int, default=8)
    p.add_argument("--clients", type=int, default=4, help="concurrent clients; also the baseline's prompts per call")
    p.add_argument("--text-len", type=int, default=512, help="prompt tokens (WanPipeline's default)")
    args = p.parse_args(argv)
    full = {"height": 480, "width": 832, "frames": 17}
    for key, value in (TINY_SIZE if args.tiny else full).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    return args


def load_spec(name: str, *, tiny: bool) -> ModelConfig:
    """The preset's ``ModelConfig``; ``tiny`` overlays ``TINY_ARCH`` on its architecture."""
    spec = from_dict(ModelConfig, compose_config("plan", [f"model={name}"])["model"], "model.")
    if not tiny:
        return spec
    arch = {part: {**cfg, **TINY_ARCH.get(part, {})} for part, cfg in (spec.arch or {}).items()}
    return dataclasses.replace(spec, arch=arch)


def save_pipeline(spec: ModelConfig, device: torch.device, path: Path) -> None:
    """Random weights built on ``device`` and saved once (safetensors); on CPU in float32, the CPU
    serving precision, so that the rehearsal's sides all compute in float32."""
    pipe: Any = build_full_wan_pipeline(spec, PROMPTS, device=device, seed=0)
    if device.type == "cpu":
        pipe.text_encoder.float()
        pipe.transformer.float()
    pipe.save_pretrained(path, safe_serialization=True)
    del pipe
    free_memory(device)


def free_memory(device: torch.device) -> None:
    """Return the device memory of dropped objects to the driver (the server's process needs it)."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def load_diffusers(path: Path, device: torch.device) -> Any:
    """diffusers' documented Wan loading: the pipeline in bf16 (float32 on CPU), the VAE in float32."""
    from diffusers import AutoencoderKLWan, WanPipeline

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    vae = AutoencoderKLWan.from_pretrained(path, subfolder="vae", torch_dtype=torch.float32)
    pipe: Any = WanPipeline.from_pretrained(path, vae=vae, torch_dtype=dtype).to(device)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def call_diffusers(pipe: Any, indices: list[int], args: argparse.Namespace, steps: int) -> list[np.ndarray]:
    """One ``pipe(...)`` call for the requests ``indices`` (their prompts, seeds and CPU generators)."""
    out = pipe(
        prompt=[PROMPTS[i % len(PROMPTS)] for i in indices],
        negative_prompt=[""] * len(indices),
        height=args.height,
        width=args.width,
        num_frames=args.frames,
        num_inference_steps=steps,
        guidance_scale=args.guidance,
        generator=[torch.Generator().manual_seed(SEED0 + i) for i in indices],
        output_type="np",
        max_sequence_length=args.text_len,
    ).frames
    return [frames_to_uint8(f) for f in out]


def run_diffusers(pipe: Any, side: str, per_call: int, args: argparse.Namespace) -> None:
    """Warm up once, then every request, ``per_call`` per ``pipe(...)`` call, one call after another."""
    call_diffusers(pipe, list(range(per_call)), args, WARMUP_STEPS)
    latencies: list[float] = []
    FRAMES[side] = {}
    start = time.perf_counter()
    for first in range(0, args.requests, per_call):
        indices = list(range(first, min(first + per_call, args.requests)))
        t0 = time.perf_counter()
        for i, frames in zip(indices, call_diffusers(pipe, indices, args, args.steps), strict=True):
            FRAMES[side][i] = frames
        latencies += [time.perf_counter() - t0] * len(indices)
        record(side, latencies, time.perf_counter() - start)
        log(f"{side}: {len(latencies)}/{args.requests} requests")


def load_sibling(name: str) -> Any:
    """``benchmarks/<name>.py`` loaded by its path: importing diffusers takes benchmarks/ off sys.path
    (see kernels.py), and the serving workers re-run this script without it there."""
    spec = importlib.util.spec_from_file_location(f"_benchmarks_{name}", Path(__file__).with_name(f"{name}.py"))
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_mmpipe(path: Path, run_dir: Path, args: argparse.Namespace) -> None:
    """The engine of ``mmpipe serve pipeline=DIR device=...`` with its defaults, behind the HTTP server."""
    serve = load_sibling("serve")
    request_video, run_clients, serving = serve.request_video, serve.run_clients, serve.serving
    cfg = ServeConfig(pipeline=str(path), device=args.device, run_dir=str(run_dir), text_len=args.text_len)
    warm = argparse.Namespace(**{**vars(args), "steps": WARMUP_STEPS})
    with serving(cfg) as (engine, client):
        REPORT["placement"] = engine.cfg.placement
        REPORT["max_batch"] = engine.cfg.max_batch
        log(f"mmpipe: server up ({engine.placement_text()}); warming up")

        def one(i: int, params: argparse.Namespace = args) -> tuple[float, str]:
            latency, video_id = request_video(client, cfg.model_name, PROMPTS[i % len(PROMPTS)], SEED0 + i, params)
            job = engine.get(video_id)
            assert job is not None and job.frames is not None
            if params is args:
                FRAMES["mmpipe"][i] = job.frames
                latencies = [lat for lat, _ in results.values()] + [latency]
                record("mmpipe", latencies, time.perf_counter() - start)
            return latency, video_id

        run_clients(lambda i: one(i, warm), args.clients, args.clients, {})
        log("mmpipe: measuring")
        results: dict[int, tuple[float, str]] = {}
        FRAMES["mmpipe"] = {}
        start = time.perf_counter()
        total = run_clients(one, args.requests, args.clients, results)
        record("mmpipe", [results[i][0] for i in range(args.requests)], total)


def record(side: str, latencies: list[float], elapsed: float) -> None:
    """A side's throughput and latency percentiles so far, into ``REPORT``."""
    REPORT.setdefault("throughput_rps", {})[side] = len(latencies) / elapsed
    REPORT.setdefault("p50_s", {})[side] = float(np.percentile(latencies, 50))
    REPORT.setdefault("p99_s", {})[side] = float(np.percentile(latencies, 99))
    REPORT.setdefault("completed", {})[side] = len(latencies)


def summarize() -> None:
    """The throughput ratio against the better baseline and the frame differences, from what was measured."""
    rps = REPORT.get("throughput_rps", {})
    baselines = [rps[s] for s in ("diffusers_sequential", "diffusers_batched") if s in rps]
    if "mmpipe" in rps and baselines:
        REPORT["throughput_vs_best_baseline"] = rps["mmpipe"] / max(baselines)
    ref = FRAMES.get("diffusers_sequential", {})
    for key, side in (("max_abs_diff", "mmpipe"), ("max_abs_diff_batched_baseline", "diffusers_batched")):
        common = sorted(set(ref) & set(FRAMES.get(side, {})))
        if common:
            diffs = [np.abs(FRAMES[side][i].astype(np.int16) - ref[i].astype(np.int16)).max() for i in common]
            REPORT[key] = int(max(diffs))


def run(args: argparse.Namespace, tmp: Path) -> None:
    """Build and save the pipeline, time both diffusers baselines, free them, then serve; fills ``REPORT``."""
    import diffusers

    device = torch.device(resolve_device(args.device, key="--device").value)
    spec = load_spec(args.model, tiny=args.tiny)
    REPORT.update(
        baseline={
            "diffusers_sequential": f"diffusers {diffusers.__version__} WanPipeline.__call__, one request per call",
            "diffusers_batched": f"diffusers {diffusers.__version__} WanPipeline.__call__, {args.clients} per call",
        },
        device=device.type,
        gpu=torch.cuda.get_device_name(device) if device.type == "cuda" else None,
        torch=torch.__version__,
        model=spec.name + (" (tiny)" if args.tiny else ""),
        shape={"height": args.height, "width": args.width, "frames": args.frames, "steps": args.steps},
        guidance=args.guidance,
        requests=args.requests,
        clients=args.clients,
    )
    log(f"building and saving {REPORT['model']} on {device}")
    save_pipeline(spec, device, tmp / "wan")
    log("diffusers: loading")
    pipe = load_diffusers(tmp / "wan", device)
    with torch.no_grad():
        run_diffusers(pipe, "diffusers_sequential", 1, args)
        run_diffusers(pipe, "diffusers_batched", args.clients, args)
    del pipe
    free_memory(device)
    log("mmpipe: starting the server")
    run_mmpipe(tmp / "wan", tmp / "serve_run", args)


def main(argv: list[str] | None = None) -> int:
    """Run, then print the JSON report last (also on an error: exit 1, and on SIGTERM: exit 124)."""
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, _deadline)
    status = 0
    try:
        with tempfile.TemporaryDirectory(prefix="mmpipe-gpu-serve-") as tmp:
            run(args, Path(tmp))
    except _Deadline:
        REPORT["cut"] = "SIGTERM (time limit): the rest was not measured"
        status = 124
    except Exception as err:  # a failed side still reports what the others measured (one-shot GPU runs)
        traceback.print_exc()
        REPORT["error"] = f"{type(err).__name__}: {err}"
        status = 1
    summarize()
    REPORT["elapsed_s"] = time.perf_counter() - STARTED
    print(json.dumps(REPORT))
    return status


if __name__ == "__main__":
    sys.exit(main())
