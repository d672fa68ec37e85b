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
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from mmpipe.config import DataConfig, ModelConfig, PlanConfig
from mmpipe.graph import Graph
from mmpipe.sched.cluster import Cluster
from mmpipe.sched.cost import ShapeDtype, measure_graph_costs
from mmpipe.sched.plan import DeviceGroup
from mmpipe.sched.planner import Calibration, Candidate, Planner, PlanReport, PlanResult, Workload
from mmpipe.workloads import planning_graph


def cluster_of(raw: dict[str, Any], nproc: int = 0) -> Cluster:
    """A cluster from its config form; ``local`` with ``nproc`` ranks (0: the machine's cores)."""
    return Cluster.from_dict(raw, nproc=nproc)


def build_workload(model: ModelConfig, data: DataConfig, global_batch: int) -> tuple[Graph, Workload]:
    """The model's training graph and its costed workload."""
    graph, shapes = planning_graph(model, data)
    costs = measure_graph_costs(graph, shapes)
    return graph, Workload.of(model.name, graph, costs, global_batch)


def plan(
    graph: Graph,
    cluster: Cluster | str,
    *,
    inputs: Mapping[str, ShapeDtype],
    global_batch: int | None = None,
    micro_batches: int = 0,
    calibration: Calibration | str | Path | None = None,
    simulate: bool = True,
    name: str | None = None,
) -> PlanReport:
    """Plan a training graph on a cluster (a :class:`Cluster` or a preset name).

    ``inputs``: the graph inputs' per-sample shapes, e.g. ``{"video": ((1, 3, 81, 720, 1280),
    torch.float32), ...}``. ``global_batch``: samples per step, kept exactly; ``None`` uses up to
    one sample per device. ``report.plan(graph)`` is the runtime's plan of the chosen layout.
    """
    cluster = Cluster.preset(cluster) if isinstance(cluster, str) else cluster
    if isinstance(calibration, str | Path):
        calibration = Calibration.load(calibration)
    costs = measure_graph_costs(graph, inputs)
    workload = Workload.of(name or graph.name, graph, costs, global_batch or cluster.world_size)
    planner = Planner(
        workload,
        cluster,
        calibration=calibration,
        micro_batches=micro_batches,
        simulate_top=3 if simulate else 0,
        batch_is_cap=global_batch is None,
    )
    return planner.plan()


def plan_from_config(cfg: PlanConfig) -> tuple[Graph, PlanReport]:
    """Plan ``cfg.model`` on ``cfg.cluster``; the global batch defaults to one sample per device."""
    graph, shapes = planning_graph(cfg.model, cfg.data)
    report = plan(
        graph,
        cluster_of(cfg.cluster, cfg.nproc),
        inputs=shapes,
        global_batch=cfg.global_batch or None,
        micro_batches=cfg.micro_batches,
        calibration=cfg.calibration,
        simulate=cfg.simulate,
        name=cfg.model.name,
    )
    return graph, report


