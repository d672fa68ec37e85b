"""Before any worker starts: check the config against the model and write the run directory."""

from __future__ import annotations

import contextlib
import dataclasses
import shutil
from pathlib import Path

import yaml

from mmpipe.assemble.graphs import staged_pipeline
from mmpipe.assemble.placement import make_plans, write_plans
from mmpipe.assemble.planning import auto_placement
from mmpipe.config import RunConfig, to_dict
from mmpipe.errors import loading_errors
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
    config with ``placement=auto`` resolved. A refused config leaves nothing behind; before any
    worker starts."""
    run_dir = resolve_run_dir(cfg)
    if cfg.train.resume:
        check_resume_compatible(load_run_config(run_dir), cfg)
    with staged_pipeline(cfg, run_dir) as staged:
        with loading_errors(f"model.path={cfg.model.path!r}") if cfg.model.path else contextlib.nullcontext():
            graph = build_training_graph(cfg.model, staged)
        if cfg.placement == "auto":
            cfg = dataclasses.replace(cfg, placement=auto_placement(graph, cfg))
        train_plan, val_plan = make_plans(graph, cfg)  # the checks that need the model's config
        run_dir.mkdir(parents=True, exist_ok=True)
        remove_stale(run_dir)  # what a save killed in an earlier attempt left
        (run_dir / CONFIG_FILE).write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))
        write_plans(run_dir, train_plan, val_plan)  # what every worker (a restarted one too) runs
        pipe_dir = pipeline_dir(cfg.model, run_dir)
        if staged != pipe_dir:  # the tiny preset, built in a temporary folder: now the run's
            shutil.move(staged, pipe_dir)
    return run_dir, build_training_graph(cfg.model, pipe_dir), cfg
