"""Cluster specs: devices (peak dense bf16 FLOP/s, memory) and a topology of bandwidth levels.

Ranks are numbered node-major. A level groups ``size`` consecutive ranks (a node of 8 GPUs, an
NVLink domain of 72) with a per-rank bandwidth; a set of ranks communicates at the bandwidth of
the smallest level that contains all of them, and at the network's past the largest.
Presets live in ``configs/cluster/*.yaml`` (package data).
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import tempfile
from collections.abc import Sequence
from importlib import resources

import torch
import yaml

from mmpipe.memory.budget import FILE_TIER_BYTES_PER_S


@dataclasses.dataclass(frozen=True, kw_only=True)
class Level:
    """``size`` consecutive ranks connected at ``bandwidth`` bytes/s per rank."""

    name: str
    size: int
    bandwidth: float


@dataclasses.dataclass(frozen=True, kw_only=True)
class Cluster:
    """``world_size`` identical devices and their bandwidth levels, innermost first."""

    name: str
    device: str
    world_size: int
    peak_flops: float  # dense bf16 FLOP/s per device
    memory_bytes: float
    levels: tuple[Level, ...]
    network_bandwidth: float  # bytes/s per rank beyond the largest level
    host_bandwidth: float = 5.0e10  # bytes/s per device to host memory (activation offload)
    host_memory_bytes: float = 2.5e11  # host memory per device available for offloaded activations
    offload_overlap: bool = True  # offload copies run beside compute (a side stream); False: they block
    latency: float = 1e-5  # seconds per point-to-point message
    dtype_bytes: int = 2  # bytes per parameter / activation element on the wire (bf16)
    overlap_collectives: bool = True  # collectives run on their own stream, hidden behind compute
    efficiency: float = 0.45  # achieved / peak FLOP/s of a stage without a calibration for this device

    def __post_init__(self) -> None:
        sizes = [lv.size for lv in self.levels]
        if sizes != sorted(sizes) or any(b % a for a, b in zip(sizes, sizes[1:], strict=False)):
            raise ValueError(f"cluster {self.name!r}: level sizes must grow and divide each other, got {sizes}")
        if not 0 < self.efficiency <= 1:
            raise ValueError(f"cluster {self.name!r}: efficiency must be in (0, 1], got {self.efficiency}")
        if self.world_size <= 0 or self.peak_flops <= 0 or self.memory_bytes <= 0:
            raise ValueError(f"cluster {self.name!r}: world_size, peak_flops and memory must be positive")

    def bandwidth(self, ranks: Sequence[int]) -> float:
        """Bytes/s per rank for traffic among ``ranks``: the innermost level containing them all."""
        # Levels are contiguous blocks of ranks, so the extremes decide.
        lo, hi = (ranks[0], ranks[-1]) if isinstance(ranks, range) else (min(ranks), max(ranks))
        for level in self.levels:
            if lo // level.size == hi // level.size:
                return level.bandwidth
        return self.network_bandwidth

    def p2p_seconds(self, nbytes: float, src: int, dst: int) -> float:
        """Time to move ``nbytes`` from ``src`` to ``dst``."""
        return nbytes / self.bandwidth([src, dst])

    def collective_seconds(self, kind: str, nbytes: float, ranks: Sequence[int]) -> float:
        """Ring all-gather / reduce-scatter / all-to-all of ``nbytes`` per rank; all-reduce is twice that."""
        n = len(ranks)
        if n == 1:
            return 0.0
        one_pass = (n - 1) / n * nbytes / self.bandwidth(ranks)
        match kind:
            case "all_gather" | "reduce_scatter" | "all_to_all":
                return one_pass
            case "all_reduce":
                return 2 * one_pass
        raise ValueError(f"unknown collective {kind!r}; expected all_gather, reduce_scatter, all_to_all, all_reduce")

    @classmethod
    def preset(cls, name: str) -> Cluster:
        """A preset from ``configs/cluster/<name>.yaml``; ``"local"`` is :meth:`local`."""
        if name == "local":
            return cls.local()
        path = resources.files("mmpipe.configs").joinpath("cluster", f"{name}.yaml")
        if not path.is_file():
            names = sorted(
                p.name.removesuffix(".yaml") for p in resources.files("mmpipe.configs").joinpath("cluster").iterdir()
            )
            raise ValueError(f"unknown cluster preset {name!r}; presets: {names}")
        return cls.from_dict(yaml.safe_load(path.read_text()), name=name)

    @classmethod
    def from_dict(cls, raw: dict, *, name: str | None = None, nproc: int = 0) -> Cluster:
        """A cluster from its YAML form (``name: local`` is :meth:`local` with ``nproc`` ranks)."""
        name = name or str(raw.get("name", "cluster"))
        if name == "local":
            return cls.local(nproc or None)
        try:
            levels = tuple(
                Level(name=lv["name"], size=int(lv["size"]), bandwidth=float(lv["bandwidth"])) for lv in raw["levels"]
            )
            return cls(
                name=name,
                device=str(raw["device"]),
                world_size=int(raw["world_size"]),
                peak_flops=float(raw["peak_flops"]),
                memory_bytes=float(raw["memory_bytes"]),
                levels=levels,
                network_bandwidth=float(raw["network_bandwidth"]),
                host_bandwidth=float(raw.get("host_bandwidth", 5.0e10)),
                host_memory_bytes=float(raw.get("host_memory_bytes", 2.5e11)),
                efficiency=float(raw.get("efficiency", 0.45)),
                latency=float(raw.get("latency", 1e-5)),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"cluster {name!r}: bad or missing field {e}") from e

    @classmethod
    def local_cuda(cls, nproc: int | None = None) -> Cluster:
        """This machine's GPUs (``nproc`` ranks, default one per GPU), as the CUDA runtime reports
        them: memory from the device, the dense bf16 peak from its architecture (:func:`cuda_peak_flops`),
        activation offload to pinned host memory over PCIe, overlapped with compute (side streams)."""

        props = torch.cuda.get_device_properties(0)
        n = nproc or torch.cuda.device_count()
        return cls(
            name=f"local-cuda ({props.name})",
            device="cuda",
            world_size=n,
            peak_flops=cuda_peak_flops(props.major, props.minor),
            memory_bytes=props.total_memory,
            levels=(Level(name="node", size=n, bandwidth=150e9),),
            network_bandwidth=25e9,
            host_bandwidth=25e9,  # pinned copies over PCIe 5 x16, half its peak
            host_memory_bytes=os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / n,
            offload_overlap=True,
        )

    @classmethod
    def local(cls, nproc: int | None = None, *, peak_flops: float = 1e11) -> Cluster:
        """This machine's CPU ranks: ``nproc`` (default: its cores), one shared-memory level; the peak
        is nominal (a core's fp32 FMA rate); ``mmpipe profile`` measures the achieved fraction."""
        n = nproc or os.cpu_count() or 1
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / n
        spill = shutil.disk_usage(tempfile.gettempdir()).free / n
        return cls(
            name="local",
            device="cpu",
            world_size=n,
            peak_flops=peak_flops,
            memory_bytes=memory,
            levels=(Level(name="host", size=n, bandwidth=5e9),),
            network_bandwidth=1e9,
            # activation offload goes to the file tier: its bandwidth and the disk's free space, and
            # the backward waits for its reads
            host_bandwidth=FILE_TIER_BYTES_PER_S,
            host_memory_bytes=spill,
            offload_overlap=False,
            latency=3e-4,  # gloo over loopback TCP
            dtype_bytes=4,  # CPU runs train in float32
            overlap_collectives=False,  # gloo collectives block the rank
            efficiency=1.0,
        )


# Dense bf16 tensor-core peaks by compute capability (the vendors' data sheets, SXM parts, no sparsity).
_BF16_PEAKS = {(9, 0): 989e12, (10, 0): 2250e12, (8, 0): 312e12, (8, 9): 181e12, (8, 6): 71e12}


def cuda_peak_flops(major: int, minor: int) -> float:
    """The dense bf16 peak of a GPU of compute capability ``major.minor`` (H100 / H200: 989 TFLOP/s);
    unknown parts get a nominal 100 TFLOP/s (``mmpipe profile`` measures what a stage achieves)."""
    return _BF16_PEAKS.get((major, minor), 100e12)
