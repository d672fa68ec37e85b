"""Which device a run's ranks use, which torch.distributed backend moves their tensors, and in
which precision they compute: resolved once from the config, checked before any worker starts.

``device=auto|cpu|cuda`` is the user's word (``auto``: CUDA when a GPU is visible). A CUDA rank
uses ``cuda:LOCAL_RANK`` under NCCL, one process per GPU, as torchrun places them. Ranks may share
a GPU only under ``launch.backend=gloo``: NCCL refuses two ranks on one device, so gloo moves
edge tensors through pinned host buffers instead (the transport stages them; see
:mod:`mmpipe.runtime.transport`). That is how a one-GPU machine runs multi-rank CUDA placements.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import os
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from mmpipe.config import RunConfig


class DeviceType(enum.StrEnum):
    CPU = "cpu"
    CUDA = "cuda"


class Precision(enum.StrEnum):
    FP32 = "fp32"
    BF16 = "bf16"

    @property
    def dtype(self) -> torch.dtype:
        return torch.bfloat16 if self is Precision.BF16 else torch.float32


def resolve_device(device: str, *, key: str = "device") -> DeviceType:
    """``auto`` -> CUDA when a GPU is visible, else CPU; ``cuda`` without one is a ``ValueError`` naming ``key``."""
    match device:
        case "auto":
            return DeviceType.CUDA if torch.cuda.is_available() else DeviceType.CPU
        case "cpu":
            return DeviceType.CPU
        case "cuda":
            if not torch.cuda.is_available():
                raise ValueError(
                    f"{key}=cuda, but this machine has no usable CUDA device (torch {torch.__version__}, "
                    f"built {'with' if torch.version.cuda else 'without'} CUDA); use {key}=cpu or {key}=auto"
                )
            return DeviceType.CUDA
        case _:
            raise ValueError(f"{key}={device!r}: expected auto, cpu or cuda")


@dataclass(frozen=True)
class Backend:
    """The process group backend of a run's ranks."""

    name: str  # what init_process_group takes: "gloo", or "cpu:gloo,cuda:nccl"
    staged: bool  # CUDA tensors cross ranks through host memory (gloo moves CPU tensors only)

    @property
    def nccl(self) -> bool:
        return "nccl" in self.name


def resolve_backend(device: DeviceType, backend: str, *, local_ranks: int, key: str = "launch.backend") -> Backend:
    """The backend for ``local_ranks`` ranks on one node of ``device``; checked against the GPUs present.

    ``auto``: NCCL on CUDA (with gloo for the CPU-side handshakes and metrics), gloo on CPU.
    ``gloo`` on CUDA stages edge tensors through host memory and lets ranks share a GPU.
    """
    if backend not in ("auto", "nccl", "gloo"):
        raise ValueError(f"{key}={backend!r}: expected auto, nccl or gloo")
    if device is DeviceType.CPU:
        if backend == "nccl":
            raise ValueError(f"{key}=nccl needs device=cuda (NCCL moves CUDA tensors only)")
        return Backend("gloo", staged=False)
    if backend == "gloo":
        return Backend("gloo", staged=True)
    gpus = torch.cuda.device_count()
    if local_ranks > gpus:
        raise ValueError(
            f"launch.nproc={local_ranks} ranks on this node but {gpus} CUDA device(s): NCCL runs one rank per GPU. "
            f"Use launch.nproc<={gpus}, or {key}=gloo to let ranks share GPUs (edge tensors staged through host memory)"
        )
    return Backend("cpu:gloo,cuda:nccl", staged=False)


def rank_device(device: DeviceType, local_rank: int) -> torch.device:
    """The device of a rank: ``cuda:LOCAL_RANK`` (modulo the GPUs present, when ranks share them) or CPU."""
    if device is DeviceType.CPU:
        return torch.device("cpu")
    return torch.device("cuda", local_rank % torch.cuda.device_count())


def autocast(device: torch.device, precision: Precision) -> contextlib.AbstractContextManager[None]:
    """bf16 autocast on ``device`` for ``Precision.BF16``, else nothing."""
    if precision is Precision.BF16:
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


@contextlib.contextmanager
def cuda_device(device: torch.device) -> Iterator[None]:
    """Make ``device`` current for kernels launched without an explicit device (a no-op on CPU)."""
    if device.type == "cuda":
        with torch.cuda.device(device):
            yield
    else:
        yield


@dataclasses.dataclass(frozen=True)
class RunDevices:
    """Where a run's ranks compute, how their tensors move, and in which precision."""

    device: DeviceType
    backend: Backend
    precision: Precision

    def rank_device(self) -> torch.device:
        """This process's device: ``cuda:LOCAL_RANK`` (torchrun and the local launcher set it)."""
        return rank_device(self.device, int(os.environ.get("LOCAL_RANK", "0")))

    def wire(self) -> torch.device | None:
        """Where edge payloads travel: the GPU under NCCL, the host under gloo (None: CPU ranks)."""
        if self.device is DeviceType.CPU:
            return None
        return torch.device("cpu") if self.backend.staged else self.rank_device()


def resolve_nproc(cfg: RunConfig) -> RunConfig:
    """``cfg`` with ``launch.nproc=0`` replaced by the ranks this machine runs: one per GPU when the
    run is on CUDA, else one per CPU core this process may use (each then runs one thread)."""
    if cfg.launch.nproc:
        return cfg
    if resolve_device(cfg.device) is DeviceType.CUDA:
        n = torch.cuda.device_count()
    else:
        n = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return dataclasses.replace(cfg, launch=dataclasses.replace(cfg.launch, nproc=max(n, 1)))


def run_devices(cfg: RunConfig, *, local_ranks: int | None = None) -> RunDevices:
    """``device``, ``launch.backend`` and ``train.precision`` resolved for this machine; a CUDA
    request without a GPU, or more NCCL ranks than GPUs, is a ``ValueError`` naming the key."""
    device = resolve_device(cfg.device)
    nproc = cfg.launch.nproc if local_ranks is None else local_ranks
    backend = resolve_backend(device, cfg.launch.backend, local_ranks=nproc)
    precision = Precision.BF16 if device is DeviceType.CUDA else Precision.FP32
    if cfg.train.precision != "auto":
        precision = Precision(cfg.train.precision)
    return RunDevices(device, backend, precision)
