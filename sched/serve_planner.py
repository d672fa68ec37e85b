"""The serving planner: how a cluster serves text-to-video (or -image) requests of one size, and
what that buys.

For a request of ``steps`` denoising steps (two DiT forwards a step with classifier-free guidance
on, ``guidance > 1``) it chooses the ranks of each stage — text and decode: replicas of one rank;
the denoiser: ``dp`` replicas of ``cfg x ring x ulysses`` ranks — and ``max_batch``, the requests
batched in one DiT forward a step, for an objective: the most requests/s (``throughput``), the
lowest latency of a request (``latency``), or the most requests/s whose latency meets ``slo_s``.

Configurations are priced by the training planner's cost model (:class:`~mmpipe.sched.analytic.CostModel`,
with the ``mmpipe profile`` calibration of the device where there is one) on the stages' per-sample
costs measured on the meta device (:mod:`mmpipe.sched.cost`):

- a denoising step of a replica with ``b`` requests: ``CostModel.configure`` of the DiT on the
  ``b x branches / cfg`` samples a rank row runs, split ``ulysses x ring``: the FLOPs at the stage's
  efficiency over the sequence-parallel ranks, four all-to-alls (q, k, v, out) a block, the ring's
  K/V passes where the attention does not hide them, whole weights on every rank (no FSDP); plus
  one all-gather a step of the predictions over the replica (both CFG branches and every frame
  shard: each rank steps the scheduler on the whole latents, :mod:`mmpipe.parallel.denoise`);
- text and decode: ``configure`` of those stages on one rank, for the batch;
- transfers: the prompt embeddings to the replica and, when decode runs on a rank of its own, the
  latents to it (point to point at the link's bandwidth, or the calibrated transport).

``latency_s`` is a request's latency in a full batch of ``max_batch`` (no queueing): text + ``steps``
x step + decode + transfers. Requests/s: a *colocated* layout runs text and decode on each
replica's first rank between the replica's batches (``dp x b / latency``), the layout ``mmpipe
serve`` runs; a *disaggregated* one (searched with ``disaggregate=True``, for comparison: the
serving engine does not run it yet) gives text and decode ``aux`` ranks of their own, pipelined with
the replicas (the slower side decides). More ranks never predict a higher latency: a plan may leave
ranks idle (``nproc``).

Constraints (a candidate breaking one is not considered; :func:`check_layout` says why): ulysses
divides the DiT's attention heads; the ``ring x ulysses`` ranks of a branch split whole latent
frames, so at most one rank a frame; DiTs without sequence-parallel support (CogVideoX, LTX,
FLUX.1, Qwen-Image) get neither; ``cfg=2`` only with guidance on; each rank's weights and
activations fit its memory; a replica no wider than the innermost bandwidth level stays inside one
block of it.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Callable, Iterator, Mapping
from enum import StrEnum
from typing import Any

from mmpipe.graph import Capabilities
from mmpipe.sched.analytic import CostModel, Workload
from mmpipe.sched.calibration import Calibration
from mmpipe.sched.cluster import Cluster
from mmpipe.sched.cost import StageCost
from mmpipe.sched.plan import format_ranks

STAGES = ("text", "denoise", "decode")
MAX_BATCH = 8  # the largest max_batch searched by default
LATENT_BYTES = 4  # the denoising loop keeps its latents in float32, as the diffusers pipelines do
NOT_MODELLED = (
    "queueing and batch-formation delay (latency_s is a request's in a full batch)",
    "the scheduler step and guidance arithmetic per step",
    "a frame-parallel decode (decode runs on one rank)",
    "the VAE decode's activation memory (tiling) in the memory check",
    "attention kernels' lower efficiency on the shorter per-rank sequences of sequence parallelism",
    "collectives below the link's bandwidth: all-to-alls and gathers run at its full rate (not overlapped)",
    "ring attention's own cost beyond its K/V passes (hidden behind the attention, as in training)",
)


class Objective(StrEnum):
    """What the planner maximises (``slo_s`` restricts either to configurations that meet it)."""

    THROUGHPUT = "throughput"
    LATENCY = "latency"


@dataclasses.dataclass(frozen=True, kw_only=True)
class ServeCosts:
    """Per-sample costs of a request's stages, measured on the meta device."""

    name: str
    text: StageCost
    denoise: StageCost  # one DiT forward of one guidance branch
    decode: StageCost
    latent_elements: int  # one request's latents
    sequence_parallel: bool  # the DiT's stage takes ulysses / ring (``Capabilities.sequence_parallel``)

    @property
    def frames(self) -> int:
        """What sequence parallelism splits whole: the DiT's latent frames (its tokens if unknown)."""
        return self.denoise.split_units or self.denoise.tokens


