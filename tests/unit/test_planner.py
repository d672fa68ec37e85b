"""The planner: property tests over random workloads and clusters, baselines, calibration, golden plans.

Golden plans live in ``tests/golden/``; after an intended change of the planner or the cost
model, regenerate them with::

    MMPIPE_UPDATE_GOLDEN=1 pytest tests/unit/test_planner.py -k golden
"""

from __future__ import annotations

import dataclasses
import os
import random
from pathlib import Path

import pytest

from mmpipe.errors import PlanError
from mmpipe.graph import Capabilities
from mmpipe.sched.analytic import USABLE_MEMORY, CostModel, Workload
from mmpipe.sched.calibration import Calibration
from mmpipe.sched.cluster import Cluster, Level
from mmpipe.sched.cost import StageCost
from mmpipe.sched.plan import DeviceGroup, Plan
from mmpipe.sched.planner import Planner
from mmpipe.sched.simulator import simulate

GOLDEN = Path(__file__).parent.parent / "golden"
GB = 1e9


@dataclasses.dataclass
class FakeStage:
    name: str
    frozen: bool
    capabilities: Capabilities = Capabilities()


class FakeGraph:
    """Just what the planner and the schedule generator read of a graph."""

    def __init__(self, stages: list[FakeStage], edges: list[tuple[str, str]]) -> None:
        self.stages = {s.name: s for s in stages}
        self._edges = edges

    def topological_order(self) -> list[str]:
        return list(self.stages)

    def stage_edges(self) -> list[tuple[str, str]]:
        return list(self._edges)


def cost(params: float, fwd: float, *, train: bool, act: float = 0.0, tokens: int = 0, heads: int = 0) -> StageCost:
    blocks = 8 if tokens else 0
    return StageCost(
        forward_flops=fwd,
        backward_flops=2 * fwd if train else 0.0,
        attention_flops=0.3 * fwd if tokens else 0.0,
        params=int(params),
        output_bytes=int(1e6),
        activation_bytes=int(act),
        block_flops=0.9 * fwd if tokens else 0.0,
        block_activation_bytes=int(0.95 * act),
        block_input_bytes=int(0.05 * act),
        blocks=blocks,
        tokens=tokens,
        hidden=1024 if tokens else 0,
        heads=heads,
    )


def t2v_workload(rng: random.Random, batch: int) -> Workload:
    sp = Capabilities(sequence_parallel=True, fsdp=True)
    graph = FakeGraph(
        [FakeStage("text", True), FakeStage("vae", True), FakeStage("dit", False, sp)],
        [("text", "dit"), ("vae", "dit")],
    )
    costs = {
        "text": cost(rng.uniform(0.1, 6) * GB, rng.uniform(1e12, 1e13), train=False),
        "vae": cost(rng.uniform(0.05, 0.3) * GB, rng.uniform(1e13, 1e15), train=False),
        "dit": cost(
            rng.uniform(1, 14) * GB,
            rng.uniform(1e14, 1e16),
            train=True,
            act=rng.uniform(10, 300) * GB,
            tokens=rng.choice([4096, 32760, 75600]),
            heads=rng.choice([12, 16, 24, 40]),
        ),
    }
    return Workload.of("t2v", graph, costs, batch)


def chain_workload(rng: random.Random, batch: int) -> Workload:
    """Gradients cross stage boundaries: vision (frozen) -> llm -> connector -> dit <- vae (frozen)."""
    sp = Capabilities(sequence_parallel=True, fsdp=True)
    graph = FakeGraph(
        [
            FakeStage("vision", True),
            FakeStage("llm", False, sp),
            FakeStage("connector", False),
            FakeStage("vae", True),
            FakeStage("dit", False, sp),
        ],
        [("vision", "llm"), ("llm", "connector"), ("connector", "dit"), ("vae", "dit")],
    )
    costs = {
        "vision": cost(0.4 * GB, 1e12, train=False),
        "llm": cost(rng.uniform(0.5, 7) * GB, rng.uniform(1e12, 2e13), train=True, act=5 * GB, tokens=1024, heads=28),
        "connector": cost(0.03 * GB, 1e11, train=True, act=0.1 * GB),
        "vae": cost(0.1 * GB, rng.uniform(1e13, 1e15), train=False),
        "dit": cost(
            rng.uniform(1, 8) * GB,
            rng.uniform(1e14, 1e16),
            train=True,
            act=rng.uniform(10, 300) * GB,
            tokens=32760,
            heads=40,
        ),
    }
    return Workload.of("u2g", graph, costs, batch)


