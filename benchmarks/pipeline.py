"""The planner's placement (``placement=auto``) against every placement the runtime runs on 2 ranks.

Contender: ``placement=auto`` exactly as ``mmpipe train placement=auto launch.nproc=2`` gets it: the
planner's choice, made in ``prepare_run`` before the workers start, after calibrating this machine
when ``$MMPIPE_CACHE`` has no calibration for the model (``--cache``; default a fresh folder, so the
first auto run of each model calibrates, as on a new machine). The placement it resolved to is read
back from each run's ``config.yaml`` (``auto_placement``; ``auto_name``: the enumerated placement it
is). Baselines, on the same 2 ranks x 1 thread each, enumerated from the model's graph: every
assignment of its units of stages to rank 0, rank 1 or both (data-parallel, dp=2: FSDP2 for a
trained stage, turns over the micro-batches for a frozen one), the DiT also data-parallel with its
parameters gathered once per step (``dp+once``) or whole on both ranks, its gradients all-reduced
(``dp+ddp``: DDP, ``replicate: true``), or split over both ranks by Ulysses (``ulysses2``; with
whole parameters: ``ulysses2+ddp``). Units: the VAE, the DiT, and the stages that make the DiT's context grouped by
``--context``: ``roles`` (default: each run of them with one role, frozen or trained; t2v: text;
u2g: vision | LLM + connector), ``tied`` (all in one unit) or ``separate`` (each alone; u2g: 203
placements). A trained unit besides the DiT (u2g's LLM + connector) may also be data-parallel with whole
parameters (``dp+ddp``). Dropped: placements that leave a rank idle, and one of each mirror pair (ranks 0 and
1 swapped: the same two processes on one machine). A placement the config check rejects before any
worker starts is listed in ``skipped`` with the error, one that fails while running with the failure.
The data-parallel baselines (every unit ``dp``, the DiT ``dp``, ``dp+once`` or ``dp+ddp``; and
every trained unit ``dp+ddp``, the frozen ones ``dp``) are among them.

Workloads (sizes not tuned: the presets, or one stated doubling):
  default    the embedded default (``t2v_tiny``, 17 x 64 x 64 clips);
  dit_heavy  ``t2v_tiny`` with twice the DiT's layers (``model.dit_layers`` 2 -> 4; 4 -> 8 before 2026-12-06);
  vae_heavy  larger clips: twice the frames (``data.frames`` 17 -> 33, 64 x 64): twice the VAE's
             encode work (the DiT's tokens grow too, 5 -> 9 latent frames);
  u2g        the ``u2g_tiny`` preset (vision tower, LLM, connector, VAE, DiT; 17 x 64 x 64).

How: every run has the same data, seeds, global batch, micro-batches, steps and warm-up; throughput
is samples/s over the steps after the warm-up, from the recorded events. With ``--finalists K``
(default 3) each baseline first gets one screening run (``--screen-steps``: half of ``--steps`` by
default, the same warm-up; in a shuffled order); the finalists are the data-parallel baselines,
the enumerated placement auto plans (resolved up front by the ``resolve_auto`` that ``mmpipe train``
calls, calibrating first) and the K fastest screened ones (``--finalists 0``: every baseline, no
screening). Then ``--repeats`` alternating rounds run auto and every finalist (the order rotated
each round). Per round, auto / a baseline; reported: the median of those per-round ratios and
their range [min, max], never a ratio of medians. ``regret`` = auto's placement / the round's
fastest other finalist (above 1 when auto beats them all), where auto's run is averaged with the
round's run of the finalist that is the very placement auto chose (``regret_pooled_with``; one arm
measured twice, not raced against itself: ``regret_unpooled`` keeps the raced figure, biased low by
the larger of two noisy runs of one placement); ``vs_best_baseline`` = auto / ``best_baseline`` (the
finalist with the highest median samples/s), range ``ratio_range``; ``vs_data_parallel`` = auto /
the round's fastest data-parallel baseline, auto's run pooled the same way when its placement is
one of them (``vs_data_parallel_unpooled``: raced). Goals, printed met or missed: regret >= 0.95 on every
workload; auto never below data-parallel (median ratio >= 1).
Context only, not a baseline: 1 process x 2 threads on the default workload, once per round.

The last stdout line is JSON: ``{"workloads": [{"name", "what", "auto_placement", "auto_name",
"auto_stable" (the same placement every round), "calibrated_first", "regret", "regret_range",
"regret_pooled_with", "regret_unpooled", "regret_unpooled_range",
"vs_data_parallel", "vs_data_parallel_range", "vs_data_parallel_unpooled", "data_parallel_baselines", "vs_best_baseline",
"best_baseline", "ratio_range", "placements": [{"placement", "name", "samples_per_s" (median over
the rounds; null if only screened), "samples_per_s_per_repeat", "screen_samples_per_s",
"finalist"}, ...], "skipped": [{"name", "placement", "reason"}, ...], "screen_runs", "runs",
"wall_s"}, ...], "context_1proc_2threads": {"workload", "samples_per_s", "samples_per_s_per_repeat",
"auto_over_it", "auto_over_it_range"}, "goals", "calibration_cache", "steps", "warmup", "batch",
"micro_batches", "repeats", "finalists", "screen_steps", "context", "wall_s"}``.

``--rescore FILE`` recomputes each workload's regret from the JSON line of an earlier run (its
per-round figures), runs nothing, and prints the workloads' regrets as JSON.

    python benchmarks/pipeline.py [--steps 12] [--warmup 3] [--repeats 3] [--finalists 3]
        [--workloads default,dit_heavy,vae_heavy,u2g] [--context roles] [--cache DIR]
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io
import itertools
import json
import os
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import yaml

from mmpipe.assemble.graphs import planning_graph
from mmpipe.assemble.placement import check_placement, make_plans
from mmpipe.assemble.planning import default_calibration_path, uncalibrated_stages
from mmpipe.config import DataConfig, LaunchConfig, ModelConfig, RunConfig, TrainConfig, compose_config, from_dict
from mmpipe.errors import RUN_FAILURES
from mmpipe.graph import Graph
from mmpipe.runtime.events import read_events
from mmpipe.sched.plan import DeviceGroup
from mmpipe.sched.results import parse_placement
from mmpipe.train import train
from mmpipe.train.prepare import resolve_auto

Placement = dict[str, Any]
BOTH = [0, 1]
# Where a unit of stages goes: one rank, or both (dp=2); the DiT may also gather once, keep whole
# parameters and all-reduce its gradients (DDP: "+ddp"), or split by Ulysses.
OPTIONS: dict[str, Any] = {
    "0": [0],
    "1": [1],
    "dp": {"ranks": BOTH, "dp": 2},
    "dp+once": {"ranks": BOTH, "dp": 2, "gather_once": True},
    "dp+ddp": {"ranks": BOTH, "dp": 2, "replicate": True},
    "ulysses2": {"ranks": BOTH, "ulysses": 2},
    "ulysses2+ddp": {"ranks": BOTH, "ulysses": 2, "replicate": True},
}
DIT_OPTIONS = ("0", "1", "dp", "dp+once", "dp+ddp", "ulysses2", "ulysses2+ddp")
UNIT_OPTIONS = ("0", "1", "dp")
TRAINED_UNIT_OPTIONS = (*UNIT_OPTIONS, "dp+ddp")  # a trained unit besides the DiT (u2g's LLM + connector)
MIRROR = {"0": "1", "1": "0"}
DATA_PARALLEL = ("dp", "dp+once", "dp+ddp")  # every unit data-parallel, the DiT with one of these


@dataclasses.dataclass(frozen=True)
class Workload:
    name: str
    what: str
    model: ModelConfig
    data: DataConfig


@dataclasses.dataclass(frozen=True)
class Candidate:
    name: str
    placement: Placement | str  # "auto": the planner's choice
    data_parallel: bool = False


@dataclasses.dataclass(frozen=True)
class Shape:
    steps: int
    warmup: int
    batch: int
    micro: int


def preset(overrides: Sequence[str]) -> tuple[ModelConfig, DataConfig]:
    """The model and data of ``mmpipe train`` composed with ``overrides`` (the presets in configs/)."""
    raw = compose_config("train", list(overrides))
    return from_dict(ModelConfig, raw["model"], "model."), from_dict(DataConfig, raw["data"], "data.")


def workloads() -> dict[str, Workload]:
    model, data = preset([])
    u2g_model, u2g_data = preset(["model=u2g_tiny"])
    layers, frames = 2 * model.dit_layers, 2 * (data.frames - 1) + 1
    return {
        "default": Workload("default", f"{model.name}, {data.frames}x{data.height}x{data.width} clips", model, data),
        "dit_heavy": Workload(
            "dit_heavy",
            f"{model.name} with model.dit_layers={layers} (twice {model.dit_layers})",
            dataclasses.replace(model, dit_layers=layers),
            data,
        ),
        "vae_heavy": Workload(
            "vae_heavy",
            f"{model.name}, larger clips: data.frames={frames} (twice the {data.frames - 1} frame steps)",
            model,
            dataclasses.replace(data, frames=frames),
        ),
        "u2g": Workload(
            "u2g", f"{u2g_model.name}, {u2g_data.frames}x{u2g_data.height}x{u2g_data.width}", u2g_model, u2g_data
        ),
    }


def run_config(
    run_dir: Path, wl: Workload, placement: Placement | str | None, shape: Shape, nproc: int, threads: int
) -> RunConfig:
    return RunConfig(
        run_dir=str(run_dir),
        model=wl.model,
        data=dataclasses.replace(wl.data, val_samples=shape.batch),
        train=TrainConfig(
            steps=shape.steps,
            batch_size=shape.batch,
            micro_batches=shape.micro,
            log_every=1,
            val_every=10_000,
            ckpt_every=10_000,
            progress=False,
            threads=threads,
        ),
        launch=LaunchConfig(nproc=nproc),
        placement=placement,
    )


# -- the placements -----------------------------------------------------------------------------


def units(graph: Graph, context: str) -> list[tuple[str, ...]]:
    """Stages placed together: the stages that make the DiT's context (``roles``: each run of them
    with one role, frozen or trained; ``tied``: all of them; ``separate``: each alone), the VAE, the DiT."""
    makers = [s for s in graph.topological_order() if s not in ("vae", "dit")]
    head: list[tuple[str, ...]]
    if context == "separate":
        head = [(s,) for s in makers]
    elif context == "tied":
        head = [tuple(makers)]
    else:
        head = [tuple(run) for _, run in itertools.groupby(makers, key=lambda s: graph.stages[s].frozen)]
    return [*head, ("vae",), ("dit",)]


def touches(code: str) -> set[int]:
    return {int(code)} if code in MIRROR else {0, 1}


def canonical(codes: tuple[str, ...]) -> bool:
    """The kept one of a mirror pair: the one whose last unit (the DiT first) off both ranks is on rank 1."""
    for code in reversed(codes):
        if code in MIRROR:
            return code == "1"
    return True


def enumerate_placements(graph: Graph, context: str) -> list[Candidate]:
    """Every assignment of the units to rank 0 / rank 1 / both that keeps both ranks busy, one per mirror pair."""
    us = units(graph, context)
    choices = [
        DIT_OPTIONS
        if u == ("dit",)
        else UNIT_OPTIONS
        if all(graph.stages[s].frozen for s in u)
        else TRAINED_UNIT_OPTIONS
        for u in us
    ]
    out = []
    for codes in itertools.product(*choices):
        if set().union(*(touches(c) for c in codes)) != {0, 1} or not canonical(codes):
            continue
        placement = {s: OPTIONS[c] for u, c in zip(us, codes, strict=True) for s in u}
        name = " ".join(f"{'+'.join(u)}@{c}" for u, c in zip(us, codes, strict=True))
        # every unit on both ranks: the DiT as DATA_PARALLEL offers, the other trained units FSDP or,
        # with the DiT replicated, replicated too
        context_codes = set(codes[:-1])
        data_parallel = codes[-1] in DATA_PARALLEL and (
            context_codes == {"dp"} or (context_codes == {"dp", "dp+ddp"} and codes[-1] == "dp+ddp")
        )
        out.append(Candidate(name, placement, data_parallel))
    return out


def rejection(graph: Graph, cfg: RunConfig) -> str | None:
    """The error ``mmpipe train``'s config check raises for ``cfg`` before any worker starts, if any."""
    try:
        check_placement(cfg)
        make_plans(graph, cfg)
    except ValueError as err:  # PlanError included
        return f"{type(err).__name__}: {str(err).splitlines()[0]}"
    return None


