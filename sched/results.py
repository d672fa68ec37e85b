"""What the planner returns: candidates, their evaluated figures, the report with its baselines, and
the placement's config form (:func:`parse_placement` reads it, :func:`placement_config` writes it;
``parse_placement(placement_config(p)) == p``)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from mmpipe.errors import PlanError
from mmpipe.sched.analytic import StageConfig
from mmpipe.sched.plan import GROUP_OPTIONS, DeviceGroup, Plan, format_ranks
from mmpipe.sched.schedule import GraphInfo, ScheduleKind, build_plan


@dataclasses.dataclass(frozen=True)
class Candidate:
    """A complete plan choice: per-stage configurations, rank ranges, micro-batching."""

    name: str
    layout: str  # "disaggregated" | "colocated" | "bundled"
    configs: Mapping[str, StageConfig]
    ranks: Mapping[str, tuple[int, ...]]  # each stage's group, replicas of consecutive ranks
    micro_batch: int  # samples per micro-batch
    micro_batches: int
    world_size: int
    estimate: float  # analytic step time (s)

    @property
    def global_batch(self) -> int:
        return self.micro_batch * self.micro_batches

    def placement(self) -> dict[str, DeviceGroup]:
        return {
            s: DeviceGroup(
                self.ranks[s], c.dp, c.ulysses, c.ring, c.recompute, c.offload, c.gather_once, replicate=c.replicate
            )
            for s, c in self.configs.items()
        }

    @property
    def ranks_used(self) -> int:
        return len({r for g in self.ranks.values() for r in g})


@dataclasses.dataclass(frozen=True)
class PlanResult:
    """A candidate with its simulated figures."""

    candidate: Candidate
    step_time: float  # seconds per optimizer step (simulated when ``simulated``)
    simulated: bool
    samples_per_s: float
    tokens_per_s: float
    mfu: float  # model FLOPs (forward, plus backward on backward paths) / (step time x world size x peak)
    bubble: float  # mean over used ranks of 1 - compute / wall
    stage_bubble: Mapping[str, float]
    peak_memory: Mapping[str, float]  # per stage group: bytes per rank (colocated: all stages' sum)
    fits_memory: bool

    def to_json(self) -> dict[str, Any]:
        cand = self.candidate
        return {
            "name": cand.name,
            "layout": cand.layout,
            "world_size": cand.world_size,
            "ranks_used": cand.ranks_used,
            "micro_batch": cand.micro_batch,
            "micro_batches": cand.micro_batches,
            "step_time_s": self.step_time,
            "simulated": self.simulated,
            "samples_per_s": self.samples_per_s,
            "tokens_per_s": self.tokens_per_s,
            "mfu": self.mfu,
            "bubble": self.bubble,
            "fits_memory": self.fits_memory,
            "stages": {
                s: {
                    "ranks": format_ranks(cand.ranks[s], max_runs=3),
                    "dp": c.dp,
                    "ulysses": c.ulysses,
                    "ring": c.ring,
                    "recompute": c.recompute,
                    "offload": c.offload,
                    "gather_once": c.gather_once,
                    "replicate": c.replicate,
                    "samples_per_replica": c.samples,
                    "forward_s": c.forward_s,
                    "backward_s": c.backward_s,
                    "peak_memory_gb": self.peak_memory[s] / 1e9,
                    "bubble": self.stage_bubble.get(s, 0.0),
                }
                for s, c in cand.configs.items()
            },
        }


@dataclasses.dataclass(frozen=True)
class PlanReport:
    """What ``plan`` returns: the chosen plan, the baselines and the bounds.

    ``colocated``: the baseline ``vs_colocated`` is against, every stage colocated on all ranks (FSDP x
    Ulysses x ring, gathered-once parameters, every memory policy), searched and simulated as the
    plan is, without frozen replicas taking turns; ``sequential`` (colocated-sequential, data
    parallelism only) and ``uniform`` (uniform split) are context. ``lower_bound_samples_per_s``:
    every rank running model FLOPs at the device's peak, so the plan's fraction of it is its MFU
    (model FLOPs / (step time x ranks x peak)); ``efficiency_bound_samples_per_s``: the same at the
    cost model's efficiency (0.45 uncalibrated), the most any layout reaches in the model."""

    workload: str
    cluster: str
    world_size: int
    global_batch: int
    best: PlanResult
    colocated: PlanResult | None
    sequential: PlanResult | None
    uniform: PlanResult | None
    lower_bound_samples_per_s: float
    efficiency_bound_samples_per_s: float
    plan_seconds: float

    def vs(self, other: PlanResult | None) -> float | None:
        """The plan's samples/s over ``other``'s; None when ``other`` is missing or does not fit."""
        if other is None or not other.fits_memory or other.samples_per_s <= 0:
            return None
        return self.best.samples_per_s / other.samples_per_s

    @property
    def vs_lower_bound(self) -> float:
        """The plan's fraction of the peak-FLOP/s bound (equal to its MFU)."""
        return self.best.samples_per_s / self.lower_bound_samples_per_s

    @property
    def vs_efficiency_bound(self) -> float:
        """The plan's fraction of the bound at the cost model's efficiency."""
        return self.best.samples_per_s / self.efficiency_bound_samples_per_s

    def to_json(self) -> dict[str, Any]:
        return {
            "workload": self.workload,
            "cluster": self.cluster,
            "gpus": self.world_size,
            "global_batch": self.global_batch,
            "plan": self.best.to_json(),
            "colocated": self.colocated.to_json() if self.colocated else None,
            "colocated_sequential": self.sequential.to_json() if self.sequential else None,
            "uniform_split": self.uniform.to_json() if self.uniform else None,
            "lower_bound_samples_per_s": self.lower_bound_samples_per_s,
            "efficiency_bound_samples_per_s": self.efficiency_bound_samples_per_s,
            "vs_colocated": self.vs(self.colocated),
            "vs_colocated_sequential": self.vs(self.sequential),
            "vs_uniform": self.vs(self.uniform),
            "vs_lower_bound": self.vs_lower_bound,
            "vs_efficiency_bound": self.vs_efficiency_bound,
            "mfu": self.best.mfu,
            "fits_memory": self.best.fits_memory,
            "plan_seconds": self.plan_seconds,
        }

    def plan(self, graph: GraphInfo, *, schedule: ScheduleKind = ScheduleKind.ONE_F_ONE_B) -> Plan:
        """The chosen plan as the runtime's per-rank action lists."""
        cand = self.best.candidate
        return build_plan(
            graph,
            cand.placement(),
            cand.micro_batches,
            world_size=cand.world_size,
            schedule=schedule,
            batch=cand.micro_batch,
        )

    def format(self) -> str:
        """The human-readable report ``mmpipe plan`` prints."""
        gb = 1e9
        best = self.best
        cand = best.candidate
        lines = [
            f"plan for {self.workload} on {self.cluster} ({self.world_size} devices), "
            f"global batch {self.global_batch} = {cand.micro_batches} micro-batches x {cand.micro_batch}",
            f"layout: {cand.layout}; ranks used: {cand.ranks_used}/{cand.world_size}",
            "",
            f"{'stage':<10} {'ranks':>13} {'dp':>5} {'uly':>4} {'ring':>4} {'recomp':>6} {'offl':>5} "
            f"{'gather':>6} {'fwd s/mb':>9} {'bwd s/mb':>9} {'mem GB':>7} {'bubble':>6}",
        ]
        for s, c in cand.configs.items():
            # FSDP parameter all-gathers: once a step, every micro-batch, none (whole parameters: "ddp"
            # for a replicated trainable stage, which all-reduces its gradients instead)
            gather = "step" if c.gather_once else "ddp" if c.replicate else "mb" if c.sync_s else "-"
            lines.append(
                f"{s:<10} {format_ranks(cand.ranks[s], max_runs=3):>13} {c.dp:>5} {c.ulysses:>4} {c.ring:>4} "
                f"{c.recompute:>6.2f} {c.offload:>5.2f} {gather:>6} {c.forward_s:>9.3f} {c.backward_s:>9.3f} "
                f"{best.peak_memory[s] / gb:>7.1f} {best.stage_bubble.get(s, 0.0):>6.1%}"
            )
        lines.append("")
        lines.append("per-rank schedule: " + _schedule_summary(cand))
        lines.append("")
        width = max([22] + [len(r.candidate.name) for r in (self.colocated,) if r is not None])
        lines.append(
            f"{'':<{width}} {'samples/s':>10} {'tokens/s':>12} {'step s':>9} {'MFU':>6} {'bubble':>7} {'fits':>5}"
        )
        rows = (
            ("mmpipe plan", best),
            (self.colocated.candidate.name if self.colocated else "colocated (FSDP + SP)", self.colocated),
            ("colocated-sequential", self.sequential),
            ("uniform split", self.uniform),
        )
        for label, r in rows:
            if r is None:
                lines.append(f"{label:<{width}} {'(no feasible configuration)':>40}")
                continue
            lines.append(
                f"{label:<{width}} {r.samples_per_s:>10.3f} {r.tokens_per_s:>12.4g} {r.step_time:>9.2f} "
                f"{r.mfu:>6.1%} {r.bubble:>7.1%} {'yes' if r.fits_memory else 'NO':>5}"
            )
        lines.append(f"{'lower bound (peak)':<{width}} {self.lower_bound_samples_per_s:>10.3f}")
        lines.append(f"{'efficiency bound':<{width}} {self.efficiency_bound_samples_per_s:>10.3f}")
        if not best.simulated:
            lines.append("(step time from the analytic model: the reduced plan is too large to simulate)")
        if self.colocated is not None:
            lines.append(f"baseline layout: {describe(self.colocated.candidate)}")
        lines.append("")
        lines.append(
            f"plan vs colocated (FSDP + SP): {_ratio(self.vs(self.colocated))}; "
            f"vs colocated-sequential: {_ratio(self.vs(self.sequential))}; "
            f"MFU (= vs lower bound): {self.vs_lower_bound:.1%}; "
            f"vs efficiency bound: x{self.vs_efficiency_bound:.2f}; planned in {self.plan_seconds:.2f} s"
        )
        return "\n".join(lines)