def random_cluster(rng: random.Random) -> Cluster:
    node = rng.choice([2, 4, 8])
    world = rng.choice([1, 2, 3, 4, 6, 8, 16, 24, 32, 64])
    return Cluster(
        name="random",
        device="gpu",
        world_size=world,
        peak_flops=1e15,
        memory_bytes=rng.choice([80, 141]) * GB,
        levels=(Level(name="node", size=node, bandwidth=4e11),),
        network_bandwidth=5e10,
    )


def check_plan_properties(workload: Workload, cluster: Cluster, planner: Planner) -> None:
    report = planner.plan()
    best = report.best
    cand = best.candidate
    budget = cluster.memory_bytes * USABLE_MEMORY
    # Fits memory and devices.
    assert best.fits_memory and all(v <= budget for v in best.peak_memory.values())
    assert all(c.memory <= budget for c in cand.configs.values())
    used = [r for ranks in cand.ranks.values() for r in ranks]
    assert all(0 <= r < cluster.world_size for r in used)
    if cand.layout == "disaggregated":
        assert len(used) == len(set(used)), "disaggregated groups overlap"
    # The batch: every group splits each micro-batch evenly; the global batch is kept (or capped).
    for s, c in cand.configs.items():
        assert c.ranks == len(cand.ranks[s])
        if s in workload.backward:  # FSDP averages equal shares; frozen shares may differ by one
            assert cand.micro_batch % c.dp == 0
        elif c.dp > cand.micro_batch:  # frozen replicas taking turns do equal work over a step
            assert cand.layout == "colocated" and cand.global_batch % c.dp == 0
    if planner.batch_is_cap:
        assert cand.global_batch <= workload.global_batch
    else:
        assert cand.global_batch == workload.global_batch
    # The chosen plan is a valid runtime plan (validate() dry-runs it: no deadlock), and the
    # simulator runs it under the runtime's bounded sends without stalling.
    full = report.plan(workload.graph)
    assert full.world_size == cluster.world_size and full.micro_batches == cand.micro_batches
    if cluster.world_size <= 24:
        sim = simulate(full, lambda a: 1.0, steps=2)
        assert sim.step_time > 0
    # Never worse than the baselines it is compared with; never above the lower bound.
    for alt in (report.colocated, report.uniform):
        if alt is not None and alt.fits_memory:
            assert best.samples_per_s >= alt.samples_per_s * (1 - 1e-9)
    assert best.samples_per_s <= report.lower_bound_samples_per_s * (1 + 1e-6)


@pytest.mark.parametrize("seed", range(24))
def test_plans_fit_memory_and_devices_and_never_deadlock(seed: int) -> None:
    rng = random.Random(seed)
    cluster = random_cluster(rng)
    make = t2v_workload if seed % 3 else chain_workload
    cap = rng.random() < 0.5
    workload = make(rng, cluster.world_size * rng.choice([1, 2]))
    planner = Planner(workload, cluster, batch_is_cap=cap)
    try:
        check_plan_properties(workload, cluster, planner)
    except ValueError as e:
        # Only when nothing fits: some stage does not fit even with one sample per replica, split
        # as far as its sequence allows, sharded over the whole cluster, fully recomputed and offloaded.
        assert "fits" in str(e)
        model = planner.model

        def fits_somehow(stage: str) -> bool:
            for u, r in planner._sp_options(stage):
                if u * r > cluster.world_size:
                    continue
                dp = cluster.world_size // (u * r)
                if model.fits(model.configure(stage, 1, dp, u, r, 1.0, 1.0)):
                    return True
            return False

        assert not all(fits_somehow(s) for s in workload.order)


