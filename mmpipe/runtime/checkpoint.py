"""Training checkpoints with ``torch.distributed.checkpoint`` (with or without a process group).

Layout: ``RUN_DIR/checkpoints/step_00000100/`` (one DCP directory for all ranks: each rank writes
the model, optimizer and lr-schedule state of the trainable stages it holds, FSDP2 shards
included) and ``RUN_DIR/checkpoints/latest`` (the newest complete one). A checkpoint is written
under a temporary name (``step_N.tmp``), its files fsynced by every rank, renamed when every rank
is done, and only then does the marker move: written to ``latest.tmp``, fsynced, renamed over
``latest`` (atomic on POSIX), and the directory fsynced, so a crash or power loss at any point
leaves ``latest`` naming a complete checkpoint. A run killed mid-save resumes from the previous
one; its leftover ``*.tmp`` are removed when the next run starts (:func:`remove_stale`). Data
position and noise are functions of the step (``mmpipe.train``), so the step is the whole data
and RNG state.
"""

from __future__ import annotations

import os
import shutil
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from mmpipe.rundir import checkpoint_root, latest_checkpoint
from mmpipe.runtime.optim import StageOptim


def _fsync(path: Path) -> None:
    """Flush a file's or a directory's entries to stable storage."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(root: Path) -> None:
    """fsync every file under ``root``, then the folders (their entries: the files' names)."""
    for path in sorted(root.rglob("*"), key=lambda p: -len(p.parts)):
        _fsync(path)
    _fsync(root)


def _publish(root: Path, name: str) -> None:
    """Point ``root/latest`` at ``name`` atomically and durably."""
    tmp = root / "latest.tmp"
    with tmp.open("w") as f:
        f.write(name + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, root / "latest")
    _fsync(root)


def _stage_state(module: nn.Module, optim: StageOptim | None) -> dict[str, Any]:
    if optim is None:
        return {"model": module.state_dict()}
    model_sd, optim_sd = get_state_dict(module, optim.optimizer)
    return {"model": model_sd, "optim": optim_sd, "lr_sched": optim.lr_scheduler.state_dict()}


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _is_writer() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def save_checkpoint(
    run_dir: Path, step: int, modules: Mapping[str, nn.Module], optims: Mapping[str, StageOptim]
) -> Path:
    """Save every local trainable stage's state and the step; collective over all ranks."""
    state = {"step": step, "stages": {s: _stage_state(modules[s], optims[s]) for s in optims}}
    final = checkpoint_root(run_dir) / f"step_{step:08d}"
    tmp = final.with_name(final.name + ".tmp")
    if _is_writer():
        shutil.rmtree(tmp, ignore_errors=True)
    _barrier()
    with warnings.catch_warnings():  # single-process runs have no process group, by design
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.save(state, checkpoint_id=tmp)
    _fsync_tree(tmp)  # every rank: the files it wrote are on disk before anyone publishes them
    _barrier()
    if _is_writer():
        shutil.rmtree(final, ignore_errors=True)
        tmp.rename(final)
        _fsync(final.parent)
        _publish(final.parent, final.name)
    _barrier()
    return final


def load_checkpoint(path: Path, modules: Mapping[str, nn.Module], optims: Mapping[str, StageOptim]) -> int:
    """Load the stages in ``modules`` (with their optimizers where given) in place; returns the step."""
    state: dict[str, Any] = {"step": 0, "stages": {s: _stage_state(m, optims.get(s)) for s, m in modules.items()}}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(state, checkpoint_id=path)
    for name, module in modules.items():
        loaded, optim = state["stages"][name], optims.get(name)
        if optim is None:
            module.load_state_dict(loaded["model"])
            continue
        set_state_dict(module, optim.optimizer, model_state_dict=loaded["model"], optim_state_dict=loaded["optim"])
        optim.lr_scheduler.load_state_dict(loaded["lr_sched"])
    return int(state["step"])


def load_latest_weights(run_dir: Path, modules: Mapping[str, nn.Module]) -> int:
    """Load the stages in ``modules`` from ``run_dir``'s newest checkpoint (weights only); the step."""
    ckpt = latest_checkpoint(run_dir)
    if ckpt is None:
        raise ValueError(f"run {str(run_dir)!r} has no checkpoint yet")
    return load_checkpoint(ckpt, modules, {})