def check_layout(costs: ServeCosts, *, cfg: int, ulysses: int, ring: int, guided: bool) -> None:
    """Raise ``ValueError`` saying why a denoise replica of ``cfg x ring x ulysses`` cannot run."""
    if cfg not in (1, 2):
        raise ValueError(f"cfg={cfg}: classifier-free guidance has two branches; cfg must be 1 or 2")
    if ulysses < 1 or ring < 1:
        raise ValueError(f"ulysses={ulysses}, ring={ring}: must be >= 1")
    if cfg == 2 and not guided:
        raise ValueError("cfg=2 runs the two guidance branches on different ranks, but guidance is off (<= 1)")
    sp = ulysses * ring
    if sp > 1 and not costs.sequence_parallel:
        raise ValueError(f"{costs.name}: its DiT takes no sequence parallelism (ulysses={ulysses}, ring={ring})")
    heads = costs.denoise.heads
    if ulysses > 1 and (not heads or heads % ulysses):
        raise ValueError(f"{costs.name}: ulysses={ulysses} does not divide the DiT's {heads} attention heads")
    if sp > costs.frames:
        raise ValueError(
            f"{costs.name}: ring x ulysses = {sp} ranks split {costs.frames} latent frames; "
            "every sequence-parallel rank needs a whole frame"
        )


@dataclasses.dataclass(frozen=True)
class ServeOption:
    """One priced configuration: its layout, ``max_batch`` and predictions."""

    name: str
    dp: int
    cfg: int
    ring: int
    ulysses: int
    aux: int  # ranks of their own running text and decode (0: each replica's first rank runs them)
    max_batch: int
    latency_s: float  # a request's, in a full batch of max_batch, without queueing
    single_latency_s: float  # a request's, alone
    requests_per_s: float
    step_s: float  # one denoising step of a batch
    text_s: float
    decode_s: float
    transfer_s: float
    memory_bytes: float  # peak per rank
    meets_slo: bool = True

    @property
    def replica(self) -> int:
        """Ranks of one denoise replica."""
        return self.cfg * self.ring * self.ulysses

    @property
    def nproc(self) -> int:
        """Ranks the placement uses (0..nproc-1)."""
        return self.dp * self.replica + self.aux

    @property
    def layout(self) -> str:
        return "disaggregated" if self.aux else "colocated"

    def placement(self) -> dict[str, Any]:
        """The placement ``mmpipe generate`` / ``mmpipe serve`` take: denoise replicas are
        consecutive ranks, row-major over (cfg, ring, ulysses); text and decode replicas on the
        ranks after them, or on each replica's first rank."""
        denoise = list(range(self.dp * self.replica))
        helpers = list(range(len(denoise), self.nproc)) if self.aux else denoise[:: self.replica]
        degrees = {"cfg": self.cfg, "ulysses": self.ulysses, "ring": self.ring, "dp": self.dp}
        return {"text": helpers, "denoise": {"ranks": denoise, **degrees}, "decode": list(helpers)}

    def describe(self) -> str:
        split = f"cfg={self.cfg} x ring={self.ring} x ulysses={self.ulysses}"
        where = f"{self.aux} text+decode rank(s)" if self.aux else "text+decode on each replica's first rank"
        return f"dp={self.dp} of {split}, {where}, max_batch={self.max_batch} ({self.nproc} ranks)"

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "placement": self.placement(),
            "nproc": self.nproc,
            "layout": self.layout,
            "max_batch": self.max_batch,
            "latency_s": self.latency_s,
            "single_latency_s": self.single_latency_s,
            "requests_per_s": self.requests_per_s,
            "step_s": self.step_s,
            "text_s": self.text_s,
            "decode_s": self.decode_s,
            "transfer_s": self.transfer_s,
            "memory_gb": self.memory_bytes / 1e9,
            "meets_slo": self.meets_slo,
        }


