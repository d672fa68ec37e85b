"""The one owner of process groups and device meshes of a run, passed explicitly (no module globals)."""

from __future__ import annotations

import datetime

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from mmpipe.sched.plan import Plan


class MeshOwner:
    """World membership of this rank and a data-parallel ``DeviceMesh`` per stage with dp > 1.

    ``new_group`` is collective over the world, so every rank creates every mesh, in placement
    order, and keeps the ones it belongs to.
    """

    def __init__(self, plan: Plan, rank: int, world_size: int, *, device_type: str = "cpu") -> None:
        self.rank, self.world_size = rank, world_size
        self._dp: dict[str, DeviceMesh] = {}
        # Ranks that hold trainable stages report per-step metrics among themselves; ranks that
        # only run frozen producers never join a per-step collective, so they can run ahead.
        trainable = sorted({r for s, g in plan.placement if s in plan.trainable for r in g.ranks})
        self.metrics_ranks: list[int] = trainable or list(range(world_size))
        self.metrics_group = dist.new_group(self.metrics_ranks) if self.distributed else None
        for stage, group in plan.placement:
            if group.dp > 1:
                mesh = DeviceMesh(device_type, list(group.ranks))
                if rank in group.ranks:
                    self._dp[stage] = mesh

    @property
    def distributed(self) -> bool:
        """Whether a process group is initialised (``False`` for single-process runs)."""
        return self.world_size > 1

    def dp_mesh(self, stage: str) -> DeviceMesh | None:
        """The data-parallel mesh of ``stage`` on this rank, or ``None`` for dp = 1."""
        return self._dp.get(stage)


def init_distributed(timeout_s: float) -> tuple[int, int]:
    """Initialise the default process group from torchrun / elastic env vars; ``(rank, world)``."""
    if not dist.is_initialized():
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=timeout_s))
    return dist.get_rank(), dist.get_world_size()
