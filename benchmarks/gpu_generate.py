"""Text-to-video generation on one GPU: what ``mmpipe generate device=cuda`` runs, against diffusers'
``WanPipeline.__call__`` on the same modules, side by side in one run.

Wan2.1-T2V-1.3B's architecture (``model=wan1_3b_t2v``: UMT5-XXL, the 30-layer DiT, the Wan VAE)
with random weights, built on the device by ``build_full_wan_pipeline`` (text encoder and DiT bf16,
keep-in-fp32 modules float32, VAE float32); 832x480, 33 frames, 20 steps, guidance 5, one prompt
and a negative prompt, the same CPU-generator seed on both sides:

* **diffusers**: ``WanPipeline.__call__`` with its own attention processors and attention dispatch
  (``native``: ``F.scaled_dot_product_attention``, flash attention on an H200), timed first, before
  anything of mmpipe's touches the modules;
* **mmpipe**: ``from_diffusers(pipe)`` placed with ``place_graph``, the preset's ``model.kernels``
  resolved for the device (``auto``: mmpipe's Triton attention, fused norm + modulation and RoPE on
  CUDA) and swapped into the shared DiT, then ``T2VGraph.generate``.

Both sides share one set of modules (no copy of the 11 GB text encoder). Each side is warmed up once
with 2 steps (Triton's autotuning and compilation happen there), then timed ``--repeats`` times
with the device synchronised around each call. ``latency_ratio`` is the median of the per-repeat
mmpipe / diffusers ratios (below 1: mmpipe is faster); ``max_abs_diff`` and ``psnr_db`` compare the
last frames of each side (float arrays in [0, 1]); ``peak_mem_gib`` is each side's
``max_memory_allocated`` (weights included). Progress goes to stderr; the last stdout line is one
JSON object. SIGTERM (a caller's time limit) prints the JSON of what was measured and exits 124.

    python benchmarks/gpu_generate.py                      # the H200 run (~90 s with 1 repeat)
    python benchmarks/gpu_generate.py --device cpu --tiny  # the CPU rehearsal (a tiny architecture)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import signal
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from mmpipe.config import ModelConfig, compose_config, from_dict
from mmpipe.devices import resolve_device
from mmpipe.kernels import registry as kernels
from mmpipe.models.wan import T2VGraph, build_full_wan_pipeline, from_diffusers, place_graph
from mmpipe.report.recording import top_kernels
from mmpipe.runtime.trained import apply_kernels

PROMPT = "a red fox running through fresh snow in a quiet pine forest at sunrise"
NEGATIVE = "blurry static low quality distorted overexposed watermark text"
WARMUP_STEPS = 2
# --tiny: the preset's layout at toy widths (CPU rehearsal of the code path, not of the speed)
TINY_ARCH = {
    "text": {"vocab_size": 512, "d_model": 64, "d_kv": 8, "d_ff": 128, "num_layers": 2, "num_heads": 8},
    "vae": {"base_dim": 16, "num_res_blocks": 1},
    "dit": {"num_attention_heads": 2, "attention_head_dim": 32, "text_dim": 64, "ffn_dim": 128, "num_layers": 2},
}
TINY_SIZE = {"height": 64, "width": 96, "frames": 9}
STARTED = time.perf_counter()
REPORT: dict[str, Any] = {}  # filled as measured; what a SIGTERM still prints


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
    p.add_argument("--frames", type=int, default=None, help="default 33 (9 with --tiny)")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--guidance", type=float, default=5.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--profile", action="store_true", help="a 2-step call a side under torch.profiler: top kernels")
    args = p.parse_args(argv)
    full = {"height": 480, "width": 832, "frames": 33}
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


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (timings end when the GPU is done, not when Python is)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_diffusers(pipe: Any, args: argparse.Namespace, steps: int) -> np.ndarray:
    """``WanPipeline.__call__`` with its defaults but the sizes, steps, guidance and CPU-generator seed."""
    out = pipe(
        prompt=PROMPT,
        negative_prompt=NEGATIVE,
        height=args.height,
        width=args.width,
        num_frames=args.frames,
        num_inference_steps=steps,
        guidance_scale=args.guidance,
        generator=torch.Generator().manual_seed(args.seed),
        output_type="np",
    )
    return out.frames


def run_mmpipe(graph: T2VGraph, args: argparse.Namespace, steps: int) -> np.ndarray:
    """``T2VGraph.generate``, the call ``mmpipe generate`` makes (its recording aside)."""
    return graph.generate(
        PROMPT,
        NEGATIVE,
        height=args.height,
        width=args.width,
        num_frames=args.frames,
        num_inference_steps=steps,
        guidance_scale=args.guidance,
        seed=args.seed,
        output_type="np",
        progress=False,
    )


def measure(side: str, call: Callable[[int], np.ndarray], args: argparse.Namespace, device: torch.device) -> Any:
    """Warm ``call`` up with ``WARMUP_STEPS`` steps, then time ``args.repeats`` full calls into
    ``REPORT["latency_s_<side>"]``; returns the last call's frames."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    log(f"{side}: warm-up ({WARMUP_STEPS} steps)")
    call(WARMUP_STEPS)
    times = REPORT.setdefault(f"latency_s_{side}", [])
    frames = None
    for i in range(args.repeats):
        synchronize(device)
        start = time.perf_counter()
        frames = call(args.steps)
        synchronize(device)
        times.append(time.perf_counter() - start)
        log(f"{side}: repeat {i + 1}/{args.repeats}: {times[-1]:.2f} s")
    if device.type == "cuda":
        REPORT.setdefault("peak_mem_gib", {})[side] = torch.cuda.max_memory_allocated(device) / 2**30
    if args.profile:  # where a side's time goes: a 2-step call under the profiler
        REPORT[f"profile_{side}"] = top_kernels(lambda: call(WARMUP_STEPS))
    return frames