#: The alternatives shown beside the plan: the best configuration of each kind.
FAMILIES: dict[str, Callable[[ServeOption], bool]] = {
    "one rank": lambda o: o.nproc == 1,
    "data parallel only": lambda o: o.replica == 1,
    "pure CFG": lambda o: o.cfg == 2 and o.ring == o.ulysses == 1,
    "pure Ulysses": lambda o: o.cfg == o.ring == 1 and o.ulysses > 1,
    "pure ring": lambda o: o.cfg == o.ulysses == 1 and o.ring > 1,
}


@dataclasses.dataclass(frozen=True)
class ServePlan:
    """What :func:`plan_serving` returns: the chosen configuration, the best of each kind beside it
    (``alternatives``; kinds that cannot run in ``unavailable``, with why) and the assumptions."""

    model: str
    cluster: str
    world_size: int
    steps: int
    guidance: float
    objective: Objective
    slo_s: float | None
    best: ServeOption
    alternatives: tuple[ServeOption, ...]
    unavailable: Mapping[str, str]
    assumptions: Mapping[str, Any]
    considered: int

    @property
    def placement(self) -> dict[str, Any]:
        return self.best.placement()

    @property
    def max_batch(self) -> int:
        return self.best.max_batch

    @property
    def latency_s(self) -> float:
        return self.best.latency_s

    @property
    def requests_per_s(self) -> float:
        return self.best.requests_per_s

    def to_json(self) -> dict[str, Any]:
        """``mmpipe plan mode=serve --json``."""
        return {
            "mode": "serve",
            "model": self.model,
            "cluster": self.cluster,
            "world_size": self.world_size,
            "steps": self.steps,
            "guidance": self.guidance,
            "objective": str(self.objective),
            "slo_s": self.slo_s,
            **{k: v for k, v in self.best.to_json().items() if k not in ("name", "meets_slo")},
            "alternatives": [a.to_json() for a in self.alternatives],
            "unavailable": dict(self.unavailable),
            "considered": self.considered,
            "assumptions": dict(self.assumptions),
        }

    def format(self) -> str:
        """The human-readable plan ``mmpipe plan mode=serve`` prints."""
        b = self.best
        goal = str(self.objective) + (f", latency <= {self.slo_s:g} s" if self.slo_s is not None else "")
        guidance = f"guidance {self.guidance:g}" if self.guidance > 1 else "guidance off"
        place = self.placement
        lines = [
            f"serving plan for {self.model} on {self.cluster} ({self.world_size} devices): "
            f"{self.steps} steps, {guidance}; objective: {goal}",
            f"placement: {json.dumps(place)}  (nproc={b.nproc}, max_batch={b.max_batch}, {b.layout})",
            "",
            f"{'stage':<10} {'ranks':>13} {'replicas':>8} {'cfg':>4} {'ring':>4} {'uly':>4} {'seconds per batch':>28}",
            f"{'text':<10} {format_ranks(place['text'], max_runs=3):>13} {len(place['text']):>8} "
            f"{'':>14} {b.text_s:>28.4g}",
            f"{'denoise':<10} {format_ranks(place['denoise']['ranks'], max_runs=3):>13} {b.dp:>8} {b.cfg:>4} "
            f"{b.ring:>4} {b.ulysses:>4} {f'{b.step_s:.4g} a step x {self.steps} = {b.step_s * self.steps:.4g}':>28}",
            f"{'decode':<10} {format_ranks(place['decode'], max_runs=3):>13} {len(place['decode']):>8} "
            f"{'':>14} {b.decode_s:>28.4g}",
            f"{'transfers':<10} {'':>42} {b.transfer_s:>28.4g}",
            "",
            f"latency {b.latency_s:.4g} s (a request alone: {b.single_latency_s:.4g} s); "
            f"{b.requests_per_s:.4g} requests/s; peak memory {b.memory_bytes / 1e9:.1f} GB per rank",
            "",
            f"{'alternative':<20} {'nproc':>5} {'batch':>5} {'dp':>4} {'cfg':>4} {'ring':>4} {'uly':>4} "
            f"{'aux':>4} {'latency s':>10} {'req/s':>10} {'vs plan':>8}",
        ]
        for o in (dataclasses.replace(b, name="mmpipe plan"), *self.alternatives):
            speed = o.requests_per_s / b.requests_per_s if self.objective == Objective.THROUGHPUT else None
            ratio = f"x{speed:.2f}" if speed is not None else f"x{o.latency_s / b.latency_s:.2f} lat"
            lines.append(
                f"{o.name:<20} {o.nproc:>5} {o.max_batch:>5} {o.dp:>4} {o.cfg:>4} {o.ring:>4} {o.ulysses:>4} "
                f"{o.aux:>4} {o.latency_s:>10.4g} {o.requests_per_s:>10.4g} {ratio:>8}"
                + ("" if o.meets_slo else "  (misses slo_s)")
            )
        for name, why in self.unavailable.items():
            lines.append(f"{name:<20} not possible: {why}")
        eff = ", ".join(f"{s} {e:.0%}" for s, e in self.assumptions["efficiency"].items())
        lines += [
            "",
            f"efficiency of peak: {eff} ({'calibrated' if self.assumptions['calibrated'] else 'uncalibrated'}); "
            f"{self.considered} configurations considered",
        ]
        return "\n".join(lines)


