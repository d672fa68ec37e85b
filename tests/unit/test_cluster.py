"""Cluster presets and the communication cost model."""

from __future__ import annotations

import pytest

from mmpipe.sched.cluster import Cluster, Level


def test_presets_load_and_bandwidth_follows_the_topology() -> None:
    nodes = Cluster.preset("h200_512")
    assert nodes.world_size == 512 and nodes.device == "H200"
    assert nodes.bandwidth([0, 7]) == 4.5e11  # inside one 8-GPU node
    assert nodes.bandwidth([7, 8]) == 5.0e10  # across nodes
    nvl = Cluster.preset("h200_nvl72_512")
    assert nvl.bandwidth([0, 71]) == 9.0e11 and nvl.bandwidth([71, 72]) == 5.0e10
    for name in ("h200_8", "h200_64", "h200_4096", "h200_nvl72_64", "h200_nvl72_4096"):
        assert Cluster.preset(name).world_size == int(name.rsplit("_", 1)[1])


def test_collective_costs() -> None:
    c = Cluster.preset("h200_8")
    gb = 1e9
    assert c.p2p_seconds(gb, 0, 1) == pytest.approx(gb / 4.5e11)
    assert c.collective_seconds("all_gather", gb, range(8)) == pytest.approx(7 / 8 * gb / 4.5e11)
    assert c.collective_seconds("all_reduce", gb, range(8)) == pytest.approx(2 * 7 / 8 * gb / 4.5e11)
    assert c.collective_seconds("all_to_all", gb, [3]) == 0.0
    with pytest.raises(ValueError, match="unknown collective 'broadcast'"):
        c.collective_seconds("broadcast", gb, range(8))


def test_local_and_errors() -> None:
    local = Cluster.local(2)
    assert local.world_size == 2 and local.device == "cpu" and local.memory_bytes > 0
    assert Cluster.preset("local").device == "cpu"
    with pytest.raises(ValueError, match=r"unknown cluster preset 'h100'; presets: \['h200_4096', .*'local'\]"):
        Cluster.preset("h100")
    with pytest.raises(ValueError, match="level sizes must grow and divide each other"):
        Cluster(
            name="bad",
            device="x",
            world_size=8,
            peak_flops=1.0,
            memory_bytes=1.0,
            levels=(Level(name="a", size=8, bandwidth=1.0), Level(name="b", size=12, bandwidth=1.0)),
            network_bandwidth=1.0,
        )
