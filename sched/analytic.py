"""The planner's analytic cost model: a costed workload (per-sample stage costs of a graph) and the
time and memory of a stage under one configuration (group, data-parallel, Ulysses and ring
degrees, memory policy, micro-batch size).

The memory model per rank: trainable stages keep fp32 master weights, gradients and Adam moments
sharded over their whole group (FSDP, 16 bytes per parameter / group size) plus two gathered bf16
blocks, or, replicated (DDP), all 16 bytes per parameter on every rank; frozen stages keep bf16
weights, replicated when small and sharded otherwise; activations of every in-flight micro-batch
(1F1B warm-up depth) under the chosen recompute / offload policy.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping
from typing import Any

from mmpipe.sched.calibration import Calibration
from mmpipe.sched.cluster import Cluster
from mmpipe.sched.cost import StageCost
from mmpipe.sched.schedule import GraphInfo, backward_stages

USABLE_MEMORY = 0.9  # of device memory: the rest is the framework's, fragmentation, buffers


ADAM_BYTES = 16  # fp32 master weight + fp32 gradient + two fp32 Adam moments, per parameter


SEND_BUFFERS = 4  # the runtime's bound on unreceived sends (max in-flight messages)


@dataclasses.dataclass(frozen=True)
class Workload:
    """What the planner plans: a graph's stages, their per-sample costs and the global batch."""

    name: str
    graph: GraphInfo
    costs: Mapping[str, StageCost]
    global_batch: int
    sequence_parallel: frozenset[str]  # stages that may split their sequence
    edges: tuple[tuple[str, str], ...]
    order: tuple[str, ...]
    backward: frozenset[str]
    trainable: frozenset[str]
    # stage -> the share of its samples it computes (a frozen stage served from the frozen-output
    # cache computes the rest not at all): scales its FLOPs (in ``costs``, by :func:`with_compute_fraction`)
    # and its fixed cost per action, which a micro-batch served whole from the cache does not pay
    compute_fraction: Mapping[str, float] = dataclasses.field(default_factory=dict)

    @classmethod
    def of(cls, name: str, graph: Any, costs: Mapping[str, StageCost], global_batch: int) -> Workload:
        if global_batch <= 0:
            raise ValueError(f"global_batch must be positive, got {global_batch}")
        sp = frozenset(n for n, s in graph.stages.items() if getattr(s.capabilities, "sequence_parallel", False))
        return cls(
            name,
            graph,
            dict(costs),
            global_batch,
            sp,
            tuple(dict.fromkeys(graph.stage_edges())),
            tuple(graph.topological_order()),
            backward_stages(graph),
            frozenset(n for n, s in graph.stages.items() if not s.frozen),
        )

    def only(self, stages: Iterable[str], name: str | None = None) -> Workload:
        """This workload restricted to ``stages``, whose inputs from the other stages are precomputed
        (a DiT trained on cached latents and text embeddings); edges among them are kept."""
        keep = list(dict.fromkeys(stages))
        unknown = sorted(set(keep) - set(self.order))
        if unknown or not keep:
            raise ValueError(f"Workload.only: unknown or no stages {unknown or keep}; stages: {list(self.order)}")
        order = tuple(s for s in self.order if s in keep)
        edges = tuple((a, b) for a, b in self.edges if a in keep and b in keep)
        graph = _Subgraph({s: self.graph.stages[s] for s in order}, edges, order)
        costs = {s: self.costs[s] for s in order}
        fraction = {s: f for s, f in self.compute_fraction.items() if s in keep}
        return dataclasses.replace(
            Workload.of(name or f"{self.name}[{'+'.join(order)}]", graph, costs, self.global_batch),
            compute_fraction=fraction,
        )

    def with_compute_fraction(self, fraction: Mapping[str, float]) -> Workload:
        """This workload with ``fraction[stage]`` of each listed stage's samples computed (see
        ``compute_fraction``): its FLOPs scaled here, its per-action overhead by the cost model."""
        bad = {s: f for s, f in fraction.items() if s not in self.costs or not 0.0 <= f <= 1.0}
        if bad:
            raise ValueError(f"compute_fraction {bad}: stages of {list(self.order)} with fractions in [0, 1]")
        costs = dict(self.costs)
        for stage, f in fraction.items():
            c = costs[stage]
            costs[stage] = dataclasses.replace(
                c,
                forward_flops=c.forward_flops * f,
                attention_flops=c.attention_flops * f,
                block_flops=c.block_flops * f,
            )
        return dataclasses.replace(self, costs=costs, compute_fraction=dict(fraction))

    def model_flops(self, stage: str) -> float:
        """FLOPs per sample of ``stage`` (forward, plus backward when on the backward path)."""
        c = self.costs[stage]
        return c.forward_flops + (c.backward_flops if stage in self.backward else 0.0)

    @property
    def tokens_per_sample(self) -> int:
        return max((c.tokens for c in self.costs.values()), default=0)