def _ratio(x: float | None) -> str:
    return f"x{x:.2f}" if x else "n/a"


def describe(cand: Candidate) -> str:
    """One line of ``cand``'s layout: micro-batching, and each stage's ranks, split and memory policy."""
    parts = []
    for s, c in cand.configs.items():
        split = (
            f"dp={c.dp}"
            + (f" ulysses={c.ulysses}" if c.ulysses > 1 else "")
            + (f" ring={c.ring}" if c.ring > 1 else "")
        )
        if c.dp > cand.micro_batch:
            split += " (turns)"
        policy = (f" recompute={c.recompute:.2f}" if c.recompute else "") + (
            f" offload={c.offload:.2f}" if c.offload else ""
        )
        where = "" if cand.layout == "colocated" else f"ranks {format_ranks(cand.ranks[s], max_runs=2)} "
        mode = " gather-once" if c.gather_once else " replicated" if c.replicate else ""
        parts.append(f"{s} {where}{split}{policy}{mode}")
    return f"{cand.layout}, {cand.micro_batches} x {cand.micro_batch} samples: " + "; ".join(parts)


def _schedule_summary(cand: Candidate) -> str:
    m = cand.micro_batches
    if cand.layout == "colocated":
        ahead = [s for s in cand.configs if cand.configs[s].backward_s == 0.0]
        trained = [s for s in cand.configs if s not in ahead] or list(cand.configs)
        if not ahead or ahead == trained:
            return f"every rank runs {' -> '.join(trained)} per micro-batch ({m} per step), then STEP"
        described = []
        for s in ahead:
            c = cand.configs[s]
            turns = c.dp > cand.micro_batch  # replicas take turns: each runs a share of the step's samples
            described.append(f"{s} ({cand.global_batch // c.dp} sample(s) per replica)" if turns else s)
        return (
            f"every rank first runs {', '.join(described)} for all {m} micro-batches, then "
            f"{' -> '.join(trained)} per micro-batch, then STEP"
        )
    groups: dict[tuple[int, ...], list[str]] = {}
    for s in cand.configs:
        groups.setdefault(cand.ranks[s], []).append(s)
    parts = []
    for ranks, members in groups.items():
        work = " + ".join(
            f"{s} {'F+B' if cand.configs[s].backward_s else 'F'} ({cand.configs[s].time:.3g} s)" for s in members
        )
        parts.append(f"ranks {format_ranks(ranks, max_runs=3)}: {m} x [{work}]")
    return "; ".join(parts) + "; 1F1B across trainable groups, frozen groups run ahead"


