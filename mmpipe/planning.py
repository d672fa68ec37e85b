"""``mmpipe plan`` and ``mmpipe profile``: the planner on a model preset, and its calibration.

``profile`` runs every stage of a (tiny, real) training graph on this machine, forward and, for
stages on the backward path, backward, and stores the achieved fraction of the device's peak
FLOP/s per stage and direction in a calibration file; ``plan`` (and the planner's cost model) then
prices those stages with the measured efficiency instead of the cluster's default.
"""

from __future__ import annotations

import dataclasses
import os
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from mmpipe.config import DataConfig, ModelConfig, PlanConfig
from mmpipe.graph import Graph
from mmpipe.sched.cluster import Cluster
from mmpipe.sched.cost import ShapeDtype, measure_graph_costs
from mmpipe.sched.plan import DeviceGroup
from mmpipe.sched.planner import Calibration, Candidate, Planner, PlanReport, PlanResult, Workload
from mmpipe.sched.schedule import backward_stages
from mmpipe.workloads import planning_graph


def cluster_of(raw: dict[str, Any], nproc: int = 0) -> Cluster:
    """A cluster from its config form; ``local`` with ``nproc`` ranks (0: the machine's cores)."""
    return Cluster.from_dict(raw, nproc=nproc)


def build_workload(model: ModelConfig, data: DataConfig, global_batch: int) -> tuple[Graph, Workload]:
    """The model's training graph and its costed workload."""
    graph, shapes = planning_graph(model, data)
    costs = measure_graph_costs(graph, shapes)
    return graph, Workload.of(model.name, graph, costs, global_batch)


def plan_from_config(cfg: PlanConfig) -> tuple[Graph, PlanReport]:
    """Plan ``cfg.model`` on ``cfg.cluster``; the global batch defaults to one sample per device."""
    cluster = cluster_of(cfg.cluster, cfg.nproc)
    calibration = Calibration.load(cfg.calibration) if cfg.calibration else None
    graph, workload = build_workload(cfg.model, cfg.data, cfg.global_batch or cluster.world_size)
    planner = Planner(
        workload,
        cluster,
        calibration=calibration,
        micro_batches=cfg.micro_batches,
        simulate_top=3 if cfg.simulate else 0,
        batch_is_cap=not cfg.global_batch,
        **runtime_limits(cluster),
    )
    return graph, planner.plan()


def runtime_limits(cluster: Cluster) -> dict[str, Any]:
    """What today's runtime can execute on ``cluster``: the CPU (gloo) runtime has neither
    sequence parallelism nor activation recompute/offload yet, so local plans do without them."""
    if cluster.device == "cpu":
        return {"max_sequence_parallel": 1, "memory_policies": False}
    return {}


def predict(
    workload: Workload,
    cluster: Cluster,
    placement: dict[str, DeviceGroup],
    micro_batches: int,
    calibration: Calibration | None,
) -> PlanResult:
    """The simulated figures of a given placement (not one the planner chose)."""
    planner = Planner(workload, cluster, calibration=calibration, **runtime_limits(cluster))
    b = workload.global_batch // micro_batches
    configs = {}
    for s in workload.order:
        g = placement[s]
        cfg = planner.model.configure(
            s,
            b // g.dp,
            g.dp,
            g.ulysses,
            g.ring,
            g.recompute,
            g.offload,
            inflight=planner._inflight(s, micro_batches),
        )
        configs[s] = cfg
    colocated = len({placement[s].ranks for s in workload.order}) == 1
    cand = Candidate(
        "given",
        "colocated" if colocated else "disaggregated",
        configs,
        {s: placement[s].ranks for s in workload.order},
        b,
        micro_batches,
        cluster.world_size,
        0.0,
    )
    return planner.evaluate(cand, exact=True)


# ---- profile -----------------------------------------------------------------------------------
def profile(
    model: ModelConfig,
    data: DataConfig,
    *,
    batch_size: int,
    repeats: int = 5,
    warmup: int = 2,
    threads: int = 0,
    peak_flops: float | None = None,
) -> Calibration:
    """Measure each stage's forward (and backward) time on this machine's CPU; see the module docstring."""
    if model.arch is not None:
        raise ValueError(f"model {model.name!r} is architecture-only (no weights): profile a model with weights")
    if threads:
        torch.set_num_threads(threads)
    cluster = Cluster.local(1) if peak_flops is None else Cluster.local(1, peak_flops=peak_flops)
    graph, shapes = planning_graph(model, data)
    costs = measure_graph_costs(graph, shapes)
    backward = backward_stages(graph)
    inputs = _random_inputs(graph, shapes, batch_size)
    values: dict[str, dict[str, Any]] = {"input": inputs}
    stages: dict[str, dict[str, float]] = {}
    for name in graph.topological_order():
        stage = graph.stages[name]
        module = stage.module
        feed = {e.dst_port: values[e.src][e.src_port] for e in graph.producers(name) if e.src_port in values[e.src]}
        fwd_times, bwd_times = [], []
        out: dict[str, Any] = {}
        for i in range(warmup + repeats):
            module.zero_grad(set_to_none=True)
            leaf = {k: v.detach().requires_grad_(name in backward and v.is_floating_point()) for k, v in feed.items()}
            t0 = time.perf_counter()
            with torch.set_grad_enabled(name in backward):
                out = stage.forward(module, leaf, seed=i)
            t1 = time.perf_counter()
            if name in backward:
                tensors = [t for t in out.values() if isinstance(t, torch.Tensor) and t.requires_grad]
                torch.autograd.backward(tensors, [torch.ones_like(t) for t in tensors])
            t2 = time.perf_counter()
            if i >= warmup:
                fwd_times.append(t1 - t0)
                bwd_times.append(t2 - t1)
        values[name] = {k: v.detach() for k, v in out.items() if isinstance(v, torch.Tensor)}
        c = costs[name]
        entry = {"forward": batch_size * c.forward_flops / cluster.peak_flops / statistics.median(fwd_times)}
        if name in backward and c.backward_flops:
            entry["backward"] = batch_size * c.backward_flops / cluster.peak_flops / statistics.median(bwd_times)
        stages[name] = entry
    return Calibration(cluster.device, cluster.peak_flops, stages)


def _random_inputs(graph: Graph, shapes: dict[str, ShapeDtype], batch: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    out = {}
    for name, (shape, dtype) in shapes.items():
        full = (batch, *shape[1:])
        if name == "input_ids":
            stage = next(graph.stages[e.dst] for e in graph.edges if e.src == "input" and e.src_port == name)
            vocab = len(getattr(stage, "tokenizer", None) or []) or 8
            out[name] = torch.randint(0, vocab, full, generator=gen)
        elif not dtype.is_floating_point:
            out[name] = torch.ones(full, dtype=dtype)
        else:
            out[name] = torch.rand(full, generator=gen, dtype=dtype) * 2 - 1
    return out


def default_calibration_path(device: str = "cpu") -> Path:
    root = Path(os.environ.get("MMPIPE_CACHE", Path.home() / ".cache" / "mmpipe"))
    return root / f"calibration-{device}.json"


def report_json(graph: Graph, report: PlanReport) -> dict[str, Any]:
    """``mmpipe plan --json``: the report plus the chosen placement in config form."""
    placement = {
        s: dataclasses.asdict(g) | {"ranks": list(g.ranks)} for s, g in report.best.candidate.placement().items()
    }
    return report.to_json() | {"placement": placement}