@dataclasses.dataclass(frozen=True)
class _Subgraph:
    """Some stages of a graph and the edges among them (what :class:`GraphInfo` reads)."""

    stages: Mapping[str, Any]
    edges: tuple[tuple[str, str], ...]
    order: tuple[str, ...]

    def topological_order(self) -> list[str]:
        return list(self.order)

    def stage_edges(self) -> list[tuple[str, str]]:
        return list(self.edges)


@dataclasses.dataclass(frozen=True)
class StageConfig:
    """One stage's layout and policy, and what it costs each of its ranks per micro-batch."""

    stage: str
    dp: int
    ulysses: int = 1
    ring: int = 1
    recompute: float = 0.0
    offload: float = 0.0
    samples: int = 1  # per replica per micro-batch
    forward_s: float = 0.0  # per micro-batch, exposed communication included
    backward_s: float = 0.0  # backward + recomputation, exposed communication included
    memory: float = 0.0  # peak bytes per rank
    inflight: int = 1
    sync_s: float = 0.0  # gradient reduce-scatter, once per step (in the last micro-batch's backward)
    gather_once: bool = False  # FSDP parameters gathered once per step and kept (DeviceGroup.gather_once)
    reserved: float = 0.0  # bytes of other stages on the same ranks that ``memory`` includes
    replicate: bool = False  # a trainable stage's parameters whole on every rank, gradients all-reduced (DDP)

    @property
    def own_memory(self) -> float:
        """Peak bytes per rank of this stage alone (``memory`` less ``reserved``)."""
        return self.memory - self.reserved

    @property
    def ranks(self) -> int:
        return self.dp * self.ulysses * self.ring

    @property
    def time(self) -> float:
        return self.forward_s + self.backward_s


