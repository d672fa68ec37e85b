"""The planner's search: placement, parallel degrees, memory policy and micro-batches of a training DAG.

Given a graph's per-sample stage costs (``mmpipe.sched.cost``) and a cluster, the planner chooses,
for every stage, its group size, data-parallel (FSDP) degree, Ulysses and ring degrees and memory
policy (fractions of blocks recomputed / offloaded), plus the micro-batch size and count of a
fixed global batch, for two kinds of layout:

- *disaggregated*: every stage on its own contiguous group; frozen producers run ahead of the
  trainable consumers. Group sizes come from a binary search on the step time: each stage takes
  the fewest ranks whose best configuration finishes its micro-batches in time, until the
  cluster is used up;
- *colocated*: every stage on all ranks, time-sliced (each with its own dp / sequence split; a
  stage may run on one rank or sequence-parallel group per replica of the others);
- *bundled* (up to ``BUNDLE_MAX_DEVICES``): the stages partitioned into groups that each
  time-slice a few stages, balanced like the disaggregated layout.

The global batch is either kept exactly (micro-batch size and count searched over its divisors)
or, as a cap, lets disaggregated layouts take fewer samples per step when their replica counts
need it (the heaviest stage's replica count is searched from the largest that leaves room).

The best candidates of the analytic model are checked with the discrete-event simulator on a
reduced plan (ranks of a group are symmetric, so data-parallel replicas are merged), and the
fastest simulated plan that fits every rank's memory wins. Rank assignment is topology-aware:
sequence-parallel replicas are consecutive ranks inside the innermost bandwidth level, groups
with sequence parallelism are placed first, on level boundaries, and data parallelism spans levels.

Baselines, each searched and simulated the way the plan is:

- *colocated (FSDP + SP)* (``COLOCATED_BASELINE``, the figure ``vs_colocated`` is against): what
  users write by hand, every stage colocated on all ranks with its own data-parallel (FSDP) x
  Ulysses x ring split, gathered-once parameters and every memory policy; the same colocated search
  as the plan's minus frozen replicas taking turns over micro-batches, with the same number of
  simulated candidates (``simulate_top``);
- *colocated-sequential* (context): all stages in turn on every rank, data parallelism only, with
  the best memory policy that fits, its best estimate simulated;
- *uniform split* (context): rank counts proportional to parameter counts.

The planner's answer is the best simulated of its own candidates; no baseline is substituted
into it. The *lower bound* runs every stage's model FLOPs at the device's peak (efficiency 1), so
the plan's fraction of it is its MFU; the *efficiency bound* runs them at the cost model's
efficiency (what a perfect layout could reach in this model).

The search (this module) prices configurations with the analytic model of
:mod:`~mmpipe.sched.analytic`, calibrated by :mod:`~mmpipe.sched.calibration`, and returns the
:mod:`~mmpipe.sched.results` types.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

from mmpipe.errors import PlanError
from mmpipe.memory.budget import BlockPricing, choose_policies
from mmpipe.sched.analytic import CostModel, StageConfig, Workload, per_micro_batch
from mmpipe.sched.calibration import Calibration
from mmpipe.sched.cluster import Cluster
from mmpipe.sched.plan import Action, ActionKind
from mmpipe.sched.results import Candidate, PlanReport, PlanResult
from mmpipe.sched.schedule import build_plan
from mmpipe.sched.simulator import bubble_fractions, simulate

RING = (1, 2, 4, 8)
COLOCATED_BASELINE = "colocated (FSDP + SP, best of the same search)"
BUNDLE_MAX_DEVICES = 64  # hybrid layouts (stages sharing groups) are searched up to this size


class Planner:
    """Searches layouts for ``workload`` on ``cluster`` (see the module docstring)."""

    def __init__(
        self,
        workload: Workload,
        cluster: Cluster,
        *,
        calibration: Calibration | None = None,
        max_sequence_parallel: int | None = None,
        memory_policies: bool = True,
        micro_batches: int = 0,
        simulate_top: int = 3,
        batch_is_cap: bool = False,
    ) -> None:
        """``batch_is_cap``: the workload's global batch is an upper bound (the planner may use fewer
        samples per step when a layout needs a batch divisible by its replica counts)."""
        self.w, self.cluster = workload, cluster
        self.batch_is_cap = batch_is_cap
        self.model = CostModel(cluster, workload, calibration)
        self.max_sp = max_sequence_parallel if max_sequence_parallel is not None else cluster.levels[0].size
        self.memory_policies = memory_policies
        self.micro_batches = micro_batches
        self.simulate_top = simulate_top
        self._results: dict[tuple[Any, ...], PlanResult | PlanError] = {}

    # -- public ----------------------------------------------------------------------------------
    def plan(self) -> PlanReport:
        """The best simulated candidate of every layout, the baselines and the bounds."""
        t0 = time.perf_counter()
        n = self.cluster.world_size
        by_hand = [c for c in self.colocated(sequence_parallel=True, turns=False) if c is not None]
        found = self.disaggregated() + self.colocated(sequence_parallel=True) + by_hand + self.bundled()
        if self.batch_is_cap:
            found += self.disaggregated_capped()
        cands = _distinct(c for c in found if c is not None)
        if not cands:
            tried = (
                "even full recomputation and offload exceed it"
                if self.memory_policies
                else "recomputation and offload were not considered (the runtime for this device cannot apply them yet)"
            )
            raise ValueError(
                f"no configuration of {self.w.name} fits {self.cluster.name}: "
                f"{self.cluster.memory_bytes / 1e9:.0f} GB per device; {tried}"
            )
        best = self._first_runnable(cands, self.simulate_top, "mmpipe")
        if best is None:
            raise ValueError(f"no candidate plan of {self.w.name} on {self.cluster.name} runs without stalling")
        colocated = self._first_runnable(_distinct(by_hand), self.simulate_top, COLOCATED_BASELINE)
        seq = [c for c in self.colocated(sequence_parallel=False) if c is not None]
        sequential = self._first_runnable(seq, 1, "colocated-sequential")
        uni = self.uniform_split()
        uniform = self._first_runnable([uni], 1, "uniform split") if uni else None
        return PlanReport(
            self.w.name,
            self.cluster.name,
            n,
            best.candidate.global_batch,
            best,
            colocated,
            sequential,
            uniform,
            self.lower_bound(),
            self.efficiency_bound(),
            time.perf_counter() - t0,
        )

    def _first_runnable(self, cands: Sequence[Candidate], top: int, name: str) -> PlanResult | None:
        """The highest simulated throughput among the ``top`` best-estimated candidates whose
        simulation does not stall (a stall is a plan the runtime could not run either), named ``name``;
        of candidates equally estimated, or plans equal but for rounding, the simplest (:func:`_complexity`)."""
        ranked = sorted(cands, key=lambda c: (-c.global_batch / c.estimate if c.estimate else 0.0, _complexity(c)))
        results: list[PlanResult] = []
        for c in ranked:
            try:
                results.append(self._evaluated(c))
            except PlanError:
                continue
            if len(results) >= max(top, 1):
                break
        if not results:
            return None
        fastest = max(r.samples_per_s for r in results)
        best = min(
            (r for r in results if r.samples_per_s >= fastest * (1 - 1e-9)),
            key=lambda r: _complexity(r.candidate),
        )
        return dataclasses.replace(best, candidate=dataclasses.replace(best.candidate, name=name))

    def _evaluated(self, cand: Candidate) -> PlanResult:
        """:meth:`evaluate` of ``cand``, once per distinct candidate of this planner."""
        key = _key(cand)
        if key not in self._results:
            try:
                self._results[key] = self.evaluate(cand)
            except PlanError as e:
                self._results[key] = e
        got = self._results[key]
        if isinstance(got, PlanError):
            raise got
        return got

    def lower_bound(self) -> float:
        """Samples/s if every rank ran every stage's model FLOPs at the device's peak FLOP/s
        (efficiency 1), nothing else: a plan's fraction of it is its MFU."""
        flops = sum(self.w.model_flops(s) for s in self.w.order)
        return self.cluster.world_size * self.cluster.peak_flops / flops

    def efficiency_bound(self) -> float:
        """Samples/s if every rank ran every stage's model FLOPs at the cost model's (calibrated or
        default) efficiency, nothing else: the most any layout reaches in this model."""
        seconds = sum(
            self.w.costs[s].forward_flops / self.model.rate(s, "forward")
            + (self.w.costs[s].backward_flops / self.model.rate(s, "backward") if s in self.w.backward else 0.0)
            for s in self.w.order
        )
        return self.cluster.world_size / seconds

    # -- option enumeration ----------------------------------------------------------------------
    def _micro_batch_sizes(self) -> list[int]:
        g = self.w.global_batch
        if self.micro_batches:
            if g % self.micro_batches:
                raise ValueError(f"global_batch={g} is not divisible by micro_batches={self.micro_batches}")
            return [g // self.micro_batches]
        return [b for b in _divisors(g) if g // b <= 64]

    def _sp_options(self, stage: str) -> list[tuple[int, int]]:
        c = self.w.costs[stage]
        if stage not in self.w.sequence_parallel or not c.blocks or c.tokens < 2:
            return [(1, 1)]
        domain = self.cluster.levels[0].size
        units = c.split_units or c.tokens  # every rank of a replica needs at least one whole unit
        out = []
        for u in _divisors(c.heads or 1):
            for r in RING:
                sp = u * r
                if sp <= self.max_sp and domain % sp == 0 and c.tokens >= 2 * sp and units >= sp:
                    out.append((u, r))
        return out

    def _replica_counts(self, stage: str, b: int) -> list[int]:
        """Data-parallel degrees a stage may take for micro-batches of ``b`` samples: divisors of
        ``b`` for stages that run a backward (FSDP averages equal shares), any count up to ``b``
        for frozen ones (shares may differ by one sample)."""
        if stage in self.w.backward:
            return _divisors(b)
        return list(range(1, min(b, self.cluster.world_size) + 1))

    def inflight_micro_batches(self, stage: str, micro_batches: int) -> int:
        """Micro-batches whose activations a rank of ``stage`` holds at once under 1F1B."""
        if stage not in self.w.backward:
            return 1
        chain = [s for s in self.w.order if s in self.w.backward]
        downstream = chain[chain.index(stage) + 1 :]
        return min(micro_batches, 1 + len(downstream))

    def best_config(
        self, stage: str, b: int, dp: int, micro_batches: int, *, sp: Iterable[tuple[int, int]], reserved: float = 0.0
    ) -> StageConfig | None:
        """The fastest configuration of ``stage`` with ``dp`` replicas that fits memory; when keeping
        every activation does not fit, with the memory policy ``mmpipe.memory.budget`` chooses."""
        best: StageConfig | None = None
        inflight = self.inflight_micro_batches(stage, micro_batches)
        samples = -(-b // dp)
        for u, r in sp:
            cfg: StageConfig | None = self.model.configure(
                stage, samples, dp, u, r, 0.0, 0.0, inflight=inflight, reserved=reserved
            )
            assert cfg is not None
            if not self.model.fits(cfg):
                cfg = self.memory_policy(cfg, reserved) if self.memory_policies else None
            if cfg is not None and (best is None or cfg.time < best.time):
                best = cfg
        if best is not None and stage in self.w.trainable and best.ranks > 1:
            kept = best

            def variant(**how: bool) -> StageConfig:  # best's layout and memory policy, parameters handled as ``how``
                return self.model.configure(
                    stage,
                    kept.samples,
                    dp,
                    kept.ulysses,
                    kept.ring,
                    kept.recompute,
                    kept.offload,
                    inflight=inflight,
                    reserved=reserved,
                    micro_batches=micro_batches,
                    **how,
                )

            # Parameters gathered once per step: their memory for fewer gathers, when those are exposed.
            once = variant(gather_once=True)
            if self.model.fits(once) and once.time < best.time:
                best = once
            # Whole parameters on every rank and one all-reduce a step (DDP), when that step is faster:
            # a small model, whose gathers and sharded optimizer step cost more than they save.
            whole = variant(replicate=True)
            if self.model.fits(whole) and self._per_step(whole, micro_batches) < self._per_step(best, micro_batches):
                best = whole
        return best

    @staticmethod
    def _per_step(c: StageConfig, micro_batches: int) -> float:
        """A configuration's seconds per step on its ranks: every micro-batch's share, then the sync."""
        return micro_batches * c.time + c.sync_s

    def memory_policy(self, keep: StageConfig, reserved: float = 0.0) -> StageConfig | None:
        """``keep`` (every activation kept, too big) with the cheapest counts of recomputed and
        offloaded blocks that fit, priced by this cost model; None when nothing fits."""
        stage, c = keep.stage, self.w.costs[keep.stage]
        if stage not in self.w.backward or not c.blocks:
            return None
        args = (stage, keep.samples, keep.dp, keep.ulysses, keep.ring)
        full = self.model.configure(*args, 1.0, 0.0, inflight=keep.inflight, reserved=reserved)
        rows = keep.samples / (keep.ulysses * keep.ring)
        pricing = dataclasses.replace(
            BlockPricing.from_cost(
                c,
                rows=rows,
                flops_per_s=self.model.rate(stage, "forward"),
                offload_bytes_per_s=self.cluster.host_bandwidth,
                hidden_s=keep.time if self.cluster.offload_overlap else 0.0,
                tier_bytes=self.cluster.host_memory_bytes,
                pending_blocks=0 if self.cluster.offload_overlap else 1,  # a blocking tier: the file tier
            ),
            recompute_s=(full.time - keep.time) / c.blocks,  # its communication (all-to-alls, gathers) too
        )
        fixed = keep.memory - pricing.resident_bytes(0, 0, inflight=keep.inflight)  # all but the managed
        try:
            choice = choose_policies(pricing, budget_bytes=self.model.budget, inflight=keep.inflight, fixed_bytes=fixed)
        except ValueError:
            return None
        for offload in range(choice.offload, c.blocks - choice.recompute + 1):  # (float rounding)
            kept = c.blocks - choice.recompute
            cfg = self.model.configure(
                *args, choice.recompute / c.blocks, offload / kept if kept else 0.0,
                inflight=keep.inflight, reserved=reserved,
            )  # fmt: skip
            if self.model.fits(cfg):
                return cfg
        return None

    # -- disaggregated ---------------------------------------------------------------------------
    def disaggregated(self) -> list[Candidate | None]:
        out = []
        n = self.cluster.world_size
        if len(self.w.order) > n:
            return []
        for b in self._micro_batch_sizes():
            m = self.w.global_batch // b
            fronts = {s: self._front(s, b, m) for s in self.w.order}
            if any(not f for f in fronts.values()):
                continue
            out.append(self._balance(fronts, b, m))
        return out

    def disaggregated_capped(self) -> list[Candidate]:
        """Disaggregated layouts with the global batch free up to the cap: the heaviest stage's
        replica count ``R`` (and so the micro-batch ``b = R x samples``) is searched from the
        largest that leaves room, and the other stages take the fewest ranks that keep pace."""
        n, cap = self.cluster.world_size, self.w.global_batch
        main = max(self.w.order, key=self.w.model_flops)
        out: list[Candidate] = []
        combos = []
        for u, r in self._sp_options(main):
            for m in (1, 2, 4, 8, 16, 32):
                for per in (1, 2, 4):
                    top = min(n // (u * r), cap // (m * per))
                    if top < 1:
                        continue
                    cfg = self.best_config(main, top * per, top, m, sp=[(u, r)])
                    if cfg is not None:  # samples/s if the other stages cost nothing
                        combos.append((top * per / cfg.time, u, r, m, per, top))
        combos.sort(reverse=True)
        best_rate = 0.0
        for bound, u, r, m, per, top in combos:
            if bound <= best_rate:
                break  # no later combination can beat what was found
            # Trainable stages feeding the main one fill and drain the 1F1B pipeline every step:
            # faster (larger) groups for them shorten that, at the cost of main-stage replicas.
            chained = any(s in self.w.backward and s != main for s in self.w.order)
            for factor in (1.0, 0.5, 0.25, 0.125) if chained else (1.0,):
                found = self._largest_fitting(main, u, r, m, per, top, best_rate, chain_factor=factor)
                if found is not None:
                    out.append(found)
                    best_rate = max(best_rate, found.global_batch / found.estimate)
        return out

    def _largest_fitting(
        self, main: str, u: int, r: int, m: int, per: int, top: int, floor_rate: float, *, chain_factor: float = 1.0
    ) -> Candidate | None:
        """The most replicas (<= ``top``) of ``main`` that leave enough ranks for the other stages
        (trainable ones at ``chain_factor`` of the main stage's time per micro-batch)."""
        n = self.cluster.world_size
        for replicas in range(top, 0, -1):
            b = replicas * per
            cfg = self.best_config(main, b, replicas, m, sp=[(u, r)])
            if cfg is None or b / cfg.time <= floor_rate:
                return None  # fewer replicas do not fit better, nor run faster than what was found
            chosen = {main: cfg}
            for s in self.w.order:
                if s != main:
                    free = n - sum(c.ranks for c in chosen.values())
                    limit = m * cfg.time * (chain_factor if s in self.w.backward else 1.0)
                    fewest = self._fewest(s, b, m, limit, free)
                    if fewest is None:
                        break
                    chosen[s] = fewest
            else:
                configs = {s: chosen[s] for s in self.w.order}
                return Candidate(
                    "disaggregated",
                    "disaggregated",
                    configs,
                    self._assign(configs),
                    b,
                    m,
                    n,
                    self._estimate(configs, m),
                )
        return None

    def _fewest(self, stage: str, b: int, m: int, limit: float, free: int) -> StageConfig | None:
        """The configuration of ``stage`` with the fewest ranks (at most ``free``) that finishes its
        ``m`` micro-batches of ``b`` samples within ``limit`` seconds."""
        options = sorted(
            (dp * u * r, dp, u, r)
            for dp in self._replica_counts(stage, b)
            for u, r in self._sp_options(stage)
            if dp * u * r <= free
        )
        c = self.w.costs[stage]
        flops = c.forward_flops + (c.backward_flops if stage in self.w.backward else 0.0)
        rate = max(self.model.rate(stage, "forward"), self.model.rate(stage, "backward"))
        for _, dp, u, r in options:
            if m * -(-b // dp) * flops / (u * r) / rate > limit:
                continue  # even its compute alone is too slow
            cfg = self.best_config(stage, b, dp, m, sp=[(u, r)])
            if cfg is not None and m * cfg.time <= limit:
                return cfg
        return None

    def _front(self, stage: str, b: int, m: int) -> list[StageConfig]:
        """Pareto front (fewer ranks, less time) of the stage's fitting configurations."""
        options = []
        sp = self._sp_options(stage)
        for dp in self._replica_counts(stage, b):
            for u, r in sp:
                if dp * u * r > self.cluster.world_size:
                    continue
                cfg = self.best_config(stage, b, dp, m, sp=[(u, r)])
                if cfg is not None:
                    options.append(cfg)
        options.sort(key=lambda c: (c.ranks, c.time))
        front: list[StageConfig] = []
        for c in options:
            if not front or c.time < front[-1].time:
                front.append(c)
        return front

    def _balance(self, fronts: Mapping[str, list[StageConfig]], b: int, m: int) -> Candidate | None:
        """Smallest step time whose per-stage rank needs fit the cluster (binary search)."""
        n = self.cluster.world_size
        times = sorted({self._stage_step(c, m) for f in fronts.values() for c in f})
        chosen: dict[str, StageConfig] | None = None
        lo, hi = 0, len(times) - 1
        while lo <= hi:
            mid = (lo + hi) // 2
            pick = self._pick(fronts, times[mid], m)
            if pick is not None and sum(c.ranks for c in pick.values()) <= n:
                chosen, hi = pick, mid - 1
            else:
                lo = mid + 1
        if chosen is None:
            return None
        chosen = self._spend_leftover(fronts, chosen, m)
        ranks = self._assign(chosen)
        return Candidate("disaggregated", "disaggregated", chosen, ranks, b, m, n, self._estimate(chosen, m))

    def _stage_step(self, c: StageConfig, m: int) -> float:
        return m * c.time

    def _pick(self, fronts: Mapping[str, list[StageConfig]], limit: float, m: int) -> dict[str, StageConfig] | None:
        pick = {}
        for s, front in fronts.items():
            ok = [c for c in front if self._stage_step(c, m) <= limit]
            if not ok:
                return None
            pick[s] = ok[0]  # fewest ranks
        return pick

    def _spend_leftover(
        self, fronts: Mapping[str, list[StageConfig]], chosen: dict[str, StageConfig], m: int
    ) -> dict[str, StageConfig]:
        """Give unused ranks to the slowest stage while that shortens the step."""
        n = self.cluster.world_size
        chosen = dict(chosen)
        while True:
            slowest = max(chosen, key=lambda s: self._stage_step(chosen[s], m))
            free = n - sum(c.ranks for c in chosen.values())
            cur = chosen[slowest]
            better = [
                c for c in fronts[slowest] if c.ranks > cur.ranks and c.ranks - cur.ranks <= free and c.time < cur.time
            ]
            if not better:
                return chosen
            chosen[slowest] = min(better, key=lambda c: c.time)

    def _assign(self, chosen: Mapping[str, StageConfig]) -> dict[str, tuple[int, ...]]:
        """Contiguous groups: sequence-parallel groups first, on level boundaries."""
        out, at = {}, 0
        for s in sorted(chosen, key=lambda s: (-chosen[s].ulysses * chosen[s].ring, self.w.order.index(s))):
            out[s] = tuple(range(at, at + chosen[s].ranks))
            at += chosen[s].ranks
        return {s: out[s] for s in self.w.order}

    def _estimate(self, configs: Mapping[str, StageConfig], m: int) -> float:
        frozen = [m * c.time for s, c in configs.items() if s not in self.w.backward]
        chain = [c.time for s, c in configs.items() if s in self.w.backward]
        train = sum(chain) + (m - 1) * max(chain) if chain else 0.0  # 1F1B: fill + steady state
        train += max((c.sync_s for c in configs.values()), default=0.0)
        return max([*frozen, train])

    # -- bundles: several stages sharing a group ------------------------------------------------
    def bundled(self) -> list[Candidate | None]:
        """Hybrid layouts: the stages partitioned into bundles, each bundle on its own contiguous
        group with its stages time-sliced there (e.g. the VAE alone, text encoder + DiT together).
        Searched on clusters of up to ``BUNDLE_MAX_DEVICES`` devices."""
        n = self.cluster.world_size
        if n > BUNDLE_MAX_DEVICES or len(self.w.order) > 5:
            return []
        out: list[Candidate | None] = []
        for partition in _partitions(list(self.w.order)):
            if len(partition) in (1, len(self.w.order)) or len(partition) > n:
                continue  # all in one group is the colocated layout; all apart the disaggregated one
            for b in self._micro_batch_sizes():
                m = self.w.global_batch // b
                fronts = [self._bundle_front(tuple(bundle), b, m) for bundle in partition]
                if all(fronts):
                    out.append(self._balance_bundles(fronts, b, m))
        return out

    def _bundle_front(self, bundle: tuple[str, ...], b: int, m: int) -> list[tuple[int, float, dict[str, StageConfig]]]:
        """(ranks, seconds per micro-batch, configs) of the bundle's fitting layouts, Pareto-pruned."""
        main = max(bundle, key=self.w.model_flops)
        options = []
        for dp_main in _divisors(b):
            for u, r in self._sp_options(main):
                g = dp_main * u * r
                if g > self.cluster.world_size:
                    continue
                configs: dict[str, StageConfig] = {}
                reserved = 0.0
                # frozen members first: their weights stay resident while the others train
                for s in sorted(bundle, key=lambda s: (s in self.w.backward, s == main)):
                    sps = [(u, r)] if s == main else [(a, c) for a, c in self._sp_options(s) if g % (a * c) == 0]
                    best: StageConfig | None = None
                    for a, c in sps:
                        dp = g // (a * c)
                        if dp in self._replica_counts(s, b):
                            cfg = self.best_config(s, b, dp, m, sp=[(a, c)], reserved=reserved)
                            if cfg is not None and (best is None or cfg.time < best.time):
                                best = cfg
                    if best is None:
                        break
                    configs[s] = best
                    reserved = best.memory  # cumulative: each member's memory includes those before it
                else:
                    options.append((g, sum(c.time for c in configs.values()), configs))
        options.sort(key=lambda o: (o[0], o[1]))
        front: list[tuple[int, float, dict[str, StageConfig]]] = []
        for o in options:
            if not front or o[1] < front[-1][1]:
                front.append(o)
        return front

    def _balance_bundles(
        self, fronts: list[list[tuple[int, float, dict[str, StageConfig]]]], b: int, m: int
    ) -> Candidate | None:
        n = self.cluster.world_size
        times = sorted({m * t for f in fronts for _, t, _ in f})
        chosen: list[tuple[int, float, dict[str, StageConfig]]] | None = None
        lo, hi = 0, len(times) - 1
        while lo <= hi:
            mid = (lo + hi) // 2
            pick = [next((o for o in f if m * o[1] <= times[mid]), None) for f in fronts]
            fit = [o for o in pick if o is not None]
            if len(fit) == len(fronts) and sum(o[0] for o in fit) <= n:
                chosen, hi = fit, mid - 1
            else:
                lo = mid + 1
        if chosen is None:
            return None
        configs: dict[str, StageConfig] = {}
        ranks: dict[str, tuple[int, ...]] = {}
        at = 0
        order = sorted(chosen, key=lambda o: -max(c.ulysses * c.ring for c in o[2].values()))
        for g, _, members in order:
            group = tuple(range(at, at + g))
            for s, c in members.items():
                configs[s], ranks[s] = c, group
            at += g
        configs = {s: configs[s] for s in self.w.order}
        ranks = {s: ranks[s] for s in self.w.order}
        return Candidate("bundled", "bundled", configs, ranks, b, m, n, self._estimate_shared(configs, ranks, m))

    def _estimate_shared(
        self, configs: Mapping[str, StageConfig], ranks: Mapping[str, tuple[int, ...]], m: int
    ) -> float:
        """Step time of groups that may host several stages: their per-micro-batch times add."""
        groups: dict[tuple[int, ...], list[str]] = {}
        for s in self.w.order:
            groups.setdefault(ranks[s], []).append(s)
        frozen: list[float] = []
        chain: list[float] = []
        for members in groups.values():
            t = sum(configs[s].time for s in members)
            (chain if any(s in self.w.backward for s in members) else frozen).append(t)
        train = sum(chain) + (m - 1) * max(chain) if chain else 0.0
        train += max((c.sync_s for c in configs.values()), default=0.0)
        return max([m * t for t in frozen] + [train])

    # -- colocated ------------------------------------------------------------------------------
    def colocated(self, *, sequence_parallel: bool, turns: bool = True) -> list[Candidate | None]:
        """One colocated candidate per micro-batch size (``turns``: frozen replicas may take turns
        over the step's micro-batches, with sequence parallelism only)."""
        out = []
        n = self.cluster.world_size
        for b in self._micro_batch_sizes():
            m = self.w.global_batch // b
            cand = self._colocated(b, m, n, sequence_parallel, turns)
            if cand is None and not sequence_parallel and b < n and self.w.global_batch < n:
                continue
            out.append(cand)
        if not sequence_parallel and not any(out):
            # Data parallelism only but fewer samples than ranks: the baseline uses as many ranks as samples.
            g = self.w.global_batch
            out = [self._colocated(b, g // b, _largest_divisor_le(b, n), False) for b in self._micro_batch_sizes()]
        return out

    def _colocated(self, b: int, m: int, ranks: int, sequence_parallel: bool, turns: bool = True) -> Candidate | None:
        """Stages on backward paths take all ``ranks`` (their own dp x sequence split); frozen stages
        run data parallel on every rank (sequential baseline) or, with sequence parallelism, on one
        rank per replica of the trainable layout, or (``turns``) on every rank taking turns over the
        micro-batches. Each stage takes its fastest configuration that leaves the later stages room:
        weights of every stage live on the ranks, the trainable stages' activations come last."""
        order = sorted(self.w.order, key=lambda s: s in self.w.backward)

        def options(s: str, reserved: float) -> list[StageConfig]:
            found: list[StageConfig] = []
            for u, r in self._sp_options(s) if sequence_parallel else [(1, 1)]:
                dps = [ranks // (u * r)] if ranks % (u * r) == 0 else []
                if sequence_parallel:  # a stage may also run on one rank (or sp group) per replica
                    dps = [d for d in _divisors(ranks) if d * u * r <= ranks and ranks % (d * u * r) == 0]
                for dp in dps:
                    # A frozen stage may take more replicas than the micro-batch has samples: they
                    # take turns over the step's micro-batches (DeviceGroup.rows), evenly when they
                    # divide the step's samples.
                    taking_turns = (
                        turns and sequence_parallel and s not in self.w.backward and dp > b and (m * b) % dp == 0
                    )
                    if b % dp and not taking_turns:
                        continue
                    cfg = self.best_config(s, b, dp, m, sp=[(u, r)], reserved=reserved)
                    if cfg is not None:
                        found.append(cfg)
            return sorted(found, key=lambda c: per_micro_batch(c, b))

        def choose(i: int, reserved: float) -> dict[str, StageConfig] | None:
            if i == len(order):
                return {}
            s = order[i]
            failed = math.inf  # the least memory that left the later stages no room
            for cfg in options(s, reserved)[: None if i < len(order) - 1 else 1]:
                # cfg.memory includes ``reserved``: what stays on every rank for the later stages
                kept = cfg.memory if s not in self.w.backward or cfg.ranks < ranks else reserved
                if kept >= failed:
                    continue  # more memory than a choice that already failed: fails too
                rest = choose(i + 1, kept)
                if rest is not None:
                    return {s: cfg, **rest}
                failed = kept
            return None

        chosen = choose(0, 0.0)
        if chosen is None:
            return None
        groups: dict[str, tuple[int, ...]] = {}
        for s, best in chosen.items():
            stride = ranks // best.ranks
            groups[s] = tuple(
                q * stride * best.ulysses * best.ring + i
                for q in range(best.dp)
                for i in range(best.ulysses * best.ring)
            )
        configs = {s: chosen[s] for s in self.w.order}
        est = m * sum(per_micro_batch(c, b) for c in configs.values()) + sum(c.sync_s for c in configs.values())
        name = "colocated" if sequence_parallel else "colocated-sequential"
        return Candidate(
            name, "colocated", configs, {s: groups[s] for s in configs}, b, m, self.cluster.world_size, est
        )

    # -- uniform split --------------------------------------------------------------------------
    def uniform_split(self) -> Candidate | None:
        n = self.cluster.world_size
        params = {s: max(self.w.costs[s].params, 1) for s in self.w.order}
        total = sum(params.values())
        sizes = {s: max(1, int(n * p / total)) for s, p in params.items()}
        biggest = max(sizes, key=lambda s: sizes[s])
        sizes[biggest] -= sum(sizes.values()) - n
        if sizes[biggest] < 1:
            return None
        best: Candidate | None = None
        for b in self._micro_batch_sizes():
            m = self.w.global_batch // b
            configs = {}
            for s in self.w.order:
                front = [c for c in self._front(s, b, m) if c.ranks <= sizes[s]]
                if not front:
                    break
                configs[s] = min(front, key=lambda c: c.time)
            else:
                cand = Candidate("uniform split", "disaggregated", configs, {}, b, m, n, self._estimate(configs, m))
                cand = dataclasses.replace(cand, ranks=self._assign(configs))
                if best is None or cand.estimate < best.estimate:
                    best = cand
        return best

    # -- evaluation -----------------------------------------------------------------------------
    def evaluate(self, cand: Candidate, name: str | None = None, *, exact: bool = False) -> PlanResult:
        """Simulate a reduced plan of ``cand`` (``exact``: the whole plan; the analytic estimate
        when neither is possible)."""
        if name is not None:
            cand = dataclasses.replace(cand, name=name)
        step, simulated, bubbles = cand.estimate, False, {}
        reduced = cand if exact else _reduce(cand)
        if reduced is not None and reduced.world_size <= 512 and self.simulate_top:
            plan = build_plan(
                self.w.graph,
                reduced.placement(),
                reduced.micro_batches,
                world_size=reduced.world_size,
                batch=reduced.micro_batch,
            )
            durations = self._durations(reduced)
            sim = simulate(plan, durations, steps=4)
            step, simulated = sim.step_time, True
            if self.model.calibrated is not None:
                step += self.model.calibrated.step_overhead_s  # metrics, logging: once per step
            by_rank = bubble_fractions(sim.events, first_step=3)
            groups = plan.groups
            bubbles = {s: sum(by_rank.get(r, 0.0) for r in g.ranks) / len(g.ranks) for s, g in groups.items()}
            used = sorted({r for g in groups.values() for r in g.ranks})
            mean_bubble = sum(by_rank.get(r, 0.0) for r in used) / len(used)
        else:
            mean_bubble = 0.0
        g = cand.global_batch
        flops = sum(self.w.model_flops(s) for s in self.w.order) * g
        peak = self._peak_memory(cand)
        return PlanResult(
            cand,
            step,
            simulated,
            g / step,
            g * self.w.tokens_per_sample / step,
            flops / step / (self.cluster.world_size * self.cluster.peak_flops),
            mean_bubble,
            bubbles,
            peak,
            all(v <= self.model.budget for v in peak.values()),
        )

    def _peak_memory(self, cand: Candidate) -> dict[str, float]:
        """Peak bytes per rank of each stage's group: the stages sharing its ranks, frozen ones first,
        each adding its own memory to what those before it keep (in a colocated layout, a trainable
        stage spanning every rank keeps nothing for the next: its activations are freed)."""
        groups: dict[tuple[int, ...], list[str]] = {}
        for s in self.w.order:
            groups.setdefault(cand.ranks[s] if cand.layout != "colocated" else (), []).append(s)
        widest = max(c.ranks for c in cand.configs.values())
        out: dict[str, float] = {}
        for members in groups.values():
            kept = peak = 0.0
            for s in sorted(members, key=lambda s: s in self.w.backward):
                c = cand.configs[s]
                peak = max(peak, kept + c.own_memory)
                if cand.layout != "colocated" or s not in self.w.backward or c.ranks < widest:
                    kept += c.own_memory
            out |= dict.fromkeys(members, peak)
        return out

    def _durations(self, cand: Candidate) -> Any:
        cfgs = cand.configs
        costs = self.w.costs
        bw = self.cluster.network_bandwidth if cand.layout == "disaggregated" else self.cluster.levels[0].bandwidth
        latency = self.cluster.latency
        cal = self.model.calibrated
        if cal is not None and cal.latency_s is not None and cal.bandwidth:
            latency, bw = cal.latency_s, cal.bandwidth  # the measured local transport

        def cost(a: Action) -> float:
            c = cfgs[a.stage]
            if a.kind == ActionKind.F:
                return c.forward_s
            if a.kind == ActionKind.B:
                return c.backward_s + (c.sync_s if a.mb == cand.micro_batches - 1 else 0.0)
            if a.kind == ActionKind.STEP:
                return self.model.overhead(a.stage, "step_s")
            if a.kind in (ActionKind.SEND, ActionKind.SEND_GRAD):
                rows = cand.micro_batch / max(c.dp, cfgs[a.dst].dp) if a.dst else 1
                return latency + rows * costs[a.stage].output_bytes / bw
            return 0.0

        return cost


def _reduce(cand: Candidate) -> Candidate | None:
    """The same candidate with data-parallel replicas merged by their common factor ``k``: the
    plan repeats every ``world / k`` ranks, so its first period is simulated."""
    k = cand.micro_batch
    for c in cand.configs.values():
        k = math.gcd(k, c.dp)
    configs = {s: dataclasses.replace(c, dp=c.dp // k) for s, c in cand.configs.items()}
    if cand.layout == "colocated":
        size = cand.world_size // k
        if cand.world_size % k:
            return None
        ranks = {s: tuple(r for r in cand.ranks[s] if r < size) for s in configs}
        if any(len(ranks[s]) != configs[s].ranks for s in configs):
            return None
    else:  # contiguous groups, possibly shared by several stages: shrink each group k-fold
        ranks, at, new = {}, 0, {}
        for s in sorted(configs, key=lambda s: cand.ranks[s][0]):
            old = cand.ranks[s]
            if old not in new:
                new[old], at = tuple(range(at, at + len(old) // k)), at + len(old) // k
            ranks[s] = new[old]
            if len(ranks[s]) != configs[s].ranks:
                return None
        size = at
    return dataclasses.replace(cand, configs=configs, ranks=ranks, micro_batch=cand.micro_batch // k, world_size=size)


def _key(cand: Candidate) -> tuple[Any, ...]:
    """What makes two candidates the same plan (their names and estimates aside)."""
    return (
        cand.layout,
        tuple(sorted(cand.configs.items())),
        tuple(sorted(cand.ranks.items())),
        cand.micro_batch,
        cand.micro_batches,
        cand.world_size,
    )


def _complexity(cand: Candidate) -> tuple[int, float, int]:
    """What makes a plan harder to run, in order: sequence-parallel degrees, recomputed and offloaded
    fractions (each summed over stages), micro-batches."""
    configs = cand.configs.values()
    return sum(c.ulysses * c.ring for c in configs), sum(c.recompute + c.offload for c in configs), cand.micro_batches


def _distinct(cands: Iterable[Candidate]) -> list[Candidate]:
    """``cands`` without repeats (the first of each plan kept)."""
    seen: dict[tuple[Any, ...], Candidate] = {}
    for c in cands:
        seen.setdefault(_key(c), c)
    return list(seen.values())


def _partitions(items: list[str]) -> Iterator[list[list[str]]]:
    """Every partition of ``items`` into non-empty blocks (order of blocks by first item)."""
    if not items:
        yield []
        return
    first, rest = items[0], items[1:]
    for part in _partitions(rest):
        yield [[first], *part]
        for i in range(len(part)):
            yield [*part[:i], [first, *part[i]], *part[i + 1 :]]


def _divisors(n: int) -> list[int]:
    small = [d for d in range(1, int(math.isqrt(n)) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))


def _largest_divisor_le(n: int, limit: int) -> int:
    return max(d for d in _divisors(n) if d <= limit)