def plan_serving(
    costs: ServeCosts,
    cluster: Cluster,
    *,
    steps: int,
    guidance: float,
    slo_s: float | None = None,
    objective: Objective = Objective.THROUGHPUT,
    max_batch_limit: int = MAX_BATCH,
    calibration: Calibration | None = None,
    disaggregate: bool = False,
) -> ServePlan:
    """The best way to serve ``costs``' requests on ``cluster`` (see the module docstring).

    ``guidance > 1`` turns classifier-free guidance on (two DiT forwards a step). With ``slo_s``,
    only configurations whose predicted latency meets it count; none meeting it is a ``ValueError``
    naming the best latency there is. ``disaggregate``: also search text and decode on ranks of
    their own (not runnable by ``mmpipe serve`` yet).
    """
    if steps < 1:
        raise ValueError(f"steps={steps}: must be >= 1")
    if max_batch_limit < 1:
        raise ValueError(f"max_batch_limit={max_batch_limit}: must be >= 1")
    if slo_s is not None and not slo_s > 0:
        raise ValueError(f"slo_s={slo_s}: must be positive")
    pricer = _Pricer(costs, cluster, calibration, steps=steps, guided=guidance > 1.0, disaggregate=disaggregate)
    options = list(pricer.options(max_batch_limit))
    if not options:
        raise ValueError(
            f"no configuration of {costs.name} fits {cluster.name}: {cluster.memory_bytes / 1e9:.0f} GB per device"
        )
    key = _ranking(objective)
    meeting = [o for o in options if slo_s is None or o.latency_s <= slo_s]
    if not meeting:
        fastest = min(options, key=_ranking(Objective.LATENCY))
        raise ValueError(
            f"no configuration of {costs.name} on {cluster.name} meets slo_s={slo_s:g}: the best predicted "
            f"latency is {fastest.latency_s:.4g} s ({fastest.describe()}); raise slo_s or add devices"
        )
    best = dataclasses.replace(min(meeting, key=key), name="mmpipe plan")
    alternatives, unavailable = [], {}
    for name, member in FAMILIES.items():
        kind = [o for o in options if member(o)]
        ok = [o for o in kind if slo_s is None or o.latency_s <= slo_s]
        if ok:
            alternatives.append(dataclasses.replace(min(ok, key=key), name=name))
        elif kind:
            alternatives.append(
                dataclasses.replace(min(kind, key=_ranking(Objective.LATENCY)), name=name, meets_slo=False)
            )
        else:
            unavailable[name] = pricer.why_not(name)
    return ServePlan(
        costs.name,
        cluster.name,
        cluster.world_size,
        steps,
        guidance,
        objective,
        slo_s,
        best,
        tuple(alternatives),
        unavailable,
        pricer.assumptions(),
        len(options),
    )


def _ranking(objective: Objective) -> Callable[[ServeOption], tuple[float, ...]]:
    """Sort key, best first. Figures equal to 6 significant digits tie (a batch that buys no
    requests/s is not worth its latency); ties go to fewer ranks, narrower replicas, CFG over
    sequence parallelism (one exchange a step), fewer helpers."""

    def simpler(o: ServeOption) -> tuple[int, ...]:
        return o.nproc, o.replica, o.ring * o.ulysses, o.aux

    if objective == Objective.LATENCY:
        return lambda o: (_sig(o.latency_s), -_sig(o.requests_per_s), *simpler(o))
    return lambda o: (-_sig(o.requests_per_s), _sig(o.latency_s), *simpler(o))


def _sig(x: float) -> float:
    return float(f"{x:.6g}")


@dataclasses.dataclass(frozen=True)
class _Stage:
    name: str
    capabilities: Capabilities
    frozen: bool = True