class CostModel:
    """Seconds and bytes of a stage configuration on a cluster (see the module docstring)."""

    def __init__(
        self,
        cluster: Cluster,
        workload: Workload,
        calibration: Calibration | None = None,
        *,
        replicate_frozen: bool = False,
    ) -> None:
        """``replicate_frozen``: frozen stages keep whole weights on every rank of their group (serving:
        CFG- and sequence-parallel inference replicates the DiT, no FSDP gathers)."""
        self.cluster, self.w, self.cal = cluster, workload, calibration
        self.budget = cluster.memory_bytes * USABLE_MEMORY
        self.replicate_frozen = replicate_frozen

    @property
    def calibrated(self) -> Calibration | None:
        """The calibration when it was measured on this cluster's device kind."""
        return self.cal if self.cal is not None and self.cal.device == self.cluster.device else None

    def efficiency(self, stage: str, direction: str) -> float:
        """The achieved fraction of peak of ``stage``'s ``direction`` (the line through the largest sizes)."""
        return self.line(stage, direction, math.inf)[0]

    def line(self, stage: str, direction: str, samples: float) -> tuple[float, float]:
        """The efficiency and fixed seconds per action of ``stage``'s ``direction`` for actions of
        ``samples`` samples (:meth:`Calibration.line`); uncalibrated: the cluster's efficiency, no fixed cost."""
        cal = self.calibrated
        if cal is None:
            return self.cluster.efficiency, 0.0
        return cal.line(stage, direction, samples, self.cluster.efficiency)

    def overhead(self, stage: str, key: str) -> float:
        cal = self.calibrated
        return cal.value(stage, key) if cal else 0.0

    def rate(self, stage: str, direction: str) -> float:
        return self.cluster.peak_flops * self.efficiency(stage, direction)

    def _span(self, n: int) -> range:
        return range(min(n, self.cluster.world_size))  # groups start on level boundaries

    def configure(
        self,
        stage: str,
        samples: int,
        dp: int,
        ulysses: int,
        ring: int,
        recompute: float,
        offload: float,
        *,
        inflight: int = 1,
        reserved: float = 0.0,
        micro_batches: int = 1,
        gather_once: bool = False,
        replicate: bool = False,
    ) -> StageConfig:
        """The configuration's times and peak memory (``reserved``: bytes other stages keep on its ranks;
        ``gather_once``: a trainable stage's parameters gathered once per ``micro_batches`` and kept;
        ``replicate``: a trainable stage's whole parameters and optimizer state on every rank of its
        group, gradients all-reduced once per step: DDP instead of FSDP)."""
        c, w = self.costs(stage), self.w
        sp = ulysses * ring
        n = samples
        group = dp * sp
        train = stage in w.backward
        trainable = stage in w.trainable
        at = n / sp  # samples an action of this configuration computes per rank: which calibrated line prices it
        fwd_eff, fwd_overhead = self.line(stage, "forward", at)
        bwd_eff, bwd_overhead = self.line(stage, "backward", at)
        fwd_rate, bwd_rate = self.cluster.peak_flops * fwd_eff, self.cluster.peak_flops * bwd_eff
        fwd_overhead *= w.compute_fraction.get(stage, 1.0)
        replicate_trained = replicate and trainable and group > 1
        sharded = trainable and group > 1 and not replicate_trained
        gather_once = gather_once and sharded
        if sharded:  # FSDP2's hooks per action, as mmpipe profile's two-rank run measured them
            fwd_overhead += self.overhead(stage, "sharded_forward_overhead_s")
            bwd_overhead += self.overhead(stage, "sharded_backward_overhead_s")
        fwd = fwd_overhead + n * c.forward_flops / sp / fwd_rate
        bwd = 0.0
        if train:
            bwd = bwd_overhead + n * c.backward_flops / sp / bwd_rate
        rec = recompute * n * c.block_flops / sp / fwd_rate if train else 0.0
        # Ulysses: four all-to-alls per block (q, k, v, out) each way, of this rank's shard.
        a2a_f = a2a_b = 0.0
        if ulysses > 1 and c.blocks:
            shard = n * c.tokens * c.hidden * 2 / sp
            one = self.cluster.collective_seconds("all_to_all", shard, self._span(ulysses))
            a2a_f = 4 * c.blocks * one
            a2a_b = a2a_f * (1 + recompute) if train else 0.0
        # Ring: ring - 1 key/value block passes per block, hidden behind the attention compute.
        ring_f = ring_b = 0.0
        if ring > 1 and c.blocks:
            kv = 2 * n * c.tokens * c.hidden * 2 / sp
            step = kv / self.cluster.bandwidth(self._span(sp))
            attn = n * c.attention_flops / c.blocks / sp / fwd_rate
            ring_f = c.blocks * max(0.0, (ring - 1) * step - attn)
            ring_b = c.blocks * max(0.0, 2 * (ring - 1) * step - 2.5 * attn) if train else 0.0
        # FSDP traffic: parameters gathered for the forward (and again for the backward and any
        # recomputation) of every micro-batch; gradients reduce-scattered once per step.
        fsdp = sync = 0.0
        width = self.cluster.dtype_bytes
        replicate = not trainable and (self.replicate_frozen or width * c.params <= 0.25 * self.budget)
        if replicate_trained:
            # DDP: no gathers; the gradients' all-reduce once per step, the optimizer on plain tensors
            sync = self.collective("all_reduce", width * c.params, group)
        elif group > 1 and (trainable or not replicate):
            gather = self.collective("all_gather", width * c.params, group)
            fsdp = gather / micro_batches if gather_once else gather * (2 + recompute if train else 1)
            if trainable:
                # the gradients' reduce-scatter, plus what sharding costs the optimizer step beyond
                # the priced collectives (mmpipe profile's two-rank run: sharded tensors, the norm)
                sync = self.collective("reduce_scatter", width * c.params, group)
                sync += self.overhead(stage, "sharded_step_overhead_s")
        # Offload of saved activations to host memory and back, overlapped with compute.
        moved = offload * (1 - recompute) * n * c.block_activation_bytes / sp if train else 0.0
        offload_s = 2 * moved / self.cluster.host_bandwidth
        compute = fwd + bwd + rec
        hidden = compute if self.cluster.overlap_collectives else 0.0
        offload_exposed = max(0.0, offload_s - compute) if self.cluster.offload_overlap else offload_s
        exposed = max(0.0, fsdp - hidden) + offload_exposed
        forward_s = fwd + a2a_f + ring_f
        backward_s = bwd + rec + a2a_b + ring_b + exposed if train else 0.0
        if not train:
            forward_s += exposed
        # Memory per rank.
        block_params = c.params / max(c.blocks, 1)
        weights: float
        if replicate_trained:
            weights = ADAM_BYTES * c.params
        elif trainable:
            weights = ADAM_BYTES * c.params / group + (width * c.params if gather_once else 2 * width * block_params)
        elif replicate or group == 1:
            weights = width * c.params
        else:
            weights = width * c.params / group + 2 * width * block_params
        if train:
            kept = (1 - recompute) * (1 - offload) * c.block_activation_bytes + recompute * c.block_input_bytes
            per_mb = n / sp * (c.activation_bytes - c.block_activation_bytes + kept)
            transient = n / sp * c.block_activation_bytes / max(c.blocks, 1)
            if offload and recompute < 1 and not self.cluster.offload_overlap:  # the file tier: one block at a time
                transient *= 2
            acts = inflight * per_mb + transient
        else:
            acts = 4 * n * max(c.output_bytes, c.block_input_bytes / max(c.blocks, 1)) / sp
        buffers = SEND_BUFFERS * n * c.output_bytes
        memory = reserved + weights + acts + buffers
        if inflight * moved > self.cluster.host_memory_bytes:
            memory = math.inf  # the offloaded activations do not fit host memory
        return StageConfig(
            stage,
            dp,
            ulysses,
            ring,
            recompute,
            offload,
            n,
            forward_s,
            backward_s,
            memory,
            inflight,
            sync,
            gather_once,
            reserved,
            replicate_trained,
        )

    def collective(self, kind: str, nbytes: float, ranks: int) -> float:
        """A ring collective over ``ranks`` consecutive ranks; the measured transport when calibrated."""
        measured = self.calibrated.collective_seconds(nbytes, ranks) if self.calibrated is not None else None
        if measured is not None and kind == "all_reduce":
            measured *= 2  # a reduce-scatter, then an all-gather
        return measured if measured is not None else self.cluster.collective_seconds(kind, nbytes, self._span(ranks))

    def costs(self, stage: str) -> StageCost:
        return self.w.costs[stage]

    def fits(self, cfg: StageConfig) -> bool:
        return cfg.memory <= self.budget


def per_micro_batch(c: StageConfig, b: int) -> float:
    """A rank's time for ``c`` per micro-batch of ``b`` samples, averaged over a step: replicas whose
    shares differ or that take turns (more replicas than samples) each work on ``b / dp`` samples of
    a micro-batch on average, at ``c.time`` per ``c.samples``."""
    return c.time * b / (c.dp * c.samples)