def same_placement(a: Placement, b: Placement) -> bool:
    return parse_placement(a) == parse_placement(b)


def mirrored(placement: Placement) -> Placement:
    """``placement`` with ranks 0 and 1 swapped."""
    out: Placement = {}
    for stage, g in placement.items():
        ranks = sorted(1 - r for r in (g["ranks"] if isinstance(g, dict) else g))
        out[stage] = {**g, "ranks": ranks} if isinstance(g, dict) else ranks
    return out


def name_of(placement: Placement, candidates: list[Candidate]) -> str | None:
    """The enumerated placement ``placement`` is, or is the mirror image of."""
    for c in candidates:
        assert isinstance(c.placement, dict)
        if same_placement(c.placement, placement):
            return c.name
        if same_placement(mirrored(c.placement), placement):
            return f"{c.name} (mirrored)"
    return None


def compact(placement: Placement) -> Placement:
    """The config form without the fields at their defaults."""
    defaults = {f.name: f.default for f in dataclasses.fields(DeviceGroup) if f.name not in ("ranks", "dp")}
    out: Placement = {}
    for stage, g in placement.items():
        if not isinstance(g, dict):
            out[stage] = g
            continue
        keep = {k: v for k, v in g.items() if k != "ranks" and defaults.get(k, object()) != v}
        if keep.get("dp") == len(g["ranks"]) // (g.get("ulysses", 1) * g.get("ring", 1)):
            keep.pop("dp")  # what the ranks and the sequence parallelism imply
        out[stage] = {"ranks": g["ranks"], **keep} if keep else g["ranks"]
    return out