def predict(
    workload: Workload,
    cluster: Cluster,
    placement: dict[str, DeviceGroup],
    micro_batches: int,
    calibration: Calibration | None,
) -> PlanResult:
    """The simulated figures of a given placement (not one the planner chose)."""
    planner = Planner(workload, cluster, calibration=calibration)
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
            inflight=planner.inflight_micro_batches(s, micro_batches),
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
    micro_sizes: tuple[int, int] = (1, 2),
    micro_batches: int = 4,
    steps: int = 6,
    warmup: int = 2,
    threads: int = 1,
    probe: bool = True,
    device: str = "auto",
) -> Calibration:
    """Calibrate the cost model on this machine's CPU or GPU (``device``) from real single-rank training runs.

    The model is trained for ``steps`` steps at two micro-batch sizes; from the recorded events,
    each stage's median forward / backward time at both sizes gives a fixed part (per action) and
    a per-sample part, whose FLOPs (from the cost model) over the nominal peak are the efficiency;
    STEP events give the optimizer time, and the wall time not spent in actions the per-step
    overhead. ``probe`` also measures the transport's latency and bandwidth between two CPU ranks
    (not on a GPU: its ranks' transport is NCCL's, one GPU each).
    """
    if model.arch is not None:
        raise ValueError(f"model {model.name!r} is architecture-only (no weights): profile a model with weights")
    if not 0 < micro_sizes[0] < micro_sizes[1]:
        raise ValueError(f"profile needs two growing micro-batch sizes, got {micro_sizes}")
    if steps <= warmup + 1:
        raise ValueError(f"profile needs steps > warmup + 1, got steps={steps} warmup={warmup}")
    from mmpipe.config import LaunchConfig, RunConfig, TrainConfig
    from mmpipe.devices import DeviceType, resolve_device
    from mmpipe.runtime.events import read_events
    from mmpipe.sched.simulator import measured_step_time
    from mmpipe.train import train

    cuda = resolve_device(device) is DeviceType.CUDA
    cluster = Cluster.local_cuda(1) if cuda else Cluster.local(1)
    graph, shapes = planning_graph(model, data)
    costs = measure_graph_costs(graph, shapes)
    timings: dict[int, dict[tuple[str, str], float]] = {}
    overheads = []
    with tempfile.TemporaryDirectory(prefix="mmpipe-profile-") as tmp:
        for n in micro_sizes:
            run_dir = Path(tmp) / f"micro{n}"
            batch = n * micro_batches
            cfg = RunConfig(
                run_dir=str(run_dir),
                device="cuda" if cuda else "cpu",
                model=model,
                data=dataclasses.replace(data, val_samples=max(data.val_samples, batch)),
                train=TrainConfig(
                    steps=steps,
                    batch_size=batch,
                    micro_batches=micro_batches,
                    log_every=steps,
                    val_every=10 * steps,
                    ckpt_every=10 * steps,
                    progress=False,
                    threads=threads,
                ),
                launch=LaunchConfig(nproc=1),
            )
            train(cfg)
            events = [e for e in read_events(run_dir) if e["phase"] == "train" and e["step"] > warmup]
            samples: dict[tuple[str, str], list[float]] = {}
            for e in events:
                samples.setdefault((e["stage"], e["kind"]), []).append(e["end"] - e["start"])
            timings[n] = {k: statistics.median(v) for k, v in samples.items()}
            wall = measured_step_time(read_events(run_dir), first_step=warmup + 1, last_step=steps)
            busy = sum(e["end"] - e["start"] for e in events) / (steps - warmup)
            overheads.append(max(0.0, wall - busy))
    (n1, n2), (t1, t2) = micro_sizes, (timings[micro_sizes[0]], timings[micro_sizes[1]])
    stages: dict[str, dict[str, float]] = {}
    for name in graph.topological_order():
        entry: dict[str, float] = {}
        for kind, direction, flops in (
            ("F", "forward", costs[name].forward_flops),
            ("B", "backward", costs[name].backward_flops),
        ):
            if (name, kind) not in t2 or not flops:
                continue
            per_sample = (t2[(name, kind)] - t1[(name, kind)]) / (n2 - n1)
            if per_sample <= 0:  # within noise: attribute all of it to the samples
                per_sample, fixed = t2[(name, kind)] / n2, 0.0
            else:
                fixed = max(0.0, t1[(name, kind)] - n1 * per_sample)
            entry[direction] = flops / (cluster.peak_flops * per_sample)
            entry[f"{direction}_overhead_s"] = fixed
        if (name, "STEP") in t2:
            entry["step_s"] = t2[(name, "STEP")]
        stages[name] = entry
    transport: dict[str, float] = {}
    if probe and not cuda:
        from mmpipe.runtime.probe import probe_transport

        transport = probe_transport()
    return Calibration(cluster.device, cluster.peak_flops, stages, statistics.median(overheads), **transport)


def default_calibration_path(device: str = "cpu") -> Path:
    root = Path(os.environ.get("MMPIPE_CACHE", Path.home() / ".cache" / "mmpipe"))
    return root / f"calibration-{device}.json"


def report_json(graph: Graph, report: PlanReport) -> dict[str, Any]:
    """``mmpipe plan --json``: the report plus the chosen placement in config form."""
    placement = {
        s: dataclasses.asdict(g) | {"ranks": list(g.ranks)} for s, g in report.best.candidate.placement().items()
    }
    return report.to_json() | {"placement": placement}
