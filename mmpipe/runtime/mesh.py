"""The one owner of process groups and device meshes of a run, passed explicitly (no module globals)."""

from __future__ import annotations

import dataclasses
import datetime
import os

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from mmpipe.parallel.sequence import SequenceMesh
from mmpipe.sched.plan import Plan


class MeshOwner:
    """World membership of this rank and, per stage of more than one rank, the meshes it runs on:
    an FSDP mesh over all of the stage's ranks (data- and sequence-parallel ranks alike: both hold
    partial gradients that sum), and for ``ulysses x ring > 1`` a ``(dp, ring, ulysses)`` mesh whose
    sub-meshes are this rank's ring and Ulysses groups.

    ``new_group`` is collective over the world, so every rank creates every mesh, in placement
    order, and keeps the ones it belongs to.
    """

    def __init__(self, plan: Plan, rank: int, world_size: int, *, device_type: str = "cpu") -> None:
        self.rank, self.world_size = rank, world_size
        self._dp: dict[str, DeviceMesh] = {}
        self._sequence: dict[str, DeviceMesh] = {}
        self._ring_groups: dict[str, dist.ProcessGroup] = {}
        # Ranks that hold trainable stages report per-step metrics among themselves; ranks that
        # only run frozen producers never join a per-step collective, so they can run ahead.
        trainable = sorted({r for s, g in plan.placement if s in plan.trainable for r in g.ranks})
        self.metrics_ranks: list[int] = trainable or list(range(world_size))
        self.metrics_group = dist.new_group(self.metrics_ranks) if self.distributed else None
        for stage, group in plan.placement:
            if len(group.ranks) > 1:
                mesh = DeviceMesh(device_type, list(group.ranks))
                if rank in group:
                    self._dp[stage] = mesh
            if group.sp > 1:
                grid = torch.tensor(group.ranks).view(group.dp, group.ring, group.ulysses)
                mesh = DeviceMesh(device_type, grid, mesh_dim_names=("dp", "ring", "ulysses"))
                if rank in group:
                    self._sequence[stage] = mesh
                # Each ring's send / recv get a group of their own: DeviceMesh gives a dimension that
                # spans the world the default group, whose point-to-point tags the pipeline's transfers
                # use too, so a ring receive would match a transfer's send (a DiT ring-split over the
                # encoders' rank and another deadlocked).
                for replica in range(group.dp if group.ring > 1 else 0):
                    for u in range(group.ulysses):
                        ring_ranks = grid[replica, :, u].tolist()
                        ring_group = dist.new_group(ring_ranks)
                        if rank in ring_ranks:
                            self._ring_groups[stage] = ring_group

    @property
    def distributed(self) -> bool:
        """Whether a process group is initialised (``False`` for single-process runs)."""
        return self.world_size > 1

    def fsdp_mesh(self, stage: str) -> DeviceMesh | None:
        """The mesh of all of ``stage``'s ranks, or ``None`` for a single-rank stage."""
        return self._dp.get(stage)

    def sequence_mesh(self, stage: str, *, zigzag: bool) -> SequenceMesh:
        """This rank's sequence-parallel groups of ``stage`` (``zigzag`` for causal attention)."""
        mesh = SequenceMesh.from_device_mesh(self._sequence[stage], zigzag=zigzag)
        return dataclasses.replace(mesh, ring_group=self._ring_groups[stage]) if stage in self._ring_groups else mesh


def init_distributed(timeout_s: float, backend: str = "gloo", device: torch.device | None = None) -> tuple[int, int]:
    """Initialise the default process group from torchrun / elastic env vars; ``(rank, world)``.

    ``backend`` is gloo, or ``cpu:gloo,cuda:nccl`` (CPU tensors, such as transport headers and
    metrics, through gloo; CUDA tensors through NCCL), bound to this rank's GPU (``device``) so
    NCCL communicators are created eagerly for it. ``timeout_s`` bounds NCCL operations too: with
    async error handling on (torch's default, set here for older releases), a hung collective or
    a dead peer aborts the communicator and the rank raises instead of hanging.
    """
    if not dist.is_initialized():
        if "nccl" in backend:
            os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
        device_id = device if device is not None and device.type == "cuda" and "nccl" in backend else None
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s), device_id=device_id)
    return dist.get_rank(), dist.get_world_size()
