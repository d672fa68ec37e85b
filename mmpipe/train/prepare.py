"""Before any worker starts: check the config against the model and write the run directory."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import yaml

from mmpipe.assemble.graphs import staged_pipeline
from mmpipe.assemble.placement import make_plans, write_plans
from mmpipe.assemble.planning import auto_placement, default_calibration_path, uncalibrated_stages
from mmpipe.config import DataConfig, ModelConfig, RunConfig, to_dict
from mmpipe.errors import WorkerFailure, loading_errors
from mmpipe.graph import Graph
from mmpipe.models import build_training_graph
from mmpipe.rundir import (
    CONFIG_FILE,
    check_resume_compatible,
    load_run_config,
    pipeline_dir,
    remove_stale,
    resolve_run_dir,
)


def prepare_run(cfg: RunConfig) -> tuple[Path, Graph, RunConfig]:
    """Check everything the config and the model's config decide (run directory, placement, head,
    block and frame counts, memory policies), then write the run directory: its config and, for the
    tiny preset, its random-weight pipeline. Returns the run directory, the graph over it and the
    config with ``placement=auto`` resolved (this machine calibrated first when it has no calibration
    for the model). A refused config leaves nothing behind; before any worker starts."""
    run_dir = resolve_run_dir(cfg)
    if cfg.train.resume:
        check_resume_compatible(load_run_config(run_dir), cfg)
    with staged_pipeline(cfg, run_dir) as staged:
        with loading_errors(f"model.path={cfg.model.path!r}") if cfg.model.path else contextlib.nullcontext():
            graph = build_training_graph(cfg.model, staged)
        check_lr_scale(graph, cfg)
        if cfg.placement == "auto":
            cfg = resolve_auto(graph, cfg)
        train_plan, val_plan = make_plans(graph, cfg)  # the checks that need the model's config
        run_dir.mkdir(parents=True, exist_ok=True)
        remove_stale(run_dir)  # what a save killed in an earlier attempt left
        (run_dir / CONFIG_FILE).write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))
        write_plans(run_dir, train_plan, val_plan)  # what every worker (a restarted one too) runs
        pipe_dir = pipeline_dir(cfg.model, run_dir)
        if staged != pipe_dir:  # the tiny preset, built in a temporary folder: now the run's
            shutil.move(staged, pipe_dir)
    return run_dir, build_training_graph(cfg.model, pipe_dir), cfg


def check_lr_scale(graph: Graph, cfg: RunConfig) -> None:
    """``train.lr_scale`` may name the graph's trainable stages only (a frozen one has no optimizer)."""
    trainable = [s.name for s in graph.trainable_stages()]
    for stage in cfg.train.lr_scale or {}:
        if stage not in trainable:
            raise ValueError(f"train.lr_scale.{stage}: no trainable stage {stage!r}; trainable stages: {trainable}")


def resolve_auto(graph: Graph, cfg: RunConfig) -> RunConfig:
    """``cfg`` with ``placement=auto`` replaced by the planner's placement (and ``train.micro_batches=0``
    by its micro-batch count), planned with this machine's calibration (made first when there is
    none for the model: :func:`calibrate_first`)."""
    calibrate_first(graph, cfg)
    placement, micro_batches = auto_placement(graph, cfg)
    train = dataclasses.replace(cfg.train, micro_batches=micro_batches)
    return dataclasses.replace(cfg, placement=placement, train=train)


def calibrate_first(graph: Graph, cfg: RunConfig) -> Path:
    """The calibration file ``placement=auto`` plans with (``default_calibration_path()``): when it is
    missing or lacks some of the graph's stages, ``mmpipe profile``'s runs for this model (its
    defaults, on this run's data) are made first and merged into it; later runs reuse it."""
    path = default_calibration_path()
    if uncalibrated_stages(graph, path):  # a file that is no calibration: an error before any run
        print(
            f"placement=auto: no calibration for {cfg.model.name} on this machine; "
            f"calibrating (mmpipe profile) -> {path}",
            flush=True,
        )
        run_calibration(cfg.model, cfg.data, path)
    return path


# What torchrun gives its workers: the calibration's own runs (one rank, then a two-rank transport
# probe) must not take them for theirs when rank 0 of a torchrun job prepares the run.
_LAUNCHER_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
                       "ROLE_RANK", "ROLE_WORLD_SIZE", "ROLE_NAME", "MASTER_ADDR", "MASTER_PORT")  # fmt: skip


def run_calibration(model: ModelConfig, data: DataConfig, path: Path) -> None:
    """``mmpipe profile``'s calibration (:func:`mmpipe.train.profile.calibrate_into`) in a child
    process, ``python -m mmpipe.train.profile``: it trains through ``mmpipe train``, whose
    preparation this is (a process boundary, not an import cycle), and it gets a process of its own
    (threads, launched ranks). A failure is a :class:`WorkerFailure` with the child's last lines."""
    payload = json.dumps({"model": to_dict(model), "data": to_dict(data), "out": str(path)})
    env = {k: v for k, v in os.environ.items() if k not in _LAUNCHER_VARIABLES and not k.startswith("TORCHELASTIC_")}
    cmd = [sys.executable, "-m", "mmpipe.train.profile", payload]
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    if res.returncode:
        tail = "\n".join((res.stderr or res.stdout).strip().splitlines()[-5:])
        raise WorkerFailure(
            f"placement=auto: calibrating {model.name!r} on this machine failed (exit code {res.returncode}); "
            f"run `mmpipe profile` to see why, or give a placement:\n{tail}"
        )