# -- measuring ---------------------------------------------------------------------------------


def samples_per_s(run_dir: Path, shape: Shape) -> float:
    events = [e for e in read_events(run_dir) if e["phase"] == "train" and e["step"] > shape.warmup]
    start, end = min(e["start"] for e in events), max(e["end"] for e in events)
    return (shape.steps - shape.warmup) * shape.batch / (end - start)


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    """Hide what a run prints on stdout (the plan table, the workers' graph summaries: file descriptor 1
    goes to /dev/null); pass ``placement=auto``'s calibration line through."""
    buf = io.StringIO()
    sys.stdout.flush()
    saved = os.dup(1)
    with open(os.devnull, "w") as null:
        os.dup2(null.fileno(), 1)
    try:
        with contextlib.redirect_stdout(buf):
            yield
    finally:
        os.dup2(saved, 1)
        os.close(saved)
        for line in buf.getvalue().splitlines():
            if line.startswith("placement=auto"):
                print(line, flush=True)


def measure(
    run_dir: Path, wl: Workload, placement: Placement | str | None, shape: Shape, nproc: int = 2, threads: int = 1
) -> tuple[float, Placement | None]:
    """Samples/s of one run, and the placement it ran (``placement=auto`` resolved, from its config.yaml)."""
    with quiet():
        train(run_config(run_dir, wl, placement, shape, nproc, threads))
    ran = yaml.safe_load((run_dir / "config.yaml").read_text())["placement"]
    return samples_per_s(run_dir, shape), ran


