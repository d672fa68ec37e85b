"""diffusers' ``WanPipeline.__call__`` one request after another, against ``mmpipe serve``, side by side.

Same tiny random-weight Wan components (saved once with ``save_pretrained``), same prompts, seeds
and settings on both sides:

* **diffusers**: ``N`` requests through ``pipe(...)`` one after another, in this process, with
  torch's default threads (all cores).
* **mmpipe**: the engine with a 2-group placement (default: text on group 0, DiT replicas on
  groups 0 and 1, VAE decode on both, where the request denoised; one worker process and ``cores / 2`` threads per group)
  behind the real HTTP server; ``--clients`` concurrent clients (the official ``openai`` client, one
  thread each) send the same ``N`` requests, each client creating a video, polling it every 10 ms
  and downloading the MP4, one request after another.

Latency is what a client sees, from ``videos.create`` to the completed status. ``p50_ratio`` is the
p50 under load over the latency of one unloaded request through the same server (median of
``--unloaded`` requests sent alone). ``outputs_equal``: every served video's frames (uint8, before
MP4 encoding) bitwise equal to diffusers' for the same seed. The last stdout line is one JSON object.

    python benchmarks/serve.py                    # 8 requests, 2 clients, 17 x 64 x 64, 20 steps (~1 min)
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from diffusers import WanPipeline

from mmpipe.config import ModelConfig, ServeConfig
from mmpipe.data import caption_vocabulary, frames_to_uint8
from mmpipe.models.wan import save_tiny_wan_pipeline
from mmpipe.serve.engine import Engine
from mmpipe.serve.server import HttpServer, bind

PROMPTS = [
    "a red circle moving left",
    "a blue square moving up",
    "a green triangle moving right",
    "a yellow circle moving down",
]


def percentile(values: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(values), q))


def run_diffusers(path: Path, args: argparse.Namespace, seeds: list[int]) -> dict[str, Any]:
    pipe: Any = WanPipeline.from_pretrained(path)
    pipe.set_progress_bar_config(disable=True)

    def call(i: int) -> np.ndarray:
        out = pipe(
            prompt=PROMPTS[i % len(PROMPTS)],
            negative_prompt="",
            height=args.height,
            width=args.width,
            num_frames=args.frames,
            num_inference_steps=args.steps,
            guidance_scale=args.guidance,
            generator=torch.Generator().manual_seed(seeds[i]),
            output_type="np",
            max_sequence_length=args.text_len,
        ).frames[0]
        return frames_to_uint8(out)

    call(0)  # warm-up
    latencies, frames = [], []
    start = time.perf_counter()
    for i in range(args.requests):
        t0 = time.perf_counter()
        frames.append(call(i))
        latencies.append(time.perf_counter() - t0)
    total = time.perf_counter() - start
    return {"latencies": latencies, "total": total, "frames": frames}


@contextlib.contextmanager
def serving(cfg: ServeConfig) -> Iterator[tuple[Engine, Any]]:
    """The engine of ``cfg`` behind the real HTTP server on a free port, and an ``openai`` client of
    it; on exit the server stops and the engine closes without draining."""
    import openai

    engine = Engine(cfg)
    try:
        http = HttpServer(engine, bind("127.0.0.1", 0), log_level="warning").start()
    except BaseException:
        engine.close(drain=False)
        raise
    try:
        yield engine, openai.OpenAI(base_url=f"{http.url}/v1", api_key="unused", max_retries=0)
    finally:
        http.stop()
        http.join(10)
        engine.close(drain=False)


def request_video(client: Any, model: str, prompt: str, seed: int, args: argparse.Namespace) -> tuple[float, str]:
    """One video through the API as a client makes it: create, poll every 10 ms until final, download
    the MP4; returns the latency (create to completed status) and the video id."""
    t0 = time.perf_counter()
    video = client.videos.create(
        model=model,
        prompt=prompt,
        size=f"{args.width}x{args.height}",
        extra_body={"seed": seed, "frames": args.frames, "steps": args.steps, "guidance": args.guidance},
    )
    while video.status not in ("completed", "failed"):
        time.sleep(0.01)
        video = client.videos.retrieve(video.id)
    latency = time.perf_counter() - t0
    if video.status != "completed":
        raise RuntimeError(f"request with seed {seed} failed: {video.error}")
    client.videos.download_content(video.id).read()
    return latency, video.id


def run_clients(one: Callable[[int], Any], requests: int, clients: int, results: dict[int, Any]) -> float:
    """``clients`` threads sending requests ``0..requests-1`` through ``one``, each client one request
    after another; ``results[i]`` is set as request ``i`` finishes. Returns the wall time."""
    next_index = iter(range(requests))
    lock = threading.Lock()

    def client_loop() -> None:
        while True:
            with lock:
                i = next(next_index, None)
            if i is None:
                return
            results[i] = one(i)

    start = time.perf_counter()
    threads = [threading.Thread(target=client_loop, daemon=True) for _ in range(clients)]  # a SIGTERM ends them too
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return time.perf_counter() - start


def run_mmpipe(path: Path, args: argparse.Namespace, seeds: list[int], run_dir: Path) -> dict[str, Any]:
    cfg = ServeConfig(
        pipeline=str(path),
        run_dir=str(run_dir),
        text_len=args.text_len,
        placement=json.loads(args.placement),
        max_batch=args.max_batch,
        max_wait_ms=args.max_wait_ms,
        height=args.height,
        width=args.width,
        frames=args.frames,
        steps=args.steps,
        guidance=args.guidance,
    )
    with serving(cfg) as (engine, client):

        def one(i: int) -> tuple[float, str]:
            return request_video(client, cfg.model_name, PROMPTS[i % len(PROMPTS)], seeds[i], args)

        one(0)  # warm-up
        unloaded = [one(i)[0] for i in range(args.unloaded)]
        results: dict[int, tuple[float, str]] = {}
        total = run_clients(one, args.requests, args.clients, results)
        frames = []
        for i in range(args.requests):
            job = engine.get(results[i][1])
            assert job is not None and job.frames is not None
            frames.append(job.frames)
        placement = engine.placement_text()
    return {
        "latencies": [results[i][0] for i in range(args.requests)],
        "unloaded": unloaded,
        "total": total,
        "frames": frames,
        "placement": placement,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--clients", type=int, default=2)
    parser.add_argument("--unloaded", type=int, default=3, help="requests sent alone for the unloaded latency")
    parser.add_argument("--frames", type=int, default=17)
    parser.add_argument("--height", type=int, default=64)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--guidance", type=float, default=3.0)
    parser.add_argument("--text-len", type=int, default=16)
    parser.add_argument("--max-batch", type=int, default=4)
    parser.add_argument("--max-wait-ms", type=float, default=5.0)
    parser.add_argument("--run-dir", default=None, help="keep the server's run directory (for mmpipe report)")
    parser.add_argument("--placement", default='{"text": [0], "denoise": [0, 1], "decode": [0, 1]}')
    args = parser.parse_args()

    seeds = [1000 + i for i in range(args.requests)]
    with tempfile.TemporaryDirectory() as tmp:
        path = save_tiny_wan_pipeline(ModelConfig(), [*caption_vocabulary(), *PROMPTS], Path(tmp) / "wan", seed=0)
        base = run_diffusers(path, args, seeds)
        ours = run_mmpipe(path, args, seeds, Path(args.run_dir) if args.run_dir else Path(tmp) / "serve_run")
    equal = all(np.array_equal(a, b) for a, b in zip(base["frames"], ours["frames"], strict=True))
    base_vpm = 60 * args.requests / base["total"]
    ours_vpm = 60 * args.requests / ours["total"]
    unloaded = statistics.median(ours["unloaded"])
    p50 = percentile(ours["latencies"], 50)
    print(ours["placement"])
    print(
        f"diffusers: {base_vpm:.1f} videos/min, p50 {percentile(base['latencies'], 50):.3f} s; "
        f"mmpipe: {ours_vpm:.1f} videos/min, p50 {p50:.3f} s (unloaded {unloaded:.3f} s)"
    )
    result = {
        "device": "cpu",
        "torch_threads_diffusers": torch.get_num_threads(),
        "requests": args.requests,
        "clients": args.clients,
        "shape": f"{args.frames}x{args.height}x{args.width}",
        "steps": args.steps,
        "guidance": args.guidance,
        "placement": json.loads(args.placement),
        "max_batch": args.max_batch,
        "diffusers_videos_per_min": round(base_vpm, 2),
        "mmpipe_videos_per_min": round(ours_vpm, 2),
        "throughput_ratio": round(ours_vpm / base_vpm, 3),
        "diffusers_p50_s": round(percentile(base["latencies"], 50), 4),
        "diffusers_p99_s": round(percentile(base["latencies"], 99), 4),
        "mmpipe_p50_s": round(p50, 4),
        "mmpipe_p99_s": round(percentile(ours["latencies"], 99), 4),
        "mmpipe_unloaded_s": round(unloaded, 4),
        "p50_ratio": round(p50 / unloaded, 3),
        "p50_vs_diffusers": round(p50 / percentile(base["latencies"], 50), 3),
        "outputs_equal": equal,
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
