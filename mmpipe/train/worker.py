"""One training worker: joins the process group and runs its rank's loop (``python -m`` under torchrun)."""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

from mmpipe.config import RunConfig, compose_config, from_dict, to_dict
from mmpipe.devices import run_devices
from mmpipe.models import build_training_graph
from mmpipe.rundir import load_run_config, pipeline_dir
from mmpipe.runtime.launch import elastic_owned
from mmpipe.runtime.mesh import init_distributed
from mmpipe.runtime.procs import adopt_environment
from mmpipe.train.loop import run_rank
from mmpipe.train.prepare import prepare_run


def run(raw: dict[str, Any], env: dict[str, str] | None = None) -> None:
    """Worker body: ``raw`` is a ``RunConfig`` as a dict (picklable across the process start);
    ``env`` the launcher's environment (:func:`mmpipe.runtime.procs.adopt_environment`), or
    ``None`` under torchrun, which starts workers with it."""
    if env is not None:
        adopt_environment(env, keep=elastic_owned)
    cfg = from_dict(RunConfig, raw)
    assert cfg.run_dir is not None
    devices = run_devices(cfg, local_ranks=int(os.environ.get("LOCAL_WORLD_SIZE", cfg.launch.nproc)))
    rank, world = init_distributed(cfg.launch.timeout_s, devices.backend.name, devices.rank_device())
    logging.basicConfig(level=logging.INFO, format=f"[rank {rank}] %(asctime)s %(levelname)s %(message)s")
    if world != cfg.launch.nproc:
        raise ValueError(f"launched with world size {world} but launch.nproc={cfg.launch.nproc}")
    if not cfg.train.threads:
        cfg.train.threads = max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", world)))
    graph = build_training_graph(cfg.model, pipeline_dir(cfg.model, Path(cfg.run_dir)))
    try:
        run_rank(cfg, graph, rank=rank, world_size=world)
    except Exception as err:
        record_failure(Path(cfg.run_dir), rank, err)
        raise
    finally:
        torch.distributed.destroy_process_group()


def record_failure(run_dir: Path, rank: int, err: BaseException) -> None:
    """Write this rank's error to ``RUN_DIR/errors/rank<R>.json``: the launcher reports the one that
    caused the others (the agent stops the rest of the ranks after the first exit it sees)."""
    path = run_dir / "errors" / f"rank{rank}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"rank": rank, "time": time.time(), "message": f"{type(err).__name__}: {err}"}))


def main(argv: list[str] | None = None) -> int:
    """``python -m mmpipe.train.worker [overrides]`` under torchrun: compose the config, run this rank."""
    raw = compose_config("train", argv if argv is not None else sys.argv[1:])
    cfg = from_dict(RunConfig, raw)
    if cfg.run_dir is None:
        raise ValueError("workers started by torchrun need run_dir=<a directory every node can read>")
    if int(os.environ.get("RANK", "0")) == 0:
        prepare_run(cfg)  # run directory, config and tiny pipeline, before the others read them
    devices = run_devices(cfg, local_ranks=int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    init_distributed(cfg.launch.timeout_s, devices.backend.name, devices.rank_device())
    torch.distributed.barrier()
    run(to_dict(load_run_config(Path(cfg.run_dir))))  # as rank 0 wrote it: placement=auto resolved
    return 0


if __name__ == "__main__":
    sys.exit(main())
