"""Training checkpoints with ``torch.distributed.checkpoint`` (works with or without a process group).

Layout: ``RUN_DIR/checkpoints/step_00000100/`` (a DCP directory) and ``RUN_DIR/checkpoints/latest``
(the name of the newest complete one). A checkpoint is written under a temporary name and renamed
when complete, so a run killed mid-save resumes from the previous one.
"""

from __future__ import annotations

import shutil
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict


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


def save_checkpoint(
    run_dir: Path, step: int, model: nn.Module, optimizer: torch.optim.Optimizer, extra: dict[str, Any]
) -> Path:
    """Save model, optimizer, ``extra`` (scheduler, RNG, data position) and the step."""
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optim": optim_sd, "step": step, "extra": extra}
    final = checkpoint_root(run_dir) / f"step_{step:08d}"
    tmp = final.with_name(final.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    with warnings.catch_warnings():  # single-process runs have no process group, by design
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.save(state, checkpoint_id=tmp)
    shutil.rmtree(final, ignore_errors=True)
    tmp.rename(final)
    (checkpoint_root(run_dir) / "latest").write_text(final.name + "\n")
    return final


def load_checkpoint(
    path: Path, model: nn.Module, optimizer: torch.optim.Optimizer | None, extra: dict[str, Any]
) -> int:
    """Load ``path`` into ``model`` (and ``optimizer``) in place; ``extra`` is filled; returns the step."""
    model_sd, optim_sd = get_state_dict(model, optimizer) if optimizer is not None else (model.state_dict(), {})
    state: dict[str, Any] = {"model": model_sd, "step": 0, "extra": extra}
    if optimizer is not None:
        state["optim"] = optim_sd
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(state, checkpoint_id=path)
    if optimizer is not None:
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    else:
        model.load_state_dict(state["model"])
    return int(state["step"])
