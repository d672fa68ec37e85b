"""Local multi-process launch with torch's elastic agent (the caller gives the workers' entry).

``mmpipe train launch.nproc=N`` calls :func:`launch_local`: N workers on this machine with a c10d
rendezvous on 127.0.0.1, restarted as a group up to ``launch.max_restarts`` times (workers then
resume from the last checkpoint). Across machines, run the same worker module under torchrun::

    torchrun --nnodes 2 --nproc-per-node 2 --rdzv-backend c10d --rdzv-endpoint HOST:29500 \\
        -m mmpipe.train.worker run_dir=/shared/run launch.nproc=4 placement=...
"""

from __future__ import annotations

import json
import os
import socket
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.launcher.api import LaunchConfig as ElasticConfig
from torch.distributed.launcher.api import elastic_launch

from mmpipe.config import RunConfig, to_dict
from mmpipe.errors import WorkerFailure
from mmpipe.runtime import procs

_OWN_STORE = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"


def free_port() -> int:
    """A free TCP port on 127.0.0.1."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# A worker's entry: (the RunConfig as a dict, the launcher's environment) -> None. A module-level
# function, so that the forkserver's children can import it by name.
WorkerEntry = Callable[[dict[str, Any], dict[str, str]], None]


def launch_local(cfg: RunConfig, entry: WorkerEntry) -> None:
    """Run ``cfg.launch.nproc`` workers of ``entry`` (e.g. :func:`mmpipe.train.worker.run`) and wait for them."""
    port = cfg.launch.master_port or free_port()
    elastic = ElasticConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=cfg.launch.nproc,
        run_id=f"mmpipe-{uuid.uuid4().hex[:8]}",
        rdzv_backend="c10d",
        rdzv_endpoint=f"127.0.0.1:{port}",
        max_restarts=cfg.launch.max_restarts,
        monitor_interval=0.5,
        start_method=procs.START_METHOD,
    )
    # Workers must not share the rendezvous store with the agent: it outlives a restart, and the
    # restarted workers' sub-groups (FSDP meshes, the metrics group) would read the dead
    # attempt's addresses from it. With this set, rank 0 hosts a fresh store each attempt. The
    # agent sets variables of its own here too (TORCHELASTIC_*): all are undone when it returns.
    saved = dict(os.environ)
    os.environ[_OWN_STORE] = "1"
    procs.context([entry.__module__])  # the agent's workers come from the preloading forkserver
    try:
        elastic_launch(elastic, entry)(to_dict(cfg), procs.environment())
    except ChildFailedError as err:
        recorded = _recorded_failure(Path(cfg.run_dir)) if cfg.run_dir else None
        killed = any(f.exitcode < 0 for f in err.failures.values())  # by a signal: it recorded nothing
        if recorded is not None and not killed:
            raise WorkerFailure(f"training worker rank {recorded['rank']} failed: {recorded['message']}") from None
        rank, failure = err.get_first_failure()
        message = failure.message if isinstance(failure.message, str) else json.dumps(failure.message)
        raise WorkerFailure(f"training worker rank {rank} failed (exit code {failure.exitcode}): {message}") from None
    finally:
        os.environ.clear()
        os.environ.update(saved)


# What torch's elastic agent sets for each worker (LocalElasticAgent._start_workers and the
# multiprocessing layer's error file): these win over the launcher's environment.
_ELASTIC_ENV = frozenset(
    "RANK LOCAL_RANK GROUP_RANK ROLE_RANK ROLE_NAME LOCAL_WORLD_SIZE WORLD_SIZE GROUP_WORLD_SIZE "
    "ROLE_WORLD_SIZE MASTER_ADDR MASTER_PORT TORCH_NCCL_ASYNC_ERROR_HANDLING CUDA_VISIBLE_DEVICES "
    "OMP_NUM_THREADS".split()
)


def elastic_owned(key: str) -> bool:
    """Whether the elastic agent set environment variable ``key`` for this worker."""
    return key in _ELASTIC_ENV or key.startswith("TORCHELASTIC_")


# How gloo reports a peer that died (what every other rank sees once one rank fails).
_LOST_PEER = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "Socket Timeout")


def _recorded_failure(run_dir: Path) -> dict[str, Any] | None:
    """The error the workers recorded that caused the others: the earliest one that is not a lost
    connection to a peer (what every other rank reports once one rank dies); ``None`` when there
    is none (a rank was killed and recorded nothing)."""
    records = [json.loads(p.read_text()) for p in sorted((run_dir / "errors").glob("rank*.json"))]
    if not records:
        return None
    for p in (run_dir / "errors").glob("rank*.json"):
        p.unlink()  # a restarted or resumed run starts clean
    causes = [r for r in records if not any(m in r["message"] for m in _LOST_PEER)]
    return min(causes, key=lambda r: r["time"]) if causes else None  # else: killed, the agent knows how
