"""Run a function on ``world`` gloo processes and collect what each returns (rank order)."""

from __future__ import annotations

import io
import os
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from mmpipe.runtime import procs
from mmpipe.runtime.launch import free_port


def _entry(
    rank: int, world: int, port: int, fn: Callable[..., Any], args: tuple[Any, ...], queue: Any, env: dict[str, str]
) -> None:
    procs.adopt_environment(env)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        # Serialised, not shared: a tensor sent through the queue would live in this process's
        # shared memory, which is gone once it exits.
        buf = io.BytesIO()
        torch.save(fn(rank, world, *args), buf)
        queue.put((rank, buf.getvalue(), None))
    except Exception:
        queue.put((rank, None, traceback.format_exc()))
        raise
    finally:
        dist.destroy_process_group()


def run_workers(fn: Callable[..., Any], world: int, *args: Any, timeout: float = 300) -> list[Any]:
    """``[fn(rank, world, *args) for each rank]``, each in its own process; a worker's error fails the caller."""
    ctx = procs.context()
    queue = ctx.Queue()
    port, env = free_port(), procs.environment()
    workers = [ctx.Process(target=_entry, args=(r, world, port, fn, args, queue, env)) for r in range(world)]
    for p in workers:
        p.start()
    results: dict[int, Any] = {}
    try:
        for _ in workers:
            rank, value, error = queue.get(timeout=timeout)
            if error is not None:
                raise AssertionError(f"rank {rank} failed:\n{error}")
            results[rank] = torch.load(io.BytesIO(value), weights_only=False)
    finally:
        for p in workers:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    return [results[r] for r in range(world)]
