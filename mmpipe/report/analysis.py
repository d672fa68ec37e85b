"""The figures of a run's report, from what the run wrote: events, memory samples, metrics, config.

Time accounting (per rank, and per stage over its ranks) uses one window per run: the steady-state
training steps (all but the first when there are several: it pays for allocation and warm-up),
from the end of the step before them (across ranks) to the end of the last one, less the validation
passes inside it (each from its first event's start to its last event's end, over all ranks). In that wall time a rank is

- **busy**: in a compute action (``F``, ``B``, ``STEP``);
- **communicating**: in a transfer (``SEND``, ``RECV``, ``SENDG``, ``RECVG``; a receive includes the
  time it waits for its producer);
- **idle**: in no action (data loading outside actions, metrics reduction, checkpoints).

The *bubble* is ``1 - busy``, the simulator's definition (``mmpipe.sched.simulator.bubble_fractions``).
A transfer belongs to the stage on the rank that runs it: ``SEND`` to the producer, ``RECV`` and
``SENDG`` to the consumer, ``RECVG`` to the producer. A stage is trainable when it runs ``STEP``.
"""

from __future__ import annotations

import dataclasses
import json
from collections import defaultdict
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import yaml

from mmpipe.assemble.graphs import planning_graph
from mmpipe.assemble.placement import make_plans
from mmpipe.assemble.planning import build_workload, default_calibration_path, predict
from mmpipe.config import RunConfig, from_dict
from mmpipe.errors import PlanError
from mmpipe.rundir import PLAN_FILE
from mmpipe.runtime.events import read_events
from mmpipe.sched.analytic import Workload
from mmpipe.sched.calibration import Calibration
from mmpipe.sched.cluster import Cluster
from mmpipe.sched.plan import Plan
from mmpipe.sched.simulator import calibrate, simulate

COMPUTE = frozenset({"F", "B", "STEP"})
TRANSFER = frozenset({"SEND", "RECV", "SENDG", "RECVG"})
_CONSUMER_SIDE = frozenset({"RECV", "SENDG"})  # transfers run by the consumer stage's ranks


@dataclasses.dataclass
class Run:
    """What a run directory holds, read once."""

    run_dir: Path
    events: list[dict[str, Any]]
    memory: list[dict[str, Any]]
    metrics: list[dict[str, Any]]
    config: RunConfig | None
    config_error: str | None = None
    plan: Plan | None = None  # plan.txt: the training plan the run ran (runs of mmpipe before it: None)

    @property
    def name(self) -> str:
        return self.run_dir.name or str(self.run_dir)


def load_run(run_dir: Path) -> Run:
    """Read ``run_dir``; ``ValueError`` naming the path when it is no directory or has no events."""
    if not run_dir.is_dir():
        raise ValueError(f"{str(run_dir)!r} is not a directory")
    try:
        events = read_events(run_dir)
    except (json.JSONDecodeError, OSError) as err:
        raise ValueError(f"{str(run_dir / 'events')!r}: unreadable events ({err})") from None
    if not events:
        raise ValueError(f"{str(run_dir)!r} has no recorded events (expected {str(run_dir / 'events')}/rank<R>.jsonl)")
    config, error = None, None
    path = run_dir / "config.yaml"
    if path.is_file():
        try:
            config = from_dict(RunConfig, yaml.safe_load(path.read_text()))
        except ValueError as err:  # a config of an older mmpipe: the report goes on without it
            error = f"config.yaml not readable as a train config: {err}"
    plan = None
    if (run_dir / PLAN_FILE).is_file():
        try:
            plan = Plan.from_text((run_dir / PLAN_FILE).read_text())
        except PlanError as err:
            error = f"{PLAN_FILE} unreadable: {err}"
    metrics = read_jsonl(run_dir / "metrics.jsonl")
    return Run(run_dir, events, read_memory(run_dir), metrics, config, error, plan)


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """The records of a JSON-lines file (none when it is missing; a torn last line is skipped)."""
    if not path.is_file():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out


def read_memory(run_dir: Path) -> list[dict[str, Any]]:
    """All ranks' memory samples (``mmpipe.report.recording``), in time order."""
    samples = [s for p in sorted((run_dir / "memory").glob("rank*.jsonl")) for s in read_jsonl(p)]
    return sorted(samples, key=lambda s: s["time"])