class _ServeGraph:
    """The request's three frozen stages, as :class:`~mmpipe.sched.analytic.Workload` reads a graph."""

    def __init__(self, sequence_parallel: bool) -> None:
        self.stages = {
            s: _Stage(s, Capabilities(sequence_parallel=sequence_parallel and s == "denoise")) for s in STAGES
        }

    def topological_order(self) -> list[str]:
        return list(STAGES)

    def stage_edges(self) -> list[tuple[str, str]]:
        return [("text", "denoise"), ("denoise", "decode")]


@dataclasses.dataclass(frozen=True)
class _Replica:
    """One denoise replica shape with ``batch`` requests, priced."""

    step_s: float
    text_s: float
    decode_s: float
    denoise_memory: float
    text_memory: float
    decode_memory: float


class _Pricer:
    """Prices configurations with the training planner's :class:`CostModel`."""

    def __init__(
        self,
        costs: ServeCosts,
        cluster: Cluster,
        calibration: Calibration | None,
        *,
        steps: int,
        guided: bool,
        disaggregate: bool,
    ) -> None:
        self.costs, self.cluster, self.steps, self.guided = costs, cluster, steps, guided
        self.disaggregate = disaggregate
        stage_costs = {"text": costs.text, "denoise": costs.denoise, "decode": costs.decode}
        workload = Workload.of(costs.name, _ServeGraph(costs.sequence_parallel), stage_costs, 1)
        self.model = CostModel(cluster, workload, calibration, replicate_frozen=True)
        self._priced: dict[tuple[int, int, int, int], _Replica] = {}

    def shapes(self) -> Iterator[tuple[int, int, int]]:
        """Every valid ``(cfg, ring, ulysses)`` of at most the cluster's ranks."""
        n = self.cluster.world_size
        heads = self.costs.denoise.heads or 1
        for cfg in (1, 2) if self.guided else (1,):
            for ulysses in range(1, heads + 1):
                for ring in range(1, n // (cfg * ulysses) + 1):
                    try:
                        check_layout(self.costs, cfg=cfg, ulysses=ulysses, ring=ring, guided=self.guided)
                    except ValueError:
                        continue
                    yield cfg, ring, ulysses

    def replica(self, cfg: int, ring: int, ulysses: int, batch: int) -> _Replica:
        key = (cfg, ring, ulysses, batch)
        if key not in self._priced:
            branches = 2 if self.guided else 1
            dit = self.model.configure("denoise", batch * branches // cfg, 1, ulysses, ring, 0.0, 0.0)
            size = cfg * ring * ulysses
            gather = 0.0
            if size > 1:  # every rank gets every branch's whole prediction (DenoiseGroup.gather)
                nbytes = batch * branches * self.costs.latent_elements * self.cluster.dtype_bytes
                gather = self.model.collective("all_gather", nbytes, size)
            text = self.model.configure("text", batch, 1, 1, 1, 0.0, 0.0)
            decode = self.model.configure("decode", batch, 1, 1, 1, 0.0, 0.0)
            self._priced[key] = _Replica(
                dit.forward_s + gather, text.forward_s, decode.forward_s, dit.memory, text.memory, decode.memory
            )
        return self._priced[key]

    def p2p(self, nbytes: float, ranks: range) -> float:
        """One message among ``ranks`` (the calibrated transport when there is one)."""
        cal = self.model.calibrated
        if cal is not None and cal.latency_s is not None and cal.bandwidth:
            return cal.latency_s + nbytes / cal.bandwidth
        return self.cluster.latency + nbytes / self.cluster.bandwidth(ranks)

    def options(self, max_batch_limit: int) -> Iterator[ServeOption]:
        """Every configuration that fits: each shape, batch, replica count and text/decode layout."""
        n = self.cluster.world_size
        for cfg, ring, ulysses in self.shapes():
            size = cfg * ring * ulysses
            for batch in range(1, max_batch_limit + 1):
                for dp in range(1, n // size + 1):
                    if not self._aligned(dp - 1, size):
                        break  # this replica straddles a level boundary; so would every larger dp
                    yield from self._layouts(cfg, ring, ulysses, batch, dp)

    def _aligned(self, index: int, size: int) -> bool:
        """Replica ``index`` talks as fast as the replica of ranks ``0..size-1`` it is priced as."""
        return self.cluster.bandwidth(range(index * size, (index + 1) * size)) >= self.cluster.bandwidth(range(size))

    def _layouts(self, cfg: int, ring: int, ulysses: int, batch: int, dp: int) -> Iterator[ServeOption]:
        """Text and decode on each replica's first rank, then on 1, 2, ... ranks of their own, up to
        the count that keeps up with the replicas (more only idles)."""
        size = cfg * ring * ulysses
        n, used = self.cluster.world_size, dp * size
        for aux in range(0, n - used + 1 if self.disaggregate else 1):
            option = self._option(cfg, ring, ulysses, batch, dp, aux)
            if option is None:
                if aux:
                    return  # helpers of their own hold the most any rank holds with them
                continue  # colocated does not fit; helpers of their own may
            yield option
            if aux and self._helpers_keep_up(option, cfg, ring, ulysses, batch, dp, aux):
                return

    def _helpers_keep_up(
        self, option: ServeOption, cfg: int, ring: int, ulysses: int, batch: int, dp: int, aux: int
    ) -> bool:
        r = self.replica(cfg, ring, ulysses, batch)
        return aux * batch / (r.text_s + r.decode_s + option.transfer_s) >= dp * batch / (
            self.steps * r.step_s + option.transfer_s
        )

    def _figures(self, r: _Replica, batch: int, dp: int, size: int, aux: int) -> tuple[float, float, float]:
        """(latency, requests/s, transfer seconds) of a batch of ``batch`` requests."""
        c = self.costs
        context = batch * c.text.output_bytes
        if aux:
            span = range((dp - 1) * size, dp * size + aux)  # the farthest replica and helper
            transfer = self.p2p(context, span) + self.p2p(batch * c.latent_elements * LATENT_BYTES, span)
        else:  # the first rank encodes, and after the last gather every rank holds the latents
            transfer = self.p2p(context, range(size)) if size > 1 else 0.0
        latency = r.text_s + self.steps * r.step_s + r.decode_s + transfer
        if aux:
            rate = min(
                dp * batch / (self.steps * r.step_s + transfer), aux * batch / (r.text_s + r.decode_s + transfer)
            )
        else:
            rate = dp * batch / latency
        return latency, rate, transfer

    def _option(self, cfg: int, ring: int, ulysses: int, batch: int, dp: int, aux: int) -> ServeOption | None:
        size = cfg * ring * ulysses
        r = self.replica(cfg, ring, ulysses, batch)
        helpers = r.text_memory + r.decode_memory
        memory = max(r.denoise_memory, helpers) if aux else r.denoise_memory + helpers
        if memory > self.model.budget:
            return None
        latency, rate, transfer = self._figures(r, batch, dp, size, aux)
        single, _, _ = self._figures(self.replica(cfg, ring, ulysses, 1), 1, dp, size, aux)
        return ServeOption(
            "candidate",
            dp,
            cfg,
            ring,
            ulysses,
            aux,
            batch,
            latency,
            single,
            rate,
            r.step_s,
            r.text_s,
            r.decode_s,
            transfer,
            memory,
        )

    def why_not(self, family: str) -> str:
        """Why no configuration of ``family`` (a :data:`FAMILIES` name) was found."""
        heads = self.costs.denoise.heads or 1
        smallest = next((u for u in range(2, heads + 1) if heads % u == 0), 2)
        layout = {"pure CFG": (2, 1, 1), "pure Ulysses": (1, smallest, 1), "pure ring": (1, 1, 2)}.get(family)
        if layout is not None:
            try:
                check_layout(self.costs, cfg=layout[0], ulysses=layout[1], ring=layout[2], guided=self.guided)
            except ValueError as err:
                return str(err)
            size = math.prod(layout)
            if size > self.cluster.world_size:
                return f"needs {size} ranks, the cluster has {self.cluster.world_size}"
        return f"does not fit {self.cluster.memory_bytes / 1e9:.0f} GB per device"

    def assumptions(self) -> dict[str, Any]:
        cl = self.cluster
        return {
            "device": cl.device,
            "peak_flops": cl.peak_flops,
            "efficiency": {s: self.model.efficiency(s, "forward") for s in STAGES},
            "calibrated": self.model.calibrated is not None,
            "bandwidth_levels": [{"name": lv.name, "size": lv.size, "bytes_per_s": lv.bandwidth} for lv in cl.levels],
            "network_bytes_per_s": cl.network_bandwidth,
            "latency_s": cl.latency,
            "memory_budget_gb": self.model.budget / 1e9,
            "not_modelled": list(NOT_MODELLED),
        }
