"""``mmpipe train``: check, write the run directory, then run the ranks (in-process for one, else launched)."""

from __future__ import annotations

import dataclasses
import logging

from mmpipe.assemble.placement import check_placement, kernel_choice, make_plans
from mmpipe.config import RunConfig
from mmpipe.devices import DeviceType, resolve_nproc, run_devices
from mmpipe.models import check_training_pipeline_dir
from mmpipe.report.recording import write_chrome_trace
from mmpipe.rundir import read_metrics
from mmpipe.runtime.launch import launch_local
from mmpipe.train import worker
from mmpipe.train.loop import TrainResult, run_rank
from mmpipe.train.prepare import prepare_run

logger = logging.getLogger(__name__)


def train(cfg: RunConfig) -> TrainResult:
    """Train the trainable stages of the text-to-video graph on ``launch.nproc`` local ranks."""
    cfg = resolve_nproc(cfg)  # launch.nproc=0: one rank per GPU or core
    if cfg.model.arch is not None and cfg.model.path is None:
        raise ValueError(
            f"model {cfg.model.name!r} is an architecture-only preset (no weights): plan it with "
            f"`mmpipe plan model={cfg.model.name}`, or train local weights with model.path=DIR"
        )
    if cfg.model.path is not None:  # refused before a run directory is written
        check_training_pipeline_dir(cfg.model.path, key="model.path")
    devices = run_devices(cfg)  # no GPU for device=cuda, or too few for NCCL: refused before anything is written
    check_placement(cfg)
    choice = kernel_choice(cfg)  # an unavailable kernel is an error before anything is written
    if "triton" in dataclasses.astuple(choice) and devices.device is DeviceType.CPU:
        logger.warning("model.kernels: the Triton kernels run in Triton's CPU interpreter here (tests only: very slow)")
    run_dir, graph, cfg = prepare_run(cfg)
    train_plan, _ = make_plans(graph, cfg)
    cfg = dataclasses.replace(cfg, run_dir=str(run_dir))
    if cfg.launch.nproc == 1:
        result = run_rank(cfg, graph, rank=0, world_size=1)
        write_chrome_trace(run_dir)
        return result
    print(train_plan.format_table())
    launch_local(cfg, worker.run)
    write_chrome_trace(run_dir)
    records = read_metrics(run_dir)
    vals = [r["val_loss"] for r in records if "val_loss" in r]
    first = records[0]["val_loss"] if records and records[0]["step"] == 0 else None
    return TrainResult(run_dir=run_dir, steps=cfg.train.steps, first_val_loss=first, last_val_loss=vals[-1])