# ---- the steady-state window -------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Window:
    """Steady-state training steps ``first..last`` and the wall seconds they took (validation excluded)."""

    first: int
    last: int
    start: float
    end: float
    excluded: tuple[tuple[float, float], ...]  # validation passes (all ranks) inside [start, end]

    @property
    def steps(self) -> int:
        return self.last - self.first + 1

    @property
    def wall(self) -> float:
        return self.end - self.start - sum(b - a for a, b in self.excluded)

    @property
    def step_time(self) -> float:
        return self.wall / self.steps

    def clip(self, start: float, end: float) -> float:
        """Seconds of ``[start, end]`` inside the window and outside the excluded spans."""
        inside = max(0.0, min(end, self.end) - max(start, self.start))
        for a, b in self.excluded:
            inside -= max(0.0, min(end, b) - max(start, a))
        return max(0.0, inside)


def main_phase(events: Iterable[Mapping[str, Any]]) -> str:
    """The phase the figures are about: ``train`` for a training run (validation passes are excluded),
    else ``serve`` for a serving run (``mmpipe serve``) or ``generate`` for ``mmpipe generate`` (one
    window over all of either)."""
    phases = {e["phase"] for e in events}
    for phase in ("train", "serve", "generate"):
        if phase in phases:
            return phase
    return "train"


def steady_window(events: Iterable[Mapping[str, Any]]) -> Window | None:
    """The window of the run's steady-state training steps, or of the whole of a serving run
    (``None`` without such events)."""
    events = list(events)
    main = main_phase(events)
    train = [e for e in events if e["phase"] == main]
    if not train:
        return None
    ends: dict[int, float] = defaultdict(float)
    for e in train:
        ends[e["step"]] = max(ends[e["step"]], e["end"])
    steps = sorted(ends)
    first, last = (steps[1], steps[-1]) if len(steps) > 1 else (steps[0], steps[0])
    if first - 1 in ends:
        start = ends[first - 1]
    else:
        start = min(e["start"] for e in train if e["step"] >= first)
    end = ends[last]
    passes: dict[tuple[str, int], tuple[float, float]] = {}  # a validation pass: first start to last end, all ranks
    for e in events:
        if e["phase"] != main:
            a, b = passes.get((e["phase"], e["step"]), (e["start"], e["end"]))
            passes[(e["phase"], e["step"])] = (min(a, e["start"]), max(b, e["end"]))
    val = _merge([(max(a, start), min(b, end)) for a, b in passes.values()])
    return Window(first, last, start, end, tuple((a, b) for a, b in val if b > a))