def median_range(xs: Sequence[float]) -> tuple[float, list[float]]:
    return round(statistics.median(xs), 3), [round(min(xs), 3), round(max(xs), 3)]


@dataclasses.dataclass
class Trial:
    """One workload's candidates, what was skipped, and the measurements."""

    workload: Workload
    graph: Graph
    candidates: list[Candidate]
    skipped: list[dict[str, Any]]
    screen: dict[str, float] = dataclasses.field(default_factory=dict)
    runs: dict[str, list[float]] = dataclasses.field(default_factory=dict)  # name -> samples/s per round
    planned: Placement = dataclasses.field(default_factory=dict)  # auto's placement, resolved before the rounds
    auto: list[Placement] = dataclasses.field(default_factory=list)  # what each round's auto run resolved
    context: list[float] = dataclasses.field(default_factory=list)  # 1 process x 2 threads per round

    def run_or_skip(self, cand: Candidate, run_dir: Path, shape: Shape) -> float | None:
        """A baseline's samples/s; a run-time failure moves it to ``skipped``."""
        try:
            return measure(run_dir, self.workload, cand.placement, shape)[0]
        except RUN_FAILURES as err:
            self.skipped.append(
                {
                    "name": cand.name,
                    "placement": cand.placement,
                    "reason": f"failed at run time: {str(err).splitlines()[0]}",
                }
            )
            self.candidates.remove(cand)
            print(f"  {cand.name}: failed at run time, skipped: {str(err).splitlines()[0]}", flush=True)
            return None


