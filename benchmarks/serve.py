"""``mmpipe serve`` against the three ways a user would serve the same model with diffusers, side by side.

Same tiny random-weight Wan components (saved once with ``save_pretrained``), same prompts, seeds
and settings on every side (``--requests`` requests, 32 by default):

* **diffusers sequential**: ``WanPipeline.__call__`` one request after another in this process,
  torch's default threads (all cores).
* **diffusers batched**: the same requests ``--max-batch`` at a time as lists in one call (prompts,
  negative prompts and one seeded generator per request), all cores.
* **diffusers x2 processes**: two processes with one thread each, sharing the requests (each takes
  the next one as it finishes its last).
* **mmpipe**: the engine with a 2-group placement (default: text on group 0, DiT replicas on
  groups 0 and 1, VAE decode on both, where the request denoised; one worker process and
  ``cores / 2`` threads per group) behind the real HTTP server, in a process of its own (as
  ``mmpipe serve`` runs; the clients run in this one, on the same cores); ``--clients`` concurrent clients
  (``--max-batch`` by default: as many requests in flight as the batched baseline batches; the
  official ``openai`` client, one thread each) send the requests, each client creating a video,
  retrieving it as the server's ``openai-poll-after-ms`` says (as the SDK's ``videos.poll``;
  ``--poll-ms``: a fixed interval) and downloading the MP4, one request after another.

Throughput is requests over the wall time of the timed requests (after one warm-up request or batch
a side). ``throughput_vs_best_baseline`` is mmpipe's over the best of the three baselines. Latency
is what a client sees, from ``videos.create`` to the completed status (diffusers: the call; batched:
the call that held the request); ``cpu_s_per_request``: the CPU seconds a timed mmpipe request
took in the clients' process and in the server's process tree (workers included), beside the
cores x wall seconds it had; ``p50_ratio`` is mmpipe's p50 under load over one unloaded
request through the same server (median of ``--unloaded`` requests sent alone). ``outputs_equal``:
every served video's frames (uint8, before MP4 encoding) bitwise equal to sequential diffusers' for
the same seed (``batched_outputs_equal``, ``processes_outputs_equal``: the same for those
baselines). The last stdout line is one JSON object.

    python benchmarks/serve.py                    # 32 requests, 4 clients, 17 x 64 x 64, 20 steps (~3 min)
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing as mp
import os
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


def load_pipeline(path: Path) -> Any:
    pipe: Any = WanPipeline.from_pretrained(path)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def diffusers_call(pipe: Any, args: argparse.Namespace, seeds: list[int], indices: list[int]) -> list[np.ndarray]:
    """One ``WanPipeline.__call__`` over the requests ``indices`` (a list of one: a plain request);
    their uint8 frames."""
    out = pipe(
        prompt=[PROMPTS[i % len(PROMPTS)] for i in indices],
        negative_prompt=[""] * len(indices),
        height=args.height,
        width=args.width,
        num_frames=args.frames,
        num_inference_steps=args.steps,
        guidance_scale=args.guidance,
        generator=[torch.Generator().manual_seed(seeds[i]) for i in indices],
        output_type="np",
        max_sequence_length=args.text_len,
    ).frames
    return [frames_to_uint8(f) for f in out]


def run_diffusers(path: Path, args: argparse.Namespace, seeds: list[int], batch: int = 1) -> dict[str, Any]:
    """The requests through ``WanPipeline.__call__``, ``batch`` at a time, in this process."""
    pipe = load_pipeline(path)
    diffusers_call(pipe, args, seeds, list(range(min(batch, args.requests))))  # warm-up
    latencies, frames = [], []
    start = time.perf_counter()
    for first in range(0, args.requests, batch):
        indices = list(range(first, min(first + batch, args.requests)))
        t0 = time.perf_counter()
        frames += diffusers_call(pipe, args, seeds, indices)
        latencies += [time.perf_counter() - t0] * len(indices)
    total = time.perf_counter() - start
    return {"latencies": latencies, "total": total, "frames": frames}


def _process_worker(
    path: Path, args: argparse.Namespace, seeds: list[int], work: Any, ready: Any, go: Any, out: Any
) -> None:
    torch.set_num_threads(1)
    pipe = load_pipeline(path)
    diffusers_call(pipe, args, seeds, [0])  # warm-up
    ready.put(os.getpid())
    go.wait()
    while True:
        i = work.get()
        if i is None:
            return
        t0 = time.perf_counter()
        frames = diffusers_call(pipe, args, seeds, [i])[0]
        out.put((i, time.perf_counter() - t0, frames))


def run_diffusers_processes(path: Path, args: argparse.Namespace, seeds: list[int], n: int = 2) -> dict[str, Any]:
    """``n`` processes with one thread each, taking the requests from one queue."""
    ctx = mp.get_context("spawn")
    work, ready, out, go = ctx.Queue(), ctx.Queue(), ctx.Queue(), ctx.Event()
    procs = [ctx.Process(target=_process_worker, args=(path, args, seeds, work, ready, go, out)) for _ in range(n)]
    for p in procs:
        p.start()
    try:
        for _ in procs:
            ready.get(timeout=600)
        for i in range(args.requests):
            work.put(i)
        for _ in procs:
            work.put(None)
        start = time.perf_counter()
        go.set()
        results = {}
        for _ in range(args.requests):
            i, latency, frames = out.get(timeout=600)
            results[i] = (latency, frames)
        total = time.perf_counter() - start
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
    return {
        "latencies": [results[i][0] for i in range(args.requests)],
        "total": total,
        "frames": [results[i][1] for i in range(args.requests)],
    }


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


def _server_process(cfg: ServeConfig, conn: Any) -> None:
    """:func:`serving` in a process of its own, as ``mmpipe serve`` runs it: sends the API's base
    URL, then answers one message (the ids of the served videos) with their frames and the
    placement, and stops."""
    with serving(cfg) as (engine, client):
        conn.send(str(client.base_url))
        jobs = [engine.get(i) for i in conn.recv()]
        conn.send(([j.frames if j is not None else None for j in jobs], engine.placement_text()))


@contextlib.contextmanager
def serving_process(cfg: ServeConfig) -> Iterator[tuple[Any, Any]]:
    """:func:`serving` with the server in a child process (its own interpreter and GIL, as a deployed
    server is), and an ``openai`` client of it here; yields the client and the pipe that
    :func:`_server_process` answers on."""
    import openai

    ctx = mp.get_context("spawn")
    here, there = ctx.Pipe()
    proc = ctx.Process(target=_server_process, args=(cfg, there))
    proc.start()
    try:
        if not here.poll(600):
            raise RuntimeError("the mmpipe server did not start within 600 s")
        yield openai.OpenAI(base_url=here.recv(), api_key="unused", max_retries=0), here, proc.pid
    finally:
        proc.join(60)
        if proc.is_alive():
            proc.kill()


def request_video(client: Any, model: str, prompt: str, seed: int, args: argparse.Namespace) -> tuple[float, str]:
    """One video through the API as a client makes it: create, retrieve until final, waiting between
    retrieves what the server's ``openai-poll-after-ms`` says (as the SDK's ``videos.poll`` does;
    ``--poll-ms`` > 0: that fixed interval instead), download the MP4; returns the latency (create to
    completed status) and the video id."""
    t0 = time.perf_counter()
    video = client.videos.create(
        model=model,
        prompt=prompt,
        size=f"{args.width}x{args.height}",
        extra_body={"seed": seed, "frames": args.frames, "steps": args.steps, "guidance": args.guidance},
    )
    while True:
        raw = client.videos.with_raw_response.retrieve(video.id)
        video = raw.parse()
        if video.status in ("completed", "failed"):
            break
        time.sleep((args.poll_ms or int(raw.headers.get("openai-poll-after-ms", 1000))) / 1000)
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


def _tree_cpu_s(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` and its live descendants."""
    import psutil

    root = psutil.Process(pid)
    total = 0.0
    for proc in [root, *root.children(recursive=True)]:
        with contextlib.suppress(psutil.NoSuchProcess):
            times = proc.cpu_times()
            total += times.user + times.system
    return total


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
    with serving_process(cfg) as (client, server, server_pid):

        def one(i: int) -> tuple[float, str]:
            return request_video(client, cfg.model_name, PROMPTS[i % len(PROMPTS)], seeds[i], args)

        one(0)  # warm-up
        unloaded = [one(i)[0] for i in range(args.unloaded)]
        results: dict[int, tuple[float, str]] = {}
        # CPU seconds of the timed requests: the clients (this process, every thread) and the server
        # with its worker groups (its process tree), to show where the 2 cores went
        clients_cpu, serving_cpu = time.process_time(), _tree_cpu_s(server_pid)
        total = run_clients(one, args.requests, args.clients, results)
        clients_cpu, serving_cpu = time.process_time() - clients_cpu, _tree_cpu_s(server_pid) - serving_cpu
        server.send([results[i][1] for i in range(args.requests)])
        if not server.poll(600):
            raise RuntimeError("the mmpipe server did not return the served frames within 600 s")
        frames, placement = server.recv()
        assert all(f is not None for f in frames), "a served video was dropped before its frames were read"
    return {
        "latencies": [results[i][0] for i in range(args.requests)],
        "unloaded": unloaded,
        "total": total,
        "clients_cpu_s": clients_cpu,
        "serving_cpu_s": serving_cpu,
        "frames": frames,
        "placement": placement,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--clients", type=int, default=0, help="mmpipe's concurrent clients (default: --max-batch)")
    parser.add_argument("--unloaded", type=int, default=3, help="requests sent alone for the unloaded latency")
    parser.add_argument("--frames", type=int, default=17)
    parser.add_argument("--height", type=int, default=64)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--guidance", type=float, default=3.0)
    parser.add_argument("--text-len", type=int, default=16)
    parser.add_argument("--max-batch", type=int, default=4)
    parser.add_argument("--max-wait-ms", type=float, default=5.0)
    parser.add_argument(
        "--poll-ms", type=float, default=0.0, help="mmpipe clients' fixed retrieve interval (0: the server's hint)"
    )
    parser.add_argument("--run-dir", default=None, help="keep the server's run directory (for mmpipe report)")
    parser.add_argument("--placement", default='{"text": [0], "denoise": [0, 1], "decode": [0, 1]}')
    args = parser.parse_args()
    if args.requests < 1 or args.max_batch < 1:
        parser.error(f"--requests={args.requests} and --max-batch={args.max_batch} must be positive")
    args.clients = args.clients or args.max_batch

    seeds = [1000 + i for i in range(args.requests)]
    with tempfile.TemporaryDirectory() as tmp:
        path = save_tiny_wan_pipeline(ModelConfig(), [*caption_vocabulary(), *PROMPTS], Path(tmp) / "wan", seed=0)
        sides = {
            "diffusers_sequential": run_diffusers(path, args, seeds),
            "diffusers_batched": run_diffusers(path, args, seeds, batch=args.max_batch),
            "diffusers_2_processes": run_diffusers_processes(path, args, seeds),
        }
        ours = run_mmpipe(path, args, seeds, Path(args.run_dir) if args.run_dir else Path(tmp) / "serve_run")
    reference = sides["diffusers_sequential"]["frames"]

    def same(frames: list[np.ndarray]) -> bool:
        return all(np.array_equal(a, b) for a, b in zip(reference, frames, strict=True))

    vpm = {name: 60 * args.requests / side["total"] for name, side in sides.items()}
    best = max(vpm, key=vpm.__getitem__)
    ours_vpm = 60 * args.requests / ours["total"]
    unloaded = statistics.median(ours["unloaded"])
    p50, p99 = percentile(ours["latencies"], 50), percentile(ours["latencies"], 99)
    print(ours["placement"])
    for name, side in sides.items():
        print(f"{name}: {vpm[name]:.1f} videos/min, p50 {percentile(side['latencies'], 50):.3f} s")
    print(f"mmpipe: {ours_vpm:.1f} videos/min, p50 {p50:.3f} s, p99 {p99:.3f} s (unloaded {unloaded:.3f} s)")
    result = {
        "device": "cpu",
        "cores": os.cpu_count(),
        "requests": args.requests,
        "clients": args.clients,
        "poll": f"every {args.poll_ms:g} ms" if args.poll_ms else "openai-poll-after-ms",
        "shape": f"{args.frames}x{args.height}x{args.width}",
        "steps": args.steps,
        "guidance": args.guidance,
        "placement": json.loads(args.placement),
        "max_batch": args.max_batch,
        "baselines": {name: round(v, 2) for name, v in vpm.items()},
        "best_baseline": best,
        "mmpipe_videos_per_min": round(ours_vpm, 2),
        "throughput_vs_best_baseline": round(ours_vpm / vpm[best], 3),
        "throughput_vs_baselines": {name: round(ours_vpm / v, 3) for name, v in vpm.items()},
        "baseline_p50_s": {name: round(percentile(side["latencies"], 50), 4) for name, side in sides.items()},
        "p50_s": round(p50, 4),
        "p99_s": round(p99, 4),
        "unloaded_s": round(unloaded, 4),
        "p50_ratio": round(p50 / unloaded, 3),
        # where the cores went while mmpipe served the timed requests: CPU seconds a request
        "cpu_s_per_request": {
            "clients": round(ours["clients_cpu_s"] / args.requests, 4),
            "server_and_workers": round(ours["serving_cpu_s"] / args.requests, 4),
            "cores_x_wall": round((os.cpu_count() or 1) * ours["total"] / args.requests, 4),
        },
        "outputs_equal": same(ours["frames"]),
        "batched_outputs_equal": same(sides["diffusers_batched"]["frames"]),
        "processes_outputs_equal": same(sides["diffusers_2_processes"]["frames"]),
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