def _merge(spans: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[tuple[float, float]] = []
    for a, b in sorted(spans):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


# ---- time accounting ---------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class TimeShare:
    """Seconds of compute and communication (and of frozen / trainable stages' compute) in a wall time."""

    wall: float
    compute: float
    comm: float
    frozen: float = 0.0
    trainable: float = 0.0

    @property
    def busy_fraction(self) -> float:
        return self.compute / self.wall if self.wall > 0 else 0.0

    @property
    def comm_fraction(self) -> float:
        return self.comm / self.wall if self.wall > 0 else 0.0

    @property
    def idle_fraction(self) -> float:
        return max(0.0, 1.0 - self.busy_fraction - self.comm_fraction)

    @property
    def bubble(self) -> float:
        return 1.0 - self.busy_fraction


def event_stage(e: Mapping[str, Any]) -> str:
    """The stage whose rank runs the event (see the module docstring for transfers)."""
    return e["dst"] if e["kind"] in _CONSUMER_SIDE else e["stage"]


def trainable_stages(events: Iterable[Mapping[str, Any]]) -> set[str]:
    """Stages that run an optimizer step."""
    return {e["stage"] for e in events if e["kind"] == "STEP"}


def rank_shares(events: list[dict[str, Any]], window: Window) -> dict[int, TimeShare]:
    """Per rank: compute, communication, frozen and trainable compute seconds in the window."""
    trainable = trainable_stages(events)
    main = main_phase(events)
    acc: dict[int, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for e in events:
        if e["phase"] != main:
            continue
        t = window.clip(e["start"], e["end"])
        a = acc[e["rank"]]
        if e["kind"] in COMPUTE:
            a["compute"] += t
            a["trainable" if e["stage"] in trainable else "frozen"] += t
        elif e["kind"] in TRANSFER:
            a["comm"] += t
    ranks = sorted({e["rank"] for e in events})
    # (every field read: a rank with no transfers, a one-rank run, has no "comm" entry)
    fields = ("compute", "comm", "frozen", "trainable")
    return {r: TimeShare(window.wall, *(acc[r][f] for f in fields)) for r in ranks}


def stage_shares(events: list[dict[str, Any]], window: Window) -> dict[str, tuple[tuple[int, ...], TimeShare]]:
    """Per stage: its ranks and its compute / communication seconds over ``wall x ranks``."""
    compute: dict[str, float] = defaultdict(float)
    comm: dict[str, float] = defaultdict(float)
    ranks: dict[str, set[int]] = defaultdict(set)
    main = main_phase(events)
    for e in events:
        stage = event_stage(e)
        ranks[stage].add(e["rank"])
        if e["phase"] != main:
            continue
        t = window.clip(e["start"], e["end"])
        if e["kind"] in COMPUTE:
            compute[stage] += t
        elif e["kind"] in TRANSFER:
            comm[stage] += t
    trainable = trainable_stages(events)
    out = {}
    for stage in sorted(ranks, key=lambda s: (min(ranks[s]), s)):
        n = len(ranks[stage])
        share = TimeShare(
            wall=window.wall * n,
            compute=compute[stage],
            comm=comm[stage],
            frozen=0.0 if stage in trainable else compute[stage],
            trainable=compute[stage] if stage in trainable else 0.0,
        )
        out[stage] = (tuple(sorted(ranks[stage])), share)
    return out


@dataclasses.dataclass(frozen=True)
class EdgeTraffic:
    """One stage edge in one direction over the window's steps."""

    src: str
    dst: str
    grad: bool
    messages: int
    bytes: int
    send_s: float  # time senders spent in the send calls (posting asynchronous sends)
    recv_s: float  # time receivers spent in the receive calls (waiting included)
    steps: int

    @property
    def label(self) -> str:
        return f"{self.dst} -> {self.src} (gradients)" if self.grad else f"{self.src} -> {self.dst}"


def edge_traffic(events: list[dict[str, Any]], window: Window) -> list[EdgeTraffic]:
    """Per edge and direction: messages, bytes (counted by the sender), send and receive seconds."""
    acc: dict[tuple[str, str, bool], dict[str, float]] = defaultdict(lambda: defaultdict(float))
    main = main_phase(events)
    for e in events:
        if e["phase"] != main or e["kind"] not in TRANSFER or not window.first <= e["step"] <= window.last:
            continue
        a = acc[(e["stage"], e["dst"], e["kind"].endswith("G"))]
        if e["kind"].startswith("SEND"):
            a["messages"] += 1
            a["bytes"] += e["bytes"]
            a["send_s"] += e["end"] - e["start"]
        else:
            a["recv_s"] += e["end"] - e["start"]
    return [
        EdgeTraffic(src, dst, grad, int(a["messages"]), int(a["bytes"]), a["send_s"], a["recv_s"], window.steps)
        for (src, dst, grad), a in sorted(acc.items())
    ]


# ---- memory and metrics ------------------------------------------------------------------------
def memory_peaks(memory: list[dict[str, Any]]) -> dict[int, dict[str, int]]:
    """Per rank: the peak resident set (the kernel's high-water mark) and CUDA peak when sampled."""
    out: dict[int, dict[str, int]] = defaultdict(dict)
    for s in memory:
        peaks = out[s["rank"]]
        peaks["rss"] = max(peaks.get("rss", 0), s["rss_peak"], s["rss"])
        if "cuda_peak" in s:
            peaks["cuda"] = max(peaks.get("cuda", 0), s["cuda_peak"])
    return dict(sorted(out.items()))


def loss_curves(metrics: list[dict[str, Any]]) -> dict[str, list[tuple[int, float]]]:
    """``{"loss": [(step, loss)], "val_loss": [...]}`` from ``metrics.jsonl``."""
    return {k: [(r["step"], r[k]) for r in metrics if k in r] for k in ("loss", "val_loss")}


# ---- headline figures and the simulator's prediction -------------------------------------------
@dataclasses.dataclass(frozen=True)
class Prediction:
    """What the planner's cost model and simulator predict for the run's own placement, and the
    simulator replaying the run's plan with the run's own median action durations."""

    step_time: float
    bubble: float
    mfu: float
    calibrated: bool  # the cost model used `mmpipe profile`'s calibration of this machine
    replay_step_time: float | None
    replay_bubble: float | None


@dataclasses.dataclass(frozen=True)
class Summary:
    """A run's headline figures (``None``: not measurable from what the run wrote)."""

    name: str
    ranks: int
    steps: int
    step_time: float | None
    samples_per_s: float | None
    tokens_per_s: float | None
    mfu: float | None
    peak_flops: float | None  # per rank, the MFU's denominator
    bubble: float | None  # mean over ranks
    peak_rss: int | None  # the largest rank's
    final_loss: float | None
    final_val_loss: float | None
    prediction: Prediction | None
    notes: tuple[str, ...]


def summarize(run: Run, *, predict: bool = True) -> Summary:
    """The headline figures of ``run``; ``predict``: also plan and simulate its placement."""
    window = steady_window(run.events)
    notes = [run.config_error] if run.config_error else []
    ranks = len({e["rank"] for e in run.events})
    step_time = window.step_time if window is not None and window.wall > 0 else None
    shares = rank_shares(run.events, window) if window is not None else {}
    bubble = sum(s.bubble for s in shares.values()) / len(shares) if shares else None
    cfg = run.config
    samples = tokens = mfu = peak = None
    prediction = None
    if cfg is not None and step_time is not None:
        samples = cfg.train.batch_size / step_time
        try:
            workload, cluster = _workload(cfg)
            flops = sum(workload.model_flops(s) for s in workload.order) * cfg.train.batch_size
            tokens = workload.tokens_per_sample * samples
            peak = cluster.peak_flops
            mfu = flops / step_time / (cluster.world_size * peak)
            if predict:
                prediction = predict_run(run, workload, cluster)
        except ValueError as err:  # e.g. a model the cost model cannot build: the report goes on
            notes.append(f"no cost model for this run: {err}")
    elif main_phase(run.events) == "serve" and window is not None:
        # One decode event per batch; "batch" counts its requests.
        served = sum(int(e.get("batch", 1)) for e in run.events if e["stage"] == "decode" and e["kind"] == "F")
        notes.append(
            f"serving run (mmpipe serve): one window over all of it, {window.wall:.3f} s, in which "
            f"{served} requests finished ({served / max(window.wall, 1e-9):.3g}/s); "
            "'step time' is that window's length"
        )
    elif main_phase(run.events) == "generate" and window is not None:
        steps = sum(1 for e in run.events if e["stage"] == "denoise")
        notes.append(
            f"generation run (mmpipe generate): {window.wall:.3f} s for one video, {steps} denoiser calls; "
            "'step time' is the whole generation"
        )
    elif cfg is None:
        notes.append("no config.yaml: throughput, MFU and the prediction need the run's config")
    peaks = memory_peaks(run.memory)
    losses = loss_curves(run.metrics)
    return Summary(
        name=run.name,
        ranks=ranks,
        steps=max((e["step"] for e in run.events if e["phase"] == "train"), default=0),
        step_time=step_time,
        samples_per_s=samples,
        tokens_per_s=tokens,
        mfu=mfu,
        peak_flops=peak,
        bubble=bubble,
        peak_rss=max((p["rss"] for p in peaks.values()), default=None),
        final_loss=losses["loss"][-1][1] if losses["loss"] else None,
        final_val_loss=losses["val_loss"][-1][1] if losses["val_loss"] else None,
        prediction=prediction,
        notes=tuple(notes),
    )


def _workload(cfg: RunConfig) -> tuple[Workload, Cluster]:
    """The run's costed workload (stage FLOPs on the meta device) and its local cluster."""
    _, workload = build_workload(cfg.model, cfg.data, cfg.train.batch_size)
    return workload, Cluster.local(cfg.launch.nproc)


def predict_run(run: Run, workload: Workload, cluster: Cluster) -> Prediction:
    """The planner's prediction for the plan the run ran (``plan.txt``: its placement with the
    sequence parallelism and the ``memory.<stage>`` policies applied; ``benchmarks/planner.py``'s
    path), and the simulator replaying that plan with the run's measured median durations."""
    cfg = run.config
    assert cfg is not None
    plan = run.plan
    if plan is None:  # a run of an mmpipe that wrote no plan.txt: its plan made again from its config
        if cfg.placement == "auto":
            raise ValueError("placement=auto was not resolved in config.yaml")
        graph, _ = planning_graph(cfg.model, cfg.data)
        plan, _ = make_plans(graph, cfg)
    path = default_calibration_path()
    calibration = Calibration.load(path) if path.is_file() else None
    predicted = predict(workload, cluster, plan.groups, cfg.train.micro_batches, calibration)
    replay_step = replay_bubble = None
    window = steady_window(run.events)
    if window is not None and window.last > 1:
        sim = simulate(plan, calibrate(run.events, first_step=window.first), steps=4)
        replay_step = sim.step_time
        replay_bubble = sum(sim.bubble.values()) / len(sim.bubble) if sim.bubble else None
    return Prediction(
        step_time=predicted.step_time,
        bubble=predicted.bubble,
        mfu=predicted.mfu,
        calibrated=calibration is not None,
        replay_step_time=replay_step,
        replay_bubble=replay_bubble,
    )