def prepare_trial(wl: Workload, context: str, shape: Shape) -> Trial:
    """The workload's enumerated placements, less those the config check rejects (listed as skipped)."""
    graph, _ = planning_graph(wl.model, wl.data)
    candidates, skipped = [], []
    for cand in enumerate_placements(graph, context):
        reason = rejection(graph, run_config(Path("unused"), wl, cand.placement, shape, 2, 1))
        if reason:
            skipped.append({"name": cand.name, "placement": cand.placement, "reason": reason})
        else:
            candidates.append(cand)
    return Trial(wl, graph, candidates, skipped)


def screen(trial: Trial, tmp: Path, shape: Shape) -> None:
    """One short run of every baseline, in a shuffled order (a machine's slow spell hits no one family)."""
    order = list(trial.candidates)
    random.Random(0).shuffle(order)
    for i, cand in enumerate(order):
        sps = trial.run_or_skip(cand, tmp / f"screen{i}", shape)
        if sps is not None:
            trial.screen[cand.name] = sps
            print(f"  screen {cand.name}: {sps:.2f} samples/s", flush=True)


def finalists(trial: Trial, k: int) -> list[Candidate]:
    """The data-parallel baselines, the one auto plans (if enumerated) and the ``k`` fastest screened
    ones; every baseline for ``k`` = 0."""
    if k <= 0 or not trial.screen:  # no screening: every baseline
        return list(trial.candidates)
    fastest = sorted(trial.screen, key=lambda n: -trial.screen[n])[:k]
    planned = (name_of(trial.planned, trial.candidates) or "").removesuffix(" (mirrored)")
    return [c for c in trial.candidates if c.data_parallel or c.name in fastest or c.name == planned]


def rounds(trial: Trial, finals: list[Candidate], tmp: Path, shape: Shape, repeats: int, context: bool) -> None:
    """``repeats`` alternating rounds of auto and every finalist (order rotated per round)."""
    for r in range(repeats):
        order: list[Candidate] = [Candidate("auto", "auto"), *finals]
        order = order[r % len(order) :] + order[: r % len(order)]
        for i, cand in enumerate(order):
            run_dir = tmp / f"r{r}-{i}"
            if cand.name == "auto":
                sps, ran = measure(run_dir, trial.workload, "auto", shape)
                assert ran is not None
                trial.auto.append(ran)
            elif cand in trial.candidates:
                got = trial.run_or_skip(cand, run_dir, shape)
                if got is None:
                    continue
                sps = got
            else:
                continue
            trial.runs.setdefault(cand.name, []).append(sps)
            print(f"  round {r + 1} {cand.name}: {sps:.2f} samples/s", flush=True)
        if context:
            trial.context.append(measure(tmp / f"r{r}-1proc", trial.workload, None, shape, nproc=1, threads=2)[0])
            print(f"  round {r + 1} 1 process x 2 threads (context): {trial.context[-1]:.2f} samples/s", flush=True)


