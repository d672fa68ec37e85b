"""The optimizer side of a trainable stage on a rank: what the executor steps and a checkpoint saves."""

from __future__ import annotations

import dataclasses

import torch


@dataclasses.dataclass
class StageOptim:
    """The optimizer side of one trainable stage on this rank."""

    optimizer: torch.optim.Optimizer
    lr_scheduler: torch.optim.lr_scheduler.LRScheduler
    grad_clip: float
    # a non-finite gradient norm: raise NonFiniteError, or skip the update (no optimizer or lr step)
    skip_nonfinite: bool = False
