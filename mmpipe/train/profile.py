"""``mmpipe profile``: calibrate the planner's cost model on this machine.

It runs every stage of a (tiny, real) training graph here, forward and, for stages on the backward
path, backward, and stores the achieved fraction of the device's peak FLOP/s per stage and
direction in a calibration file; ``plan`` (and the planner's cost model) then prices those stages
with the measured efficiency instead of the cluster's default.

``python -m mmpipe.train.profile '{"model": ..., "data": ..., "out": PATH}'`` is what
``placement=auto`` runs (:func:`mmpipe.train.prepare.calibrate_first`) when this machine has no
calibration for the model: the same runs with ``mmpipe profile``'s defaults, merged into the file.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import statistics
import sys
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from mmpipe.assemble.graphs import planning_graph
from mmpipe.config import DataConfig, LaunchConfig, ModelConfig, ProfileConfig, RunConfig, TrainConfig, from_dict
from mmpipe.devices import DeviceType, resolve_device
from mmpipe.graph import Graph
from mmpipe.runtime.events import read_events
from mmpipe.runtime.probe import probe_transport
from mmpipe.sched.calibration import Calibration
from mmpipe.sched.cluster import Cluster
from mmpipe.sched.cost import measure_graph_costs
from mmpipe.sched.simulator import measured_step_time
from mmpipe.train import train

PER_SAMPLE_FLOOR = 0.05  # the least share of an action's time profile attributes to its samples


def profile(
    model: ModelConfig,
    data: DataConfig,
    *,
    micro_sizes: tuple[int, ...] = (1, 2, 4),
    micro_batches: int = 4,
    steps: int = 6,
    warmup: int = 2,
    threads: int = 1,
    probe: bool = True,
    device: str = "auto",
) -> Calibration:
    """Calibrate the cost model on this machine's CPU or GPU (``device``) from real single-rank training runs.

    The model is trained for ``steps`` steps at each of ``micro_sizes`` (two or more growing
    micro-batch sizes); from the recorded events, each stage's median forward / backward time at
    two neighbouring sizes gives a fixed part (per action) and a per-sample part, whose FLOPs (from
    the cost model) over the nominal peak are the efficiency: one such line per pair of
    neighbouring sizes (:meth:`Calibration.line`; an action's time is not one line from 1 to 4
    samples on every stage);
    STEP events give the optimizer time, and the wall time not spent in actions the per-step
    overhead. ``probe`` also measures the transport's latency and bandwidth between two CPU ranks
    and, from a two-rank data-parallel run, what FSDP2 adds to each trained stage
    (:func:`sharded_overheads`); not on a GPU: its ranks' transport is NCCL's, one GPU each.
    """
    if model.arch is not None:
        raise ValueError(f"model {model.name!r} is architecture-only (no weights): profile a model with weights")
    if len(micro_sizes) < 2 or micro_sizes[0] <= 0 or any(a >= b for a, b in itertools.pairwise(micro_sizes)):
        raise ValueError(f"profile needs two or more growing micro-batch sizes, got {micro_sizes}")
    if steps <= warmup + 1:
        raise ValueError(f"profile needs steps > warmup + 1, got steps={steps} warmup={warmup}")

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
    t2 = timings[micro_sizes[-1]]  # the largest size's timings
    stages: dict[str, dict[str, float]] = {}
    for name in graph.topological_order():
        entry: dict[str, float] = {}
        for kind, direction, flops in (
            ("F", "forward", costs[name].forward_flops),
            ("B", "backward", costs[name].backward_flops),
        ):
            if not flops or any((name, kind) not in timings[n] for n in micro_sizes):
                continue
            pairs = list(itertools.pairwise(micro_sizes))
            for n1, n2 in pairs:
                per_sample, fixed = fit_action(timings[n1][(name, kind)], timings[n2][(name, kind)], n1, n2)
                # the two largest sizes' line unsuffixed (what an older calibration holds), smaller ones "upto"
                suffix = "" if (n1, n2) == pairs[-1] else f"_upto_{n2}"
                entry[f"{direction}{suffix}"] = flops / (cluster.peak_flops * per_sample)
                entry[f"{direction}_overhead_s{suffix}"] = fixed
        if (name, "STEP") in t2:
            entry["step_s"] = t2[(name, "STEP")]
        stages[name] = entry
    transport: dict[str, float] = {}
    if probe and not cuda:
        transport = probe_transport()
        # the gather (once a step) and the gradient reduce-scatter the cost model prices for a
        # sharded stage on two ranks, at the transport just measured
        measured = Calibration(cluster.device, cluster.peak_flops, {}, **transport)
        width = Cluster.local(2).dtype_bytes
        priced = {
            s.name: 2 * (measured.collective_seconds(width * costs[s.name].params, 2) or 0.0)
            for s in graph.trainable_stages()
        }
        # cfg: the last single-rank run, at the largest micro-batch size, whose timings are t2
        for name, extra in sharded_overheads(graph, cfg, t2, warmup, priced).items():
            stages[name].update(extra)
    return Calibration(cluster.device, cluster.peak_flops, stages, statistics.median(overheads), **transport)


def fit_action(t1: float, t2: float, n1: int, n2: int) -> tuple[float, float]:
    """An action's seconds per sample and fixed seconds from its median times ``t1`` / ``t2`` at
    micro-batch sizes ``n1`` < ``n2``: the line through both points. Where it grows by less than
    ``PER_SAMPLE_FLOOR`` of ``t2`` per ``n2`` samples (or shrinks: timing noise), the action's cost is
    its fixed part (a small stage's per-op overhead, e.g. the tiny VAE's causal chunks): the samples
    get that floor and the rest of ``t2`` is fixed. (Attributing it all to the samples instead made a
    fixed-cost VAE look twice as fast on half the samples, and data parallelism look free.)"""
    per_sample = max(PER_SAMPLE_FLOOR * t2 / n2, (t2 - t1) / (n2 - n1))
    return per_sample, max(0.0, t2 - n2 * per_sample)


def sharded_overheads(
    graph: Graph,
    single: RunConfig,
    timings: Mapping[tuple[str, str], float],
    warmup: int,
    priced: Mapping[str, float],
) -> dict[str, dict[str, float]]:
    """What FSDP2 adds to a trainable stage on two CPU ranks beyond its compute (its hooks, the
    optimizer on sharded tensors, the gradient reduction and norm): the single-rank run ``single``
    again with every stage data-parallel on both ranks (the trainable ones sharded, parameters
    gathered once a step), the same micro-batch size per rank. Per trainable stage, the median
    forward and backward on rank 0 less the same in the single-rank ``timings``
    (``sharded_forward_overhead_s`` / ``sharded_backward_overhead_s``, per action), and the rest of its
    time a step, median over the steps (the first forward's gather, the last backward's reduce-scatter, the optimizer on
    sharded tensors) beyond those and the single-rank optimizer step, less ``priced`` (stage -> the
    gather and reduce-scatter the cost model prices itself, from the transport probe):
    ``sharded_step_overhead_s``. The cost model adds them to a sharded configuration's forward,
    backward and gradient sync."""
    placement: dict[str, Any] = {
        name: {"ranks": [0, 1], "dp": 2} | ({} if graph.stages[name].frozen else {"gather_once": True})
        for name in graph.topological_order()
    }
    tc = single.train
    with tempfile.TemporaryDirectory(prefix="mmpipe-profile-dp-") as tmp:
        cfg = dataclasses.replace(
            single,
            run_dir=str(Path(tmp) / "dp2"),
            train=dataclasses.replace(tc, batch_size=2 * tc.batch_size),
            data=dataclasses.replace(single.data, val_samples=max(single.data.val_samples, 2 * tc.batch_size)),
            launch=LaunchConfig(nproc=2),
            placement=placement,
        )
        train(cfg)
        events = [e for e in read_events(Path(tmp) / "dp2") if e["phase"] == "train" and e["step"] > warmup]
    out: dict[str, dict[str, float]] = {}
    for stage in graph.trainable_stages():
        extra = sharded_extra(events, stage.name, timings, tc.micro_batches, priced.get(stage.name, 0.0))
        if extra is not None:
            out[stage.name] = extra
    return out


def sharded_extra(
    events: Sequence[Mapping[str, Any]],
    name: str,
    timings: Mapping[tuple[str, str], float],
    micro_batches: int,
    priced: float,
) -> dict[str, float] | None:
    """:func:`sharded_overheads` for stage ``name`` from the two-rank run's ``events`` (after its
    warm-up): None where either run lacks the stage's forward, backward or optimizer step."""
    if not all((name, k) in timings for k in ("F", "B", "STEP")):
        return None
    own = [e for e in events if e["stage"] == name and e["rank"] == 0 and e["kind"] in ("F", "B", "STEP")]
    mine = {k: [e["end"] - e["start"] for e in own if e["kind"] == k] for k in ("F", "B", "STEP")}
    if not all(mine.values()):
        return None
    f, b = statistics.median(mine["F"]), statistics.median(mine["B"])
    # the rest of a step's time in this stage (the first forward's gather, the last backward's
    # reduce-scatter, the step) beyond the typical forwards and backwards and the plain step: the
    # median over the steps (a collective's wait for a late peer lands in one step's actions)
    per_step: dict[int, float] = {}
    for e in own:
        per_step[e["step"]] = per_step.get(e["step"], 0.0) + e["end"] - e["start"]
    rest = statistics.median(per_step.values()) - micro_batches * (f + b) - timings[(name, "STEP")] - priced
    return {
        "sharded_forward_overhead_s": max(0.0, f - timings[(name, "F")]),
        "sharded_backward_overhead_s": max(0.0, b - timings[(name, "B")]),
        "sharded_step_overhead_s": max(0.0, rest),
    }