# -- the figures -------------------------------------------------------------------------------


def per_round(auto: list[float], others: list[list[float]]) -> list[float]:
    """auto / the best of ``others`` in each round."""
    return [a / max(o[i] for o in others) for i, a in enumerate(auto)]


def regret_per_round(auto: list[float], finals: dict[str, list[float]], itself: Sequence[str]) -> list[float]:
    """Per round: auto's placement over the best *other* finalist. A finalist named in ``itself`` is
    the very placement auto chose (the finalists include it on purpose): its runs and auto's are two
    measurements of one arm, so they are averaged, not raced. Racing a placement against a second
    run of itself puts the larger of two noisy draws in the denominator, which biases the ratio
    below 1 even when auto chose the best placement. With no other finalist, every round is 1."""
    same = [finals[n] for n in itself if n in finals]
    others = [runs for n, runs in finals.items() if n not in itself]
    pooled = [statistics.fmean([a, *(s[i] for s in same)]) for i, a in enumerate(auto)]
    return per_round(pooled, others) if others else [1.0] * len(auto)


def summary(trial: Trial, names: list[str]) -> dict[str, Any]:
    """The workload's JSON entry (medians of per-round ratios, with their ranges)."""
    auto = trial.runs["auto"]
    measured = {n: trial.runs[n] for n in names if len(trial.runs.get(n, [])) == len(auto)}
    best = max(measured, key=lambda n: statistics.median(measured[n]))
    dp = [n for n in measured if any(c.name == n and c.data_parallel for c in trial.candidates)]
    resolved = trial.auto[0]
    itself = [
        n for n in measured if any(c.name == n and same_placement(c.placement, resolved) for c in trial.candidates)
    ]
    regret, regret_range = median_range(regret_per_round(auto, measured, itself))
    unpooled, unpooled_range = median_range(per_round(auto, list(measured.values())))
    vs_best, best_range = median_range(per_round(auto, [measured[best]]))
    vs_dp = dp_range = vs_dp_unpooled = None
    if dp:  # auto's placement among them (auto chose data parallelism) is pooled with auto, as for the regret
        vs_dp, dp_range = median_range(regret_per_round(auto, {n: measured[n] for n in dp}, itself))
        vs_dp_unpooled = median_range(per_round(auto, [measured[n] for n in dp]))[0]
    return {
        "name": trial.workload.name,
        "what": trial.workload.what,
        "auto_placement": compact(resolved),
        "auto_name": name_of(resolved, trial.candidates),
        "auto_stable": all(same_placement(p, resolved) for p in [*trial.auto, trial.planned]),
        "regret": regret,
        "regret_range": regret_range,
        "regret_pooled_with": itself,
        "regret_unpooled": unpooled,
        "regret_unpooled_range": unpooled_range,
        "vs_data_parallel": vs_dp,
        "vs_data_parallel_range": dp_range,
        "vs_data_parallel_unpooled": vs_dp_unpooled,
        "data_parallel_baselines": dp,
        "vs_best_baseline": vs_best,
        "best_baseline": best,
        "ratio_range": best_range,
        "placements": placement_rows(trial, auto),
        "skipped": trial.skipped,
    }


def row(name: str, placement: Placement | str, runs: list[float], screened: float | None) -> dict[str, Any]:
    return {
        "placement": placement,
        "name": name,
        "samples_per_s": round(statistics.median(runs), 3) if runs else None,
        "samples_per_s_per_repeat": [round(x, 3) for x in runs],
        "screen_samples_per_s": None if screened is None else round(screened, 3),
        "finalist": bool(runs),
    }


