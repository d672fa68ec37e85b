"""A probe of the local transport: two gloo processes ping-pong messages of two sizes through
:mod:`mmpipe.runtime.transport`, and all-gather tensors of two sizes as FSDP does; linear fits
give per-message and per-collective latency and bandwidth."""

from __future__ import annotations

import os
import statistics
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from mmpipe.runtime import procs
from mmpipe.runtime.launch import free_port
from mmpipe.runtime.transport import isend_tensors, recv_tensors

SIZES = (1 << 10, 1 << 22)  # bytes: latency-bound and bandwidth-bound messages
COLLECTIVE_SIZES = (1 << 20, 1 << 24)
ROUNDS = 20


def _worker(rank: int, port: int, queue: mp.SimpleQueue, env: dict[str, str]) -> None:
    procs.adopt_environment(env)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=timedelta(seconds=60))
    try:
        out: dict[int | tuple[str, int], float] = {}  # message bytes; ("all_gather", output bytes)
        for size in SIZES:
            payload = [torch.zeros(size // 4)]
            times = []
            for i in range(ROUNDS + 2):
                t0 = time.perf_counter()
                if rank == 0:
                    for w in isend_tensors(payload, 1, tag=i):
                        w.wait()
                    recv_tensors(1, tag=i, expected=1)
                else:
                    recv_tensors(0, tag=i, expected=1)
                    for w in isend_tensors(payload, 0, tag=i):
                        w.wait()
                if i >= 2:
                    times.append((time.perf_counter() - t0) / 2)  # one direction
            out[size] = statistics.median(times)
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        for size in COLLECTIVE_SIZES:  # bytes gathered (the output), as FSDP's parameter all-gather
            shard = torch.zeros(size // 4 // 2)
            full = torch.empty(size // 4)
            times = []
            for i in range(ROUNDS + 2):
                dist.barrier()
                t0 = time.perf_counter()
                gather(full, shard)
                if i >= 2:
                    times.append(time.perf_counter() - t0)
            out[("all_gather", size)] = statistics.median(times)
        if rank == 0:
            queue.put(out)
    finally:
        dist.destroy_process_group()


def probe_transport() -> dict[str, float]:
    """Two local ranks' ``latency_s`` / ``bandwidth`` (one point-to-point message) and
    ``collective_latency_s`` / ``collective_bandwidth`` (an all-gather over both, by output bytes)."""
    queue = procs.context([__name__]).SimpleQueue()
    mp.start_processes(
        _worker, args=(free_port(), queue, procs.environment()), nprocs=2, start_method=procs.START_METHOD
    )
    times = queue.get()
    out = {}
    for prefix, (small, large), key in (
        ("", SIZES, lambda n: n),
        ("collective_", COLLECTIVE_SIZES, lambda n: ("all_gather", n)),
    ):
        bandwidth = (large - small) / max(times[key(large)] - times[key(small)], 1e-9)
        out[f"{prefix}latency_s"] = max(times[key(small)] - small / bandwidth, 0.0)
        out[f"{prefix}bandwidth"] = bandwidth
    return out