TRANSPORT = ("latency_s", "bandwidth", "collective_latency_s", "collective_bandwidth")


def merged(old: Calibration, new: Calibration) -> Calibration:
    """``old`` with the stages only ``new`` has added (another model's stages on the same machine);
    what ``old`` measured stays, and so do its per-step overhead and transport figures."""
    missing = {k: getattr(new, k) for k in TRANSPORT if getattr(old, k) is None}
    return dataclasses.replace(old, stages={**new.stages, **old.stages}, **missing)


def save_atomic(cal: Calibration, path: Path) -> Path:
    """Write ``cal`` to ``path`` through a temporary file in the same folder: a reader sees the old
    file or the whole new one, never a half-written one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        cal.save(tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def calibrate_into(model: ModelConfig, data: DataConfig, path: Path) -> Calibration:
    """Calibrate ``model`` on this machine's CPU with ``mmpipe profile``'s defaults and merge it into
    the calibration file at ``path`` (created if missing; its stages are kept), atomically."""
    d = ProfileConfig()
    cal = profile(
        model,
        data,
        micro_sizes=tuple(d.micro_sizes),
        micro_batches=d.micro_batches,
        steps=d.steps,
        warmup=d.warmup,
        threads=d.threads,
        device="cpu",  # placement=auto plans CPU ranks (Cluster.local), priced by calibration-cpu.json
    )
    if path.is_file():
        cal = merged(Calibration.load(path), cal)
    save_atomic(cal, path)
    return cal


def main(argv: list[str] | None = None) -> int:
    """``python -m mmpipe.train.profile JSON``: :func:`calibrate_into` for the model, data and output
    path a JSON object gives (``{"model": {...}, "data": {...}, "out": PATH}``, config form)."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        raise SystemExit('usage: python -m mmpipe.train.profile \'{"model": {...}, "data": {...}, "out": PATH}\'')
    raw = json.loads(args[0])
    model = from_dict(ModelConfig, raw["model"], "model.")
    data = from_dict(DataConfig, raw["data"], "data.")
    calibrate_into(model, data, Path(raw["out"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