def summarize(reports: Sequence[PlanReport]) -> list[dict[str, Any]]:
    """The benchmark's per-(workload, cluster) entries: ratios against the colocated (FSDP + SP)
    baseline and the peak-FLOP/s lower bound (equal to the MFU), the context baselines' ratios, and
    one-line layouts of the plan and the baseline."""
    out = []
    for r in reports:
        base = r.colocated
        out.append(
            {
                "workload": r.workload,
                "cluster": r.cluster,
                "gpus": r.world_size,
                "vs_colocated": r.vs(base),
                "vs_colocated_sequential": r.vs(r.sequential),
                "vs_uniform": r.vs(r.uniform),
                "vs_lower_bound": r.vs_lower_bound,
                "vs_efficiency_bound": r.vs_efficiency_bound,
                "mfu": r.best.mfu,
                "plan_seconds": r.plan_seconds,
                "fits_memory": r.best.fits_memory,
                "samples_per_s": r.best.samples_per_s,
                "layout": r.best.candidate.layout,
                "plan": describe(r.best.candidate),
                "baseline": None
                if base is None
                else {
                    "name": base.candidate.name,
                    "layout": describe(base.candidate),
                    "samples_per_s": base.samples_per_s,
                    "mfu": base.mfu,
                    "fits_memory": base.fits_memory,
                },
            }
        )
    return out


