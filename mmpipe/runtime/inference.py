"""One request over several processes: an inference graph's stages placed by an
:class:`~mmpipe.assemble.inference.InferencePlacement`, and the local launch of its ranks.

Every rank runs the graph's ``generate`` with the same arguments (SPMD). A stage on one rank is
computed there and its outputs broadcast (the prompt's embeddings, the decoded video); the
denoiser runs over its group (:meth:`DenoiseStage.parallelize`), and a rank outside that group
receives the denoised latents from the group's first rank.
"""

from __future__ import annotations

import datetime
import io
import os
import traceback
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist

from mmpipe.assemble.inference import InferencePlacement
from mmpipe.config import StepCacheConfig
from mmpipe.errors import WorkerFailure
from mmpipe.graph import Graph, Stage
from mmpipe.parallel.denoise import DenoiseGroup
from mmpipe.runtime import procs
from mmpipe.runtime.executor import compile_blocks
from mmpipe.runtime.launch import free_port
from mmpipe.stages.cache import StepCache


class BroadcastHost:
    """A stage computed on (global) rank ``src`` alone, its outputs broadcast to the ranks of
    ``group`` (the world by default)."""

    def __init__(self, src: int, group: dist.ProcessGroup | None = None) -> None:
        self.src, self.group = src, group

    def __call__(self, stage: Stage, inputs: Mapping[str, Any], options: dict[str, Any]) -> dict[str, Any]:
        out: list[dict[str, Any] | None] = [stage(inputs, **options) if dist.get_rank() == self.src else None]
        dist.broadcast_object_list(out, src=self.src, group=self.group)
        assert out[0] is not None
        return out[0]


class GroupHost:
    """A stage computed by the ranks of ``ranks`` together (a parallel denoiser); the other ranks
    receive its outputs from the first of them."""

    def __init__(self, ranks: tuple[int, ...]) -> None:
        self.ranks = ranks

    def __call__(self, stage: Stage, inputs: Mapping[str, Any], options: dict[str, Any]) -> dict[str, Any]:
        out: list[dict[str, Any] | None] = [stage(inputs, **options) if dist.get_rank() in self.ranks else None]
        if dist.get_world_size() > len(self.ranks):
            dist.broadcast_object_list(out, src=self.ranks[0])
        assert out[0] is not None
        return out[0]


def place_inference_graph(graph: Graph, placement: InferencePlacement, *, device_type: str = "cpu") -> None:
    """Set up this rank's part of ``graph`` (``text``, ``denoise``, ``decode`` stages) for
    ``placement``; collective over the world (every rank calls it, in the same order). A rank
    outside ``placement.decode`` then calls ``generate(..., output_type="latent")``: the decode is
    not one of its stages, and nothing of it is sent there."""
    if placement.nproc == 1:
        return
    stages: Any = graph.stages
    group = DenoiseGroup(placement.layout, placement.denoise, device_type=device_type)
    if group.member:
        stages["denoise"].parallelize(group)
    graph.hosts["text"] = BroadcastHost(placement.text)
    graph.hosts["denoise"] = GroupHost(placement.denoise)
    if len(placement.decode) > 1:
        stages["decode"].parallelize(group.group, split=placement.decode_split, halo=placement.decode_halo)


def place_replica(graph: Graph, group: DenoiseGroup, *, parallel_decode: bool = False) -> None:
    """A serving replica of ``group``'s ranks running whole requests: the prompt encoded on its
    first rank (the leader) and broadcast to the others, the denoiser over all of them; the leader
    decodes (the others run ``generate(..., output_type="latent")``), or with ``parallel_decode``
    every rank decodes its band of rows (:mod:`mmpipe.parallel.vae_patch`)."""
    stages: Any = graph.stages
    stages["denoise"].parallelize(group)
    if len(group.ranks) > 1:
        graph.hosts["text"] = BroadcastHost(group.ranks[0], group=group.group)
    if parallel_decode:
        stages["decode"].parallelize(group.group, split="rows")


def configure_denoiser(graph: Any, cache: StepCacheConfig, *, compile: bool) -> None:
    """The denoiser's step cache and regional compilation, applied after its parallel hooks (the
    fixed order: sequence parallel -> cache -> compile)."""
    denoise = graph.stages["denoise"]
    if cache.policy != "none":
        denoise.use_step_cache(StepCache(cache.policy, cache.threshold, cache.mag_ratios))
    if compile:
        for model in _denoisers(denoise):
            compile_blocks(model)


def _denoisers(stage: Any) -> list[Any]:
    module = stage.module
    return list(module.values()) if isinstance(module, torch.nn.ModuleDict) else [module]


# ---- local launch --------------------------------------------------------------------------------
def _entry(
    rank: int,
    world: int,
    port: int,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    queue: Any,
    env: dict[str, str],
    timeout_s: float,
) -> None:
    procs.adopt_environment(env)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=timeout_s))
        buf = io.BytesIO()
        torch.save(fn(rank, world, *args), buf)  # serialised: shared memory dies with this process
        queue.put((rank, buf.getvalue(), None))
    except BaseException as err:  # noqa: BLE001  (reported to the launcher, then re-raised)
        queue.put((rank, None, f"{type(err).__name__}: {err}\n{traceback.format_exc()}"))
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def launch_ranks(fn: Callable[..., Any], nproc: int, *args: Any, timeout_s: float = 600.0) -> list[Any]:
    """``[fn(rank, nproc, *args) for each rank]``, each rank a local process of the preloading
    forkserver with a gloo process group; the first rank to fail raises :class:`WorkerFailure`
    naming it (the others are stopped)."""
    ctx = procs.context([fn.__module__])
    queue = ctx.Queue()
    port, env = free_port(), procs.environment()
    workers = [ctx.Process(target=_entry, args=(r, nproc, port, fn, args, queue, env, timeout_s)) for r in range(nproc)]
    for p in workers:
        p.start()
    results: dict[int, Any] = {}
    try:
        for _ in workers:
            rank, value, error = queue.get(timeout=timeout_s)
            if error is not None:
                first = error.splitlines()[0]
                raise WorkerFailure(f"generate rank {rank} failed: {first}\n{error}")
            results[rank] = torch.load(io.BytesIO(value), weights_only=False)
    finally:
        for p in workers:
            p.join(timeout=5 if len(results) < nproc else 30)
            if p.is_alive():
                p.kill()
    return [results[r] for r in range(nproc)]
