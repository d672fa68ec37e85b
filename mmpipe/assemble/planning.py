"""The planner on a config: a costed workload, the chosen layout (``placement=auto``, ``mmpipe plan``)
and the prediction for a given placement (the report)."""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from mmpipe.assemble.graphs import planning_graph, sample_inputs
from mmpipe.config import DataConfig, ModelConfig, PlanConfig, RunConfig
from mmpipe.data.datasets import VIDEO_PORTS
from mmpipe.graph import Graph
from mmpipe.sched.analytic import Workload
from mmpipe.sched.calibration import Calibration
from mmpipe.sched.cluster import Cluster
from mmpipe.sched.cost import ShapeDtype, measure_graph_costs
from mmpipe.sched.plan import DeviceGroup
from mmpipe.sched.planner import Planner
from mmpipe.sched.results import Candidate, PlanReport, PlanResult, placement_config

logger = logging.getLogger(__name__)


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
    compute_fraction: Mapping[str, float] | None = None,
) -> PlanReport:
    """Plan a training graph on a cluster (a :class:`Cluster` or a preset name).

    ``inputs``: the graph inputs' per-sample shapes, e.g. ``{"video": ((1, 3, 81, 720, 1280),
    torch.float32), ...}``. ``global_batch``: samples per step, kept exactly; ``None`` uses up to
    one sample per device. ``report.plan(graph)`` is the runtime's plan of the chosen layout.
    ``compute_fraction``: stage -> the share of its samples it computes (the rest served by the
    frozen-output cache), which scales its FLOPs and its calibrated fixed cost per forward.
    """
    cluster = Cluster.preset(cluster) if isinstance(cluster, str) else cluster
    if isinstance(calibration, str | Path):
        calibration = Calibration.load(calibration)
    costs = measure_graph_costs(graph, inputs)
    workload = Workload.of(name or graph.name, graph, costs, global_batch or cluster.world_size)
    workload = workload.with_compute_fraction(compute_fraction or {})
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
            micro_batches=micro_batches,
            gather_once=g.gather_once,
            replicate=g.replicate,
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


def default_calibration_path(device: str = "cpu") -> Path:
    root = Path(os.environ.get("MMPIPE_CACHE", Path.home() / ".cache" / "mmpipe"))
    return root / f"calibration-{device}.json"


def uncalibrated_stages(graph: Graph, path: Path) -> list[str]:
    """The stages of ``graph`` the calibration file at ``path`` has no entry for: all of them when
    there is no file. A file that is not a calibration is an error naming it (never overwritten)."""
    if not path.is_file():
        return graph.topological_order()
    stages = Calibration.load(path).stages
    return [s for s in graph.topological_order() if s not in stages]


def report_json(graph: Graph, report: PlanReport) -> dict[str, Any]:
    """``mmpipe plan --json``: the report plus the chosen placement in config form, which
    ``mmpipe train placement=FILE`` (the output saved to a file) runs unchanged."""
    return report.to_json() | {"placement": placement_config(report.best.candidate.placement())}


def frozen_compute_fraction(graph: Graph, cfg: RunConfig) -> dict[str, float]:
    """The share of its samples each cached frozen stage computes over the run: each distinct value
    of the inputs it depends on once (:func:`~mmpipe.data.datasets.input_keys`), the rest from the cache.
    A stage of the video alone computes every sample once, one of the caption alone every sample's
    caption and the empty one, one of both every sample with and without its caption. Once is
    once over all ranks: a sample keeps its data-parallel replica every epoch
    (:func:`~mmpipe.train.data.sample_indices`' lanes). Assumes the cache holds every sample (a run
    past ``train.cache_frozen_gb`` recomputes the rest, so this is then optimistic). A folder data
    set (``data.root``) is planned as if uncached."""
    tc = cfg.train
    if tc.cache_frozen_gb <= 0 or cfg.data.root is not None:
        return {}
    seen, n = tc.steps * tc.batch_size, cfg.data.num_samples
    dropped = tc.caption_dropout > 0
    fractions = {}
    for s in graph.frozen_prefix():
        ports = graph.data_inputs(s)
        video, caption = bool(ports & VIDEO_PORTS), bool(ports - VIDEO_PORTS)
        if video and caption:
            distinct = math.ceil(n * (1.0 + tc.caption_dropout))
        else:
            distinct = n + (1 if caption and dropped else 0)
        fractions[s] = min(seen, distinct) / seen
    return fractions


def auto_placement(graph: Graph, cfg: RunConfig) -> tuple[dict[str, Any], int]:
    """The planner's placement of ``graph`` on ``launch.nproc`` local CPU ranks (config form) and
    its micro-batches a step (``train.micro_batches``, or the planner's choice when that is 0)."""

    data = cfg.data
    path = default_calibration_path()
    report = plan(
        graph,
        Cluster.local(cfg.launch.nproc),
        inputs=sample_inputs(graph, cfg.model.text_len, data.frames, data.height, data.width),
        global_batch=cfg.train.batch_size,
        micro_batches=cfg.train.micro_batches,
        calibration=path if path.is_file() else None,
        name=cfg.model.name,
        compute_fraction=frozen_compute_fraction(graph, cfg),
    )
    logger.info("placement=auto (%s):\n%s", "calibrated" if path.is_file() else "uncalibrated", report.format())
    # with the memory policy the layout needs to fit (recomputed / file-tier offloaded blocks)
    best = report.best.candidate
    return placement_config(best.placement()), best.micro_batches
