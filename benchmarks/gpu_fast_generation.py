"""Step caches and regional compilation of ``mmpipe generate`` on one GPU, against the same graph
uncached and eager, side by side in one run (issue 33's H200 figures).

Wan2.1-T2V-1.3B's architecture (``model=wan1_3b_t2v``) with random weights built on the device
(``build_full_wan_pipeline``: text encoder and DiT bf16, VAE float32), 832x480 x 33 frames, 20
steps, guidance 5, the generate path's kernels (``model.kernels`` resolved for the device). Rows:
``none`` (the baseline: uncached, eager), each ``cache.policy`` at its default threshold
(``mag`` with MagCache's published Wan2.1-1.3B ratios, which the architecture matches), and
``compile=true`` (regional: each DiT block compiled in place). Each row is warmed up with one full
call (compilation, autotuning, and for a cache its first request), then timed ``--repeats`` times;
``speedup`` is the median of per-repeat baseline / row ratios, ``psnr_db`` compares the row's
frames with the baseline's (peak 1.0). Random weights change much more between steps than trained
ones, so how often ``first_block`` / ``teacache`` skip says little about a real checkpoint; MagCache
skips on its ratios' schedule. The last stdout line is one JSON object; SIGTERM prints what was
measured and exits 124.

    python benchmarks/gpu_fast_generation.py                       # the H200 run (~4 min)
    python benchmarks/gpu_fast_generation.py --device cpu --tiny   # the CPU rehearsal
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import signal
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import numpy as np
import torch

from mmpipe.config import StepCacheConfig
from mmpipe.devices import resolve_device
from mmpipe.kernels import registry as kernels
from mmpipe.models.wan import build_full_wan_pipeline, from_diffusers, place_graph
from mmpipe.runtime.inference import configure_denoiser
from mmpipe.runtime.trained import apply_kernels
from mmpipe.stages.cache import StepCache, remove_cache


def _sibling(name: str) -> Any:
    """``benchmarks/<name>.py`` loaded by its path (``python -P`` keeps this folder off sys.path)."""
    spec = importlib.util.spec_from_file_location(f"_benchmarks_{name}", Path(__file__).with_name(f"{name}.py"))
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_gen = _sibling("gpu_generate")
PROMPT, NEGATIVE, compare, load_spec, log, parse_args, synchronize = (
    _gen.PROMPT,
    _gen.NEGATIVE,
    _gen.compare,
    _gen.load_spec,
    _gen.log,
    _gen.parse_args,
    _gen.synchronize,
)

REPORT: dict[str, Any] = {"benchmark": "gpu_fast_generation", "baseline": "the same graph uncached, eager"}
ROWS = ("none", "first_block", "teacache", "mag", "compile")


def _deadline(signum: int, frame: Any) -> None:
    print(json.dumps(REPORT), flush=True)
    sys.exit(124)


def run(args: Any) -> None:
    device = torch.device(resolve_device(args.device, key="--device").value)
    spec = load_spec(args.model, tiny=args.tiny)
    choice = kernels.resolve(kernels.KernelChoice(**dataclasses.asdict(spec.kernels)), device)
    REPORT.update(
        device=device.type,
        gpu=torch.cuda.get_device_name(device) if device.type == "cuda" else None,
        torch=torch.__version__,
        model=spec.name + (" (tiny)" if args.tiny else ""),
        shape={"height": args.height, "width": args.width, "frames": args.frames, "steps": args.steps},
        guidance=args.guidance,
    )
    pipe: Any = build_full_wan_pipeline(spec, [PROMPT, NEGATIVE], device=device, seed=args.seed)
    graph: Any = place_graph(from_diffusers(pipe), device)
    apply_kernels(graph, choice)
    call = dict(
        prompt=PROMPT,
        negative_prompt=NEGATIVE,
        height=args.height,
        width=args.width,
        num_frames=args.frames,
        num_inference_steps=args.steps,
        guidance_scale=args.guidance,
        seed=args.seed,
        output_type="np",
        progress=False,
    )
    times: dict[str, list[float]] = {}
    frames: dict[str, np.ndarray] = {}
    rows: list[dict[str, Any]] = []
    REPORT["rows"] = rows
    for row in ROWS:
        denoise = graph.denoise
        remove_cache(denoise.module)  # the previous row's hooks
        if row == "compile":
            denoise.step_cache = StepCache()
            configure_denoiser(graph, StepCacheConfig(), compile=True)
        else:
            denoise.step_cache = StepCache()
            if row != "none":
                configure_denoiser(graph, StepCacheConfig(policy=row), compile=False)
        log(f"{row}: warm-up")
        with torch.no_grad():
            graph.generate(**call)
            times[row] = []
            for _ in range(args.repeats):
                synchronize(device)
                start = time.perf_counter()
                frames[row] = graph.generate(**call)
                synchronize(device)
                times[row].append(time.perf_counter() - start)
        ratios = [b / t for b, t in zip(times["none"], times[row], strict=True)]
        rows.append(
            {
                "row": row,
                "latency_s": statistics.median(times[row]),
                "speedup": statistics.median(ratios),
                "speedup_range": [min(ratios), max(ratios)],
            }
            | compare(frames[row], frames["none"])
        )
        log(f"{row}: {rows[-1]['latency_s']:.2f} s, x{rows[-1]['speedup']:.2f}")


def main() -> int:
    args = parse_args()
    signal.signal(signal.SIGTERM, _deadline)
    status = 0
    try:
        run(args)
    except Exception:
        REPORT["error"] = traceback.format_exc(limit=3)
        status = 1
    print(json.dumps(REPORT), flush=True)
    return status


if __name__ == "__main__":
    sys.exit(main())