def placement_config(placement: Mapping[str, DeviceGroup]) -> dict[str, dict[str, Any]]:
    """``{stage: DeviceGroup}`` -> its config form, every field spelled out; the inverse of
    :func:`parse_placement` (``parse_placement(placement_config(p)) == p``)."""
    return {
        stage: {
            "ranks": list(g.ranks),
            "dp": g.dp,
            "ulysses": g.ulysses,
            "ring": g.ring,
            "recompute": g.recompute,
            "offload": g.offload,
            "gather_once": g.gather_once,
            "blocks": g.blocks,
            "replicate": g.replicate,
        }
        for stage, g in placement.items()
    }


def parse_placement(raw: Mapping[str, Sequence[int] | Mapping[str, object]]) -> dict[str, DeviceGroup]:
    """``{text: [0], dit: {ranks: [1, 2], dp: 2}}`` -> ``{stage: DeviceGroup}`` (config form)."""
    out = {}
    for stage, spec in raw.items():
        blocks, replicate = "", False
        if isinstance(spec, Mapping):
            allowed = {"ranks", *GROUP_OPTIONS}
            unknown = set(spec) - allowed
            if unknown:
                raise PlanError(f"placement.{stage}: unknown keys {sorted(unknown)} (allowed: {sorted(allowed)})")
            ranks = spec.get("ranks")
            extra: dict[str, float] = {}
            for k in ("ulysses", "ring", "recompute", "offload"):
                v = spec.get(k)
                if v is None:
                    continue
                if not isinstance(v, int | float) or isinstance(v, bool):
                    raise PlanError(f"placement.{stage}.{k} must be a number, got {v!r}")
                if k in ("ulysses", "ring") and not isinstance(v, int):
                    raise PlanError(f"placement.{stage}.{k} must be an int, got {v!r}")
                extra[k] = float(v)
            sp = int(extra.get("ulysses", 1)) * int(extra.get("ring", 1))
            dp = spec.get("dp", len(ranks) // max(sp, 1) if isinstance(ranks, Sequence) else 1)
            gather_once = spec.get("gather_once", False)
            if not isinstance(gather_once, bool):
                raise PlanError(f"placement.{stage}.gather_once must be true or false, got {gather_once!r}")
            raw_replicate = spec.get("replicate", False)
            if not isinstance(raw_replicate, bool):
                raise PlanError(f"placement.{stage}.replicate must be true or false, got {raw_replicate!r}")
            replicate = raw_replicate
            if replicate and gather_once:
                raise PlanError(
                    f"placement.{stage}: replicate=true keeps whole parameters on every rank; gather_once=true "
                    "is for sharded (FSDP) ones: set one of them"
                )
            raw_blocks = spec.get("blocks") or ""
            if not isinstance(raw_blocks, str):
                raise PlanError(f"placement.{stage}.blocks must be a string of k, o, r and s, got {raw_blocks!r}")
            blocks = raw_blocks
        else:
            ranks, dp, extra, gather_once = spec, len(spec), {}, False
        if not isinstance(ranks, Sequence) or not all(isinstance(r, int) for r in ranks):
            raise PlanError(f"placement.{stage}: ranks must be a list of ints, got {ranks!r}")
        if not isinstance(dp, int):
            raise PlanError(f"placement.{stage}: dp must be an int, got {dp!r}")
        out[stage] = DeviceGroup(
            tuple(ranks),
            dp,
            ulysses=int(extra.get("ulysses", 1)),
            ring=int(extra.get("ring", 1)),
            recompute=extra.get("recompute", 0.0),
            offload=extra.get("offload", 0.0),
            gather_once=gather_once,
            blocks=blocks,
            replicate=replicate,
        )
    return out