def placement_rows(trial: Trial, auto: list[float]) -> list[dict[str, Any]]:
    rows = [row("auto", "auto", auto, None)]
    for c in trial.candidates:
        assert isinstance(c.placement, dict)
        rows.append(row(c.name, compact(c.placement), trial.runs.get(c.name, []), trial.screen.get(c.name)))
    return rows


def context_entry(trial: Trial) -> dict[str, Any]:
    auto, ctx = trial.runs["auto"], trial.context
    ratio, ratio_range = median_range([a / c for a, c in zip(auto, ctx, strict=True)])
    return {
        "workload": trial.workload.name,
        "samples_per_s": round(statistics.median(ctx), 3),
        "samples_per_s_per_repeat": [round(x, 3) for x in ctx],
        "auto_over_it": ratio,
        "auto_over_it_range": ratio_range,
    }


def goals(entries: list[dict[str, Any]]) -> dict[str, bool]:
    return {
        "regret_at_least_0.95_everywhere": all(e["regret"] >= 0.95 for e in entries),
        "auto_never_below_data_parallel": all(
            e["vs_data_parallel"] is None or e["vs_data_parallel"] >= 1.0 for e in entries
        ),
    }


def print_workload(e: dict[str, Any]) -> None:
    print(f"{e['name']} ({e['what']}): auto -> {e['auto_name'] or json.dumps(e['auto_placement'])}")
    print(
        f"  regret {e['regret']} {e['regret_range']}; vs data-parallel {e['vs_data_parallel']} {e['vs_data_parallel_range']}"
    )
    print(f"  vs best baseline {e['best_baseline']!r}: {e['vs_best_baseline']} {e['ratio_range']}")
    for r in sorted(e["placements"], key=lambda r: -(r["samples_per_s"] or 0)):
        if r["finalist"]:
            print(f"    {r['name']:<48} {r['samples_per_s']:7.2f} samples/s, per round {r['samples_per_s_per_repeat']}")
    for s in e["skipped"]:
        print(f"    skipped {s['name']}: {s['reason']}")


# -- main --------------------------------------------------------------------------------------


def run_workload(
    wl: Workload, args: argparse.Namespace, tmp: Path, context: bool
) -> tuple[dict[str, Any], dict[str, Any] | None]:
    t0 = time.perf_counter()
    shape = Shape(args.steps, args.warmup, args.batch, args.micro)
    trial = prepare_trial(wl, args.context, shape)
    calibrate = bool(uncalibrated_stages(trial.graph, default_calibration_path()))
    print(
        f"{wl.name}: {len(trial.candidates)} placements, {len(trial.skipped)} rejected by the config check", flush=True
    )
    auto_cfg = run_config(tmp / "plan", wl, "auto", shape, 2, 1)
    planned = resolve_auto(trial.graph, auto_cfg).placement  # as train resolves it (calibrating first)
    assert isinstance(planned, dict)
    trial.planned = planned
    if 0 < args.finalists < len(trial.candidates):
        screen(trial, tmp / "screen", Shape(args.screen_steps, args.warmup, args.batch, args.micro))
    finals = finalists(trial, args.finalists)
    rounds(trial, finals, tmp, shape, args.repeats, context)
    runs = {"screen_runs": len(trial.screen), "runs": sum(map(len, trial.runs.values())) + len(trial.context)}
    wall = {"wall_s": round(time.perf_counter() - t0, 1)}
    entry = summary(trial, [c.name for c in finals]) | {"calibrated_first": calibrate} | runs | wall
    print_workload(entry)
    return entry, context_entry(trial) if context else None


