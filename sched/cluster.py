"""Cluster specs: devices (peak dense bf16 FLOP/s, memory) and a topology of bandwidth levels.

Ranks are numbered node-major. A level groups ``size`` consecutive ranks (a node of 8 GPUs, an
NVLink domain of 72) with a per-rank bandwidth; a set of ranks communicates at the bandwidth of
the smallest level that contains all of them, and at the network's past the largest.
Presets live in ``configs/cluster/*.yaml`` (package data).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from importlib import resources

import yaml


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

    def __post_init__(self) -> None:
        sizes = [lv.size for lv in self.levels]
        if sizes != sorted(sizes) or any(b % a for a, b in zip(sizes, sizes[1:], strict=False)):
            raise ValueError(f"cluster {self.name!r}: level sizes must grow and divide each other, got {sizes}")
        if self.world_size <= 0 or self.peak_flops <= 0 or self.memory_bytes <= 0:
            raise ValueError(f"cluster {self.name!r}: world_size, peak_flops and memory must be positive")

    def bandwidth(self, ranks: Sequence[int]) -> float:
        """Bytes/s per rank for traffic among ``ranks``: the innermost level containing them all."""
        for level in self.levels:
            if len({r // level.size for r in ranks}) == 1:
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
            raise ValueError(f"unknown cluster preset {name!r}; presets: {['local', *names]}")
        raw = yaml.safe_load(path.read_text())
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
        )

    @classmethod
    def local(cls, nproc: int | None = None, *, peak_flops: float = 5e10) -> Cluster:
        """This machine's CPU ranks: ``nproc`` (default: its cores), one shared-memory level."""
        n = nproc or os.cpu_count() or 1
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / n
        return cls(
            name="local",
            device="cpu",
            world_size=n,
            peak_flops=peak_flops,
            memory_bytes=memory,
            levels=(Level(name="host", size=n, bandwidth=5e9),),
            network_bandwidth=1e9,
        )