def compare(ours: np.ndarray, ref: np.ndarray) -> dict[str, float | None]:
    """Max absolute difference and PSNR (peak 1.0) of two float frame arrays in [0, 1]."""
    diff = ours.astype(np.float64) - ref.astype(np.float64)
    mse = float(np.mean(diff**2))
    psnr = None if mse == 0 else 10 * math.log10(1.0 / mse)  # None: identical (JSON has no infinity)
    return {"max_abs_diff": float(np.abs(diff).max()), "psnr_db": psnr, "frames_std": float(ref.std())}


def summarize() -> None:
    """The latency ratio (median of per-repeat mmpipe / diffusers) and its range, from what was measured."""
    pairs = list(zip(REPORT.get("latency_s_mmpipe", []), REPORT.get("latency_s_diffusers", []), strict=False))
    if pairs:
        ratios = [m / d for m, d in pairs]
        REPORT["latency_ratio"] = statistics.median(ratios)
        REPORT["latency_ratio_range"] = [min(ratios), max(ratios)]


def baseline_name(device: torch.device) -> str:
    """diffusers' version and its active attention backend (``native``: SDPA)."""
    import diffusers
    from diffusers.models.attention_dispatch import _AttentionBackendRegistry

    backend = _AttentionBackendRegistry.get_active_backend()[0]
    sdpa = "SDPA" if str(getattr(backend, "value", backend)) == "native" else str(backend)
    return f"diffusers WanPipeline.__call__ {diffusers.__version__}, attention {sdpa} on {device.type}"


def run(args: argparse.Namespace) -> None:
    """Build the pipeline, time diffusers, then mmpipe with its kernels, filling ``REPORT``."""
    device = torch.device(resolve_device(args.device, key="--device").value)
    spec = load_spec(args.model, tiny=args.tiny)
    choice = kernels.resolve(kernels.KernelChoice(**dataclasses.asdict(spec.kernels)), device)
    REPORT.update(
        baseline=baseline_name(device),
        device=device.type,
        gpu=torch.cuda.get_device_name(device) if device.type == "cuda" else None,
        torch=torch.__version__,
        model=spec.name + (" (tiny)" if args.tiny else ""),
        shape={"height": args.height, "width": args.width, "frames": args.frames, "steps": args.steps},
        guidance=args.guidance,
        kernels=dataclasses.asdict(choice),
    )
    log(f"building {REPORT['model']} on {device}")
    pipe: Any = build_full_wan_pipeline(spec, [PROMPT, NEGATIVE], device=device, seed=args.seed)
    pipe.set_progress_bar_config(disable=True)
    # placed before the baseline runs, so both sides run the very same tensors
    graph = place_graph(from_diffusers(pipe), device)
    ref = measure("diffusers", lambda steps: run_diffusers(pipe, args, steps), args, device)
    # use_kernels changes the shared DiT in place: only now, after the baseline is done
    apply_kernels(graph, choice)
    ours = measure("mmpipe", lambda steps: run_mmpipe(graph, args, steps), args, device)
    REPORT.update(compare(ours, ref))


def main(argv: list[str] | None = None) -> int:
    """Run, then print the JSON report last (also on an error: exit 1, and on SIGTERM: exit 124)."""
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, _deadline)
    status = 0
    try:
        with torch.no_grad():
            run(args)
    except _Deadline:
        REPORT["cut"] = "SIGTERM (time limit): the rest was not measured"
        status = 124
    except Exception as err:  # a failed side still reports what the other measured (one-shot GPU runs)
        traceback.print_exc()
        REPORT["error"] = f"{type(err).__name__}: {err}"
        status = 1
    summarize()
    REPORT["elapsed_s"] = time.perf_counter() - STARTED
    print(json.dumps(REPORT))
    return status


if __name__ == "__main__":
    sys.exit(main())