def parse_args(names: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--micro", type=int, default=4)
    p.add_argument("--repeats", type=int, default=3, help="alternating rounds of auto and every finalist")
    p.add_argument(
        "--finalists",
        type=int,
        default=3,
        help="fastest screened baselines measured in every round (0: all, no screening)",
    )
    p.add_argument(
        "--screen-steps", type=int, default=0, help="steps of a screening run (0: max(--warmup + 2, --steps // 2))"
    )
    p.add_argument("--workloads", default=",".join(names), help=f"comma-separated subset of {','.join(names)}")
    p.add_argument(
        "--context",
        choices=("roles", "tied", "separate"),
        default="roles",
        help="units of the DiT's context makers: runs of one role (frozen / trained), all as one, or each alone",
    )
    p.add_argument(
        "--cache",
        default=None,
        help="MMPIPE_CACHE for the runs (default: a fresh folder, so auto calibrates this machine first)",
    )
    p.add_argument(
        "--rescore",
        type=Path,
        default=None,
        metavar="FILE",
        help="recompute the regrets from an earlier run's output (its JSON line); runs nothing",
    )
    args = p.parse_args()
    unknown = sorted(set(args.workloads.split(",")) - set(names))
    if unknown:
        p.error(f"unknown workloads {unknown}; choose from {list(names)}")
    args.screen_steps = args.screen_steps or max(args.warmup + 2, args.steps // 2)
    if args.steps <= args.warmup or args.screen_steps <= args.warmup + 1 or args.repeats < 1:
        p.error("need --steps > --warmup, --screen-steps > --warmup + 1 and --repeats >= 1")
    return args


def rescore(path: Path) -> dict[str, Any]:
    """The regrets of an earlier run's JSON line (the last line of ``path`` that starts with
    ``{"workloads"``), recomputed from its per-round figures by :func:`regret_per_round`."""
    if not path.is_file():
        raise SystemExit(f"--rescore {path}: no such file")
    lines = [ln for ln in path.read_text().splitlines() if ln.startswith('{"workloads"')]
    if not lines:
        raise SystemExit(f"--rescore: no JSON line of benchmarks/pipeline.py in {path}")
    out = []
    for e in json.loads(lines[-1])["workloads"]:
        rows = {r["name"]: r["samples_per_s_per_repeat"] for r in e["placements"] if r["finalist"]}
        auto = rows.pop("auto")
        finals = {n: runs for n, runs in rows.items() if len(runs) == len(auto)}
        itself = [n for n in finals if n == e["auto_name"]]
        regret, regret_range = median_range(regret_per_round(auto, finals, itself))
        unpooled, unpooled_range = median_range(per_round(auto, list(finals.values())))
        dp = {n: finals[n] for n in e.get("data_parallel_baselines", []) if n in finals}
        vs_dp, dp_range = median_range(regret_per_round(auto, dp, itself)) if dp else (None, None)
        out.append(
            {
                "name": e["name"],
                "auto_name": e["auto_name"],
                "regret": regret,
                "regret_range": regret_range,
                "regret_pooled_with": itself,
                "regret_unpooled": unpooled,
                "regret_unpooled_range": unpooled_range,
                "vs_data_parallel": vs_dp,
                "vs_data_parallel_range": dp_range,
            }
        )
    return {"rescored": str(path), "workloads": out, "goals": goals(out)}


def main() -> None:
    all_workloads = workloads()
    args = parse_args(list(all_workloads))
    if args.rescore is not None:
        print(json.dumps(rescore(args.rescore)))
        return
    t0 = time.perf_counter()
    entries, context = [], None
    with tempfile.TemporaryDirectory(prefix="mmpipe-pipeline-bench-") as tmp:
        os.environ["MMPIPE_CACHE"] = args.cache or str(Path(tmp) / "cache")
        for name in args.workloads.split(","):
            entry, ctx = run_workload(all_workloads[name], args, Path(tmp) / name, context=name == "default")
            entries.append(entry)
            context = context or ctx
    met = goals(entries)
    for goal, ok in met.items():
        print(f"goal {goal}: {'met' if ok else 'missed'}")
    result = {
        "workloads": entries,
        "context_1proc_2threads": context,
        "goals": met,
        "calibration_cache": args.cache or "fresh",
        "steps": args.steps,
        "warmup": args.warmup,
        "batch": args.batch,
        "micro_batches": args.micro,
        "repeats": args.repeats,
        "finalists": args.finalists,
        "screen_steps": args.screen_steps,
        "context": args.context,
        "wall_s": round(time.perf_counter() - t0, 1),
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
