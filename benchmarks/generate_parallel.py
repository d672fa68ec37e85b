"""One request's latency over 2 CPU ranks (1 thread each): Ulysses-2, ring-2 and CFG-2 against one
rank with 2 threads (the baseline: what ``mmpipe generate`` / ``WanPipeline`` run on this machine)
and one rank with 1 thread; diffusers' ``WanPipeline`` at 2 threads is timed too.

The model is the embedded default's architecture (``t2v_tiny``: UMT5 text encoder, the shipped
moving-shapes Wan VAE, a 4-layer Wan DiT; random DiT and text weights, saved with
``save_pretrained``) at a longer clip than it trains on, so the DiT's attention carries more of
the work: 65 frames at 128x128 (17 latent frames, 1,088 tokens), 20 steps, guidance 3.0.

Each mode's placement is what ``mmpipe generate nproc=2 placement=...`` runs: text on rank 0, the
denoiser over both ranks, the VAE decode over both ranks (split by latent frames) where the
placement says so. Every mode's processes start once, run one warm-up request and then
``--repeats`` requests; modes run in ``--rounds`` interleaved rounds, and repeat ``i`` of a mode is
paired with repeat ``i`` of the baseline: the ratio reported is the median of those per-repeat
ratios, with its range. ``max_err``: the largest absolute difference of the frames (values in
[0, 1]) from the baseline's.

    python benchmarks/generate_parallel.py [--steps 20 --frames 65 --size 128 --repeats 2 --rounds 2]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from mmpipe.assemble.inference import InferencePlacement, parse_inference_placement
from mmpipe.config import ModelConfig
from mmpipe.data import caption_vocabulary
from mmpipe.models.loading import from_diffusers
from mmpipe.models.wan import save_tiny_wan_pipeline
from mmpipe.runtime.inference import launch_ranks, place_inference_graph

TEXT_LEN = 16


def _rank(
    rank: int,
    world: int,
    path: Path,
    placement: InferencePlacement | None,
    call: dict[str, Any],
    repeats: int,
    threads: int,
    diffusers: bool,
) -> dict[str, Any]:
    torch.set_num_threads(threads)
    if diffusers:
        from diffusers import WanPipeline  # the baseline library, only in its own mode

        pipe = WanPipeline.from_pretrained(path)

        def run() -> np.ndarray:
            gen = torch.Generator().manual_seed(0)
            return np.asarray(pipe(**call, max_sequence_length=TEXT_LEN, generator=gen, output_type="np").frames)

    else:
        graph: Any = from_diffusers(path, max_sequence_length=TEXT_LEN)
        if placement is not None:
            place_inference_graph(graph, placement)

        def run() -> np.ndarray:
            return np.asarray(graph.generate(**call, seed=0, output_type="np", progress=False))

    times, out = [], None
    with torch.no_grad():
        for _ in range(repeats + 1):  # the first: warm-up
            dist.barrier()
            start = time.perf_counter()
            out = run()
            dist.barrier()
            times.append(time.perf_counter() - start)
    return {"times": times[1:], "out": out if rank == 0 else None}


MODES: dict[str, dict[str, Any]] = {
    "single_2threads": {"nproc": 1, "threads": 2},
    "single_1thread": {"nproc": 1, "threads": 1},
    "diffusers_2threads": {"nproc": 1, "threads": 2, "diffusers": True},
    "cfg2": {"denoise": {"ranks": [0, 1], "cfg": 2}},
    "ulysses2": {"denoise": {"ranks": [0, 1], "ulysses": 2}},
    "ring2": {"denoise": {"ranks": [0, 1], "ring": 2}},
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--frames", type=int, default=65)
    parser.add_argument("--size", type=int, default=128)
    parser.add_argument("--guidance", type=float, default=3.0)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--decode", choices=["parallel", "rank0"], default="parallel")
    args = parser.parse_args()
    call = {
        "prompt": "a red circle moving left",
        "height": args.size,
        "width": args.size,
        "num_frames": args.frames,
        "num_inference_steps": args.steps,
        "guidance_scale": args.guidance,
    }
    decode = [0, 1] if args.decode == "parallel" else [0]
    times: dict[str, list[float]] = {m: [] for m in MODES}
    outs: dict[str, np.ndarray] = {}
    with tempfile.TemporaryDirectory() as tmp:
        path = save_tiny_wan_pipeline(ModelConfig(), caption_vocabulary(), Path(tmp) / "pipeline", seed=0)
        for r in range(args.rounds):
            order = list(MODES) if r % 2 == 0 else list(reversed(MODES))
            for mode in order:
                spec = MODES[mode]
                nproc = spec.get("nproc", 2)
                placement = None
                if nproc > 1:
                    raw = {"text": [0], "denoise": spec["denoise"], "decode": decode}
                    placement = parse_inference_placement(raw, nproc, guided=args.guidance > 1)
                res = launch_ranks(
                    _rank,
                    nproc,
                    path,
                    placement,
                    call,
                    args.repeats,
                    spec.get("threads", 1),
                    spec.get("diffusers", False),
                    timeout_s=3600,
                )
                times[mode] += res[0]["times"]
                outs[mode] = res[0]["out"]
    base = times["single_2threads"]
    modes = []
    for mode in MODES:
        ratios = [t / b for t, b in zip(times[mode], base, strict=True)]
        modes.append(
            {
                "mode": mode,
                "latency_s": round(statistics.median(times[mode]), 3),
                "vs_single_2threads": round(statistics.median(ratios), 3),
                "vs_single_2threads_range": [round(min(ratios), 3), round(max(ratios), 3)],
                "max_err": float(np.abs(outs[mode] - outs["single_2threads"]).max()),
            }
        )
    parallel = [m for m in modes if m["mode"] in ("cfg2", "ulysses2", "ring2")]
    best = min(parallel, key=lambda m: m["vs_single_2threads"])
    print(
        json.dumps(
            {
                "benchmark": "generate_parallel",
                "baseline": "one rank, 2 threads (mmpipe generate / diffusers WanPipeline on this machine)",
                "model": "t2v_tiny architecture (shipped shapes VAE, random DiT / text weights)",
                "workload": call | {"latent_tokens": ((args.frames - 1) // 4 + 1) * (args.size // 16) ** 2},
                "decode": args.decode,
                "samples_per_mode": len(base),
                "modes": modes,
                "best_mode": best["mode"],
                "best_vs_single_2threads": best["vs_single_2threads"],
            }
        )
    )


if __name__ == "__main__":
    main()