def test_sequence_parallel_groups_stay_inside_a_node() -> None:
    rng = random.Random(7)
    workload = t2v_workload(rng, 64)
    workload = dataclasses.replace(
        workload,
        costs=dict(workload.costs) | {"dit": cost(14 * GB, 2e16, train=True, act=1200 * GB, tokens=75600, heads=40)},
    )
    cluster = Cluster.preset("h200_64")
    report = Planner(workload, cluster).plan()
    groups = report.best.candidate.placement()
    dit = groups["dit"]
    assert dit.sp > 1, "a 1.2 TB-per-sample DiT needs its sequence split"
    for replica in range(dit.dp):
        ranks = dit.ranks[replica * dit.sp : (replica + 1) * dit.sp]
        assert len({r // 8 for r in ranks}) == 1, f"replica {ranks} spans nodes"


def test_baselines_and_lower_bound_are_reported() -> None:
    rng = random.Random(3)
    workload = t2v_workload(rng, 16)
    report = Planner(workload, Cluster.preset("h200_64")).plan()
    j = report.to_json()
    assert j["plan"]["fits_memory"] and j["colocated_sequential"] is not None
    assert j["vs_lower_bound"] <= 1.0 + 1e-9
    assert report.best.mfu > 0
    text = report.format()
    for needle in ("colocated-sequential", "uniform split", "lower bound", "samples/s", "MFU", "bubble"):
        assert needle in text


def test_calibration_changes_the_costs_it_should(tmp_path: Path) -> None:
    rng = random.Random(1)
    workload = t2v_workload(rng, 8)
    cluster = Cluster.preset("h200_8")
    plain = CostModel(cluster, workload).configure("dit", 1, 1, 1, 1, 0.0, 0.0)
    cal = Calibration(
        "H200", cluster.peak_flops, {"dit": {"forward": 0.225, "backward": 0.225, "forward_overhead_s": 0.5}}
    )
    path = cal.save(tmp_path / "cal.json")
    assert Calibration.load(path) == cal
    tuned = CostModel(cluster, workload, Calibration.load(path)).configure("dit", 1, 1, 1, 1, 0.0, 0.0)
    # half the default efficiency (0.45): twice the compute time, plus the fixed cost
    c = workload.costs["dit"]
    assert tuned.forward_s == pytest.approx(0.5 + 2 * c.forward_flops / (cluster.peak_flops * 0.45), rel=1e-6)
    assert tuned.backward_s > plain.backward_s
    # a calibration of another device kind is ignored
    other = dataclasses.replace(cal, device="cpu")
    assert CostModel(cluster, workload, other).configure("dit", 1, 1, 1, 1, 0.0, 0.0) == plain
    with pytest.raises(ValueError, match="not a calibration file"):
        (tmp_path / "bad.json").write_text("{}")
        Calibration.load(tmp_path / "bad.json")


def test_memory_policy_trades_time_for_memory() -> None:
    rng = random.Random(2)
    workload = t2v_workload(rng, 8)
    model = CostModel(Cluster.preset("h200_8"), workload)
    keep = model.configure("dit", 1, 1, 1, 1, 0.0, 0.0)
    full = model.configure("dit", 1, 1, 1, 1, 1.0, 0.0)
    assert full.memory < keep.memory and full.backward_s > keep.backward_s
    sp = model.configure("dit", 1, 1, 4, 1, 0.0, 0.0)
    assert sp.memory < keep.memory and sp.forward_s < keep.forward_s


def test_plan_text_round_trips_sequence_parallel_and_memory_policy() -> None:
    rng = random.Random(4)
    workload = t2v_workload(rng, 8)
    report = Planner(workload, Cluster.preset("h200_8")).plan()
    full = report.plan(workload.graph)
    assert Plan.from_text(full.to_text()) == full
    group = DeviceGroup((0, 1, 2, 3), dp=1, ulysses=2, ring=2, recompute=0.5, offload=0.25)
    assert group.sp == 4 and group.replica(3) == 0 and group.rows(2, 8) == (0, 8)
    with pytest.raises(PlanError, match="recompute=1.5 must be in"):
        DeviceGroup((0,), recompute=1.5)


# ---- golden plans ----------------------------------------------------------------------------
def golden_check(name: str, text: str) -> None:
    path = GOLDEN / f"{name}.plan"
    if os.environ.get("MMPIPE_UPDATE_GOLDEN"):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    assert path.is_file(), f"{path} is missing; regenerate with MMPIPE_UPDATE_GOLDEN=1"
    assert text == path.read_text(), f"plan differs from {path}; if intended, regenerate with MMPIPE_UPDATE_GOLDEN=1"


def test_golden_synthetic_t2v_on_one_node() -> None:
    workload = t2v_workload(random.Random(11), 16)
    report = Planner(workload, Cluster.preset("h200_8")).plan()
    golden_check("synthetic_t2v_h200_8", report.best.candidate.layout + "\n" + report.plan(workload.graph).to_text())


def test_golden_synthetic_chain_on_two_nodes() -> None:
    workload = chain_workload(random.Random(12), 16)
    cluster = dataclasses.replace(Cluster.preset("h200_8"), world_size=16)
    report = Planner(workload, cluster).plan()
    golden_check("synthetic_chain_16", report.best.candidate.layout + "\n" + report.plan(workload.graph).to_text())


def test_golden_tiny_t2v_on_two_local_ranks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from mmpipe.assemble.planning import plan_from_config
    from mmpipe.config import PlanConfig, compose_config, from_dict

    monkeypatch.setenv("MMPIPE_CACHE", str(tmp_path))
    cfg = from_dict(
        PlanConfig, compose_config("plan", ["model=t2v_tiny", "cluster=local", "nproc=2", "global_batch=8"])
    )
    graph, report = plan_from_config(cfg)
    golden_check("t2v_tiny_local_2", report.plan(graph).to_text())


def test_stage_partitions_are_complete_and_distinct() -> None:
    from mmpipe.sched.planner import _partitions

    parts = list(_partitions(["a", "b", "c", "d", "e"]))
    assert len(parts) == 52  # the Bell number B5
    canon = {tuple(sorted(tuple(sorted(block)) for block in p)) for p in parts}
    assert len(canon) == 52 and all(sorted(x for block in p for x in block) == list("abcde") for p in parts)


def test_bundles_put_a_light_encoder_with_the_trainable_stage() -> None:
    # Two CPU ranks with fixed costs per action (as `mmpipe profile` measures them on this
    # machine: the VAE's 40 ms dominate): splitting every stage over both ranks pays each fixed
    # cost on both, so the best layout gives the VAE one rank and time-slices the light text
    # encoder with the DiT on the other (the runtime issue's measured placement), which neither
    # the colocated nor the one-stage-per-group layout can express on two ranks.
    graph = FakeGraph(
        [FakeStage("text", True), FakeStage("vae", True), FakeStage("dit", False)], [("text", "dit"), ("vae", "dit")]
    )
    costs = {
        "text": cost(1e6, 1e8, train=False),
        "vae": cost(1e6, 5e9, train=False),  # 50 ms per sample at the local nominal peak
        "dit": cost(5e6, 5e9 / 3, train=True, act=1e8),  # 50 ms forward + backward per sample
    }
    workload = Workload.of("tiny", graph, costs, 8)
    cluster = Cluster.local(2)
    overheads = {"text": 0.0024, "vae": 0.04, "dit": 0.008}
    cal = Calibration(
        "cpu",
        cluster.peak_flops,
        {
            s: {"forward": 1.0, "backward": 1.0, "forward_overhead_s": o, "backward_overhead_s": o}
            for s, o in overheads.items()
        },
    )
    planner = Planner(
        workload, cluster, calibration=cal, micro_batches=4, max_sequence_parallel=1, memory_policies=False
    )
    report = planner.plan()
    cand = report.best.candidate
    assert cand.layout == "bundled"
    assert cand.ranks["text"] == cand.ranks["dit"] != cand.ranks["vae"]
    ratio = report.vs(report.colocated)
    assert ratio is not None and ratio > 1.05
    assert report.plan(graph).world_size == 2


def test_top_level_plan_api_on_a_graph(tiny_wan_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    import mmpipe
    from mmpipe.models.wan import build_t2v_training_graph

    monkeypatch.setenv("MMPIPE_CACHE", str(tmp_path))
    graph = build_t2v_training_graph(tiny_wan_dir, text_len=16)
    inputs = {
        "input_ids": ((1, 16), torch.int64),
        "attention_mask": ((1, 16), torch.int64),
        "video": ((1, 3, 9, 32, 32), torch.float32),
    }
    report = mmpipe.plan(graph, "h200_8", inputs=inputs, global_batch=16)
    assert report.global_batch == 16 and report.best.fits_memory
    full = report.plan(graph)
    full.validate()
    assert set(dict(full.placement)) == {"text", "vae", "dit"}


@pytest.mark.parametrize("cluster_name", ["local", "h200_8"])
def test_the_planners_memory_policy_is_the_budget_search(cluster_name: str) -> None:
    """When keeping every activation does not fit, the planner asks ``mmpipe.memory.budget`` for the
    counts: they fit, and no other count of recomputed / offloaded blocks that fits is faster in the
    cost model (exact where offload is priced linearly: the CPU file tier, whose reads block)."""
    workload = t2v_workload(random.Random(3), 2)
    INFLIGHT = Planner(workload, Cluster.local(2)).inflight_micro_batches("dit", 4)
    base = Cluster.local(2) if cluster_name == "local" else Cluster.preset(cluster_name)
    c = workload.costs["dit"]
    roomy = CostModel(dataclasses.replace(base, memory_bytes=1e18), workload)

    def configs(model: CostModel) -> list:  # type: ignore[type-arg]
        n = c.blocks
        return [
            model.configure("dit", 1, 1, 1, 1, r / n, o / (n - r) if n - r else 0.0, inflight=INFLIGHT)
            for r in range(n + 1)
            for o in range(n - r + 1)
        ]

    keep, least = roomy.configure("dit", 1, 1, 1, 1, 0.0, 0.0, inflight=INFLIGHT), min(m.memory for m in configs(roomy))
    cluster = dataclasses.replace(base, memory_bytes=(keep.memory + least) / 2 / USABLE_MEMORY)
    planner = Planner(workload, cluster)
    tight = planner.model.configure("dit", 1, 1, 1, 1, 0.0, 0.0, inflight=INFLIGHT)
    assert not planner.model.fits(tight)
    got = planner.memory_policy(tight)
    assert got is not None and planner.model.fits(got) and (got.recompute or got.offload)
    fastest = min(m.time for m in configs(planner.model) if planner.model.fits(m))
    if cluster_name == "local":
        assert got.offload > 0 and got.time == pytest.approx(fastest, rel=1e-9)
    else:  # offload hidden behind compute up to a point: the linear pricing may miss by that
        assert fastest <= got.time <= 1.05 * fastest
    # the planner's own search takes it (and reports nothing fits with policies off)
    assert planner.best_config("dit", 1, 1, 4, sp=[(1, 1)]) == got
    assert Planner(workload, cluster, memory_policies=False).best_config("dit", 1, 1, 4, sp=[(1, 1)]) is None
