"""The run directory: its layout and files, read and written by train, generate, serve and report.

``RUN_DIR/config.yaml`` (the resolved config), ``metrics.jsonl`` (one record a logged step),
``plan.txt`` and ``plan-val.txt`` (the training and validation plans, :meth:`~mmpipe.sched.plan.Plan.to_text`), ``pipeline/`` (the tiny
preset's weights), ``checkpoints/step_N`` with ``checkpoints/latest`` (the newest complete one;
written by :mod:`mmpipe.runtime.checkpoint`), ``events/`` and ``memory/`` (what the report reads).
"""

from __future__ import annotations

import datetime
import json
import shutil
from pathlib import Path
from typing import Any

import yaml

from mmpipe.config import ModelConfig, RunConfig, from_dict

CONFIG_FILE = "config.yaml"
PLAN_FILE = "plan.txt"  # the training plan (Plan.to_text)
VAL_PLAN_FILE = "plan-val.txt"  # the forward-only validation plan


METRICS_FILE = "metrics.jsonl"
EVAL_DIR = "eval"  # mmpipe eval: eval.json and contact_sheet.png


def resolve_run_dir(cfg: RunConfig) -> Path:
    """The run directory: ``cfg.run_dir`` or ``runs/<model>-<timestamp>``; checked against ``resume``."""
    if cfg.run_dir is None:
        if cfg.train.resume:
            raise ValueError("train.resume=true needs run_dir=<the run to continue>")
        stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
        return Path("runs") / f"{cfg.model.name}-{stamp}"
    run_dir = Path(cfg.run_dir)
    if cfg.train.resume and latest_checkpoint(run_dir) is None:
        raise ValueError(f"train.resume=true but run_dir={str(run_dir)!r} has no checkpoint")
    if not cfg.train.resume and latest_checkpoint(run_dir) is not None:
        raise ValueError(f"run_dir={str(run_dir)!r} already has checkpoints: pass train.resume=true or a new run_dir")
    return run_dir


def load_run_config(run_dir: Path) -> RunConfig:
    """The config a run was trained with (``RUN_DIR/config.yaml``)."""
    path = run_dir / CONFIG_FILE
    if not path.is_file():
        raise ValueError(f"{str(run_dir)!r} is not an mmpipe run directory (no {CONFIG_FILE})")
    return from_dict(RunConfig, yaml.safe_load(path.read_text()))


def check_resume_compatible(old: RunConfig, new: RunConfig) -> None:
    """A resumed run may change steps / logging, not the model or the data."""
    for section in ("model", "data"):
        if getattr(old, section) != getattr(new, section):
            raise ValueError(f"train.resume=true: {section} config differs from the checkpointed run's")


def pipeline_dir(model: ModelConfig, run_dir: Path) -> Path:
    """The model's WanPipeline-layout directory: ``model.path``, or the run's tiny preset."""
    return Path(model.path) if model.path is not None else run_dir / "pipeline"


def write_record(stream: Any, record: dict[str, Any]) -> None:
    if stream is None:
        return
    stream.write(json.dumps(record) + "\n")
    stream.flush()


def open_metrics(run_dir: Path, keep_until: int) -> Any:
    """``metrics.jsonl`` for appending, without records past ``keep_until`` (a killed run's tail)."""
    path = run_dir / METRICS_FILE
    kept = [r for r in read_metrics(run_dir) if r["step"] <= keep_until] if keep_until and path.exists() else []
    stream = path.open("w")
    for record in kept:
        write_record(stream, record)
    return stream


def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    """The records of ``RUN_DIR/metrics.jsonl``."""
    lines = (run_dir / METRICS_FILE).read_text().splitlines()
    return [json.loads(line) for line in lines if line.strip()]


def checkpoint_root(run_dir: Path) -> Path:
    """Where a run's checkpoints live."""
    return run_dir / "checkpoints"


def latest_checkpoint(run_dir: Path) -> Path | None:
    """The newest complete checkpoint of ``run_dir``, or ``None``."""
    marker = checkpoint_root(run_dir) / "latest"
    if not marker.is_file():
        return None
    path = checkpoint_root(run_dir) / marker.read_text().strip()
    return path if path.is_dir() else None


def remove_stale(run_dir: Path) -> list[Path]:
    """Remove what a killed save left behind (``step_N.tmp`` folders, ``latest.tmp``); returns them.
    Call before any rank saves again (at the start of a run or a restart)."""
    root = checkpoint_root(run_dir)
    stale = sorted(root.glob("*.tmp")) if root.is_dir() else []
    for path in stale:
        if path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
    return stale
