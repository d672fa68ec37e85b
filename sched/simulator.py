"""Discrete-event simulation of a Plan: predicted step time, per-rank timeline and bubbles.

Each rank runs its action list in order, step after step. Compute actions (``F``, ``B``,
``STEP``) take the duration the cost function gives; a send costs its transfer time on the
sender and arrives that long after; a receive completes when its message has arrived. As in the
runtime, a sender blocks once more than ``max_inflight`` of its messages are unreceived (so
frozen producer ranks run ahead across steps by a bounded amount), and ranks holding trainable
stages meet in a per-step metrics all-reduce.

The simulated events use the runtime's event format (``mmpipe.runtime.events``), so predicted
and measured timelines can be compared with the same code.
"""

from __future__ import annotations

import dataclasses
import statistics
from collections import defaultdict, deque
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from mmpipe.errors import PlanError
from mmpipe.sched.plan import Action, ActionKind, Plan, send_window, transfer_key

CostFn = Callable[[Action], float]  # seconds an action keeps its rank busy
COMPUTE = (ActionKind.F, ActionKind.B, ActionKind.STEP)
_COMPUTE_KINDS = frozenset(k.value for k in COMPUTE)


@dataclasses.dataclass(frozen=True)
class SimResult:
    """What the simulator predicts for ``steps`` consecutive optimizer steps."""

    step_time: float  # steady-state seconds per step (mean over steps after the first)
    events: list[dict[str, Any]]
    bubble: dict[int, float]  # per rank: 1 - compute time / wall time of the steady-state steps


def simulate(plan: Plan, cost: CostFn, *, steps: int = 4, max_inflight: int | None = None) -> SimResult:
    """Run ``steps`` repetitions of every rank's list; raises :class:`PlanError` on a stall.
    ``max_inflight``: the runtime's bound on unreceived sends (default: :func:`send_window`)."""
    if steps < 2:
        raise ValueError(f"simulate needs steps >= 2 to measure a steady state, got {steps}")
    sim = _Sim(plan, cost, max_inflight or send_window(plan))
    step_ends = [sim.run_step(s) for s in range(steps)]
    step_time = (step_ends[-1] - step_ends[0]) / (steps - 1)
    return SimResult(step_time, sim.events, bubble_fractions(sim.events, first_step=2))


class _Sim:
    def __init__(self, plan: Plan, cost: CostFn, max_inflight: int) -> None:
        self.plan, self.cost, self.max_inflight = plan, cost, max_inflight
        self.clock = [0.0] * plan.world_size
        self.arrivals: dict[tuple, deque[float]] = defaultdict(deque)
        self.unreceived: list[deque[tuple]] = [deque() for _ in range(plan.world_size)]
        self.received: set[tuple] = set()
        self.events: list[dict[str, Any]] = []
        trainable = {r for s, g in plan.placement if s in plan.trainable for r in g.ranks}
        self.metrics_ranks = sorted(trainable) or list(range(plan.world_size))

    def run_step(self, step: int) -> float:
        pos = [0] * self.plan.world_size
        progress = True
        while progress:
            progress = False
            for rank, acts in enumerate(self.plan.actions):
                while pos[rank] < len(acts) and self._try(rank, acts[pos[rank]], step):
                    pos[rank] += 1
                    progress = True
        stuck = {r: p for r, p in enumerate(pos) if p < len(self.plan.actions[r])}
        if stuck:
            raise PlanError(f"simulation stalled in step {step}\n{self.plan.format_table(stuck)}")
        end = max(self.clock[r] for r in self.metrics_ranks)  # the per-step metrics all-reduce
        for r in self.metrics_ranks:
            self.clock[r] = end
        return end

    def _try(self, rank: int, a: Action, step: int) -> bool:
        start = self.clock[rank]
        if a.kind in (ActionKind.RECV, ActionKind.RECV_GRAD):
            key = (step, *transfer_key(rank, a))
            if not self.arrivals[key]:
                return False
            start = max(start, self.arrivals[key].popleft())
            self.received.add(key)
            end = start
        elif a.kind in (ActionKind.SEND, ActionKind.SEND_GRAD):
            # received messages leave the window wherever they are in it, as in the runtime
            pending = self.unreceived[rank] = deque(k for k in self.unreceived[rank] if k not in self.received)
            if len(pending) >= self.max_inflight:
                return False  # blocked until the oldest message is received
            end = start + self.cost(a)
            key = (step, *transfer_key(rank, a))
            self.arrivals[key].append(end)
            pending.append(key)
        else:
            end = start + self.cost(a)
        self.clock[rank] = end
        self.events.append(_event(rank, step, a, start, end))
        return True


def _event(rank: int, step: int, a: Action, start: float, end: float) -> dict[str, Any]:
    return {
        "rank": rank,
        "step": step + 1,
        "phase": "train",
        "stage": a.stage,
        "dst": a.dst,
        "peer": a.peer,
        "mb": a.mb,
        "kind": a.kind.value,
        "start": start,
        "end": end,
        "bytes": 0,
    }


def bubble_fractions(events: Iterable[Mapping[str, Any]], *, first_step: int = 1) -> dict[int, float]:
    """Per rank: 1 - compute time / wall time over training steps >= ``first_step`` (runtime or simulated events)."""
    steady = [e for e in events if e["phase"] == "train" and e["step"] >= first_step]
    if not steady:
        return {}
    start, end = min(e["start"] for e in steady), max(e["end"] for e in steady)
    busy: dict[int, float] = defaultdict(float)
    for e in steady:
        busy[e["rank"]] += (e["end"] - e["start"]) if e["kind"] in _COMPUTE_KINDS else 0.0
    return {r: 1 - busy[r] / (end - start) for r in sorted({e["rank"] for e in steady})}


def measured_step_time(events: Iterable[Mapping[str, Any]], *, first_step: int, last_step: int) -> float:
    """Seconds per training step between the ends of ``first_step`` and ``last_step`` (any rank)."""
    end: dict[int, float] = defaultdict(float)
    for e in events:
        if e["phase"] == "train":
            end[e["step"]] = max(end[e["step"]], e["end"])
    return (end[last_step] - end[first_step]) / (last_step - first_step)


def calibrate(events: Iterable[Mapping[str, Any]], *, first_step: int = 2) -> CostFn:
    """A cost function from measured events: the median duration per (stage, kind) for compute
    actions and per (edge, kind) for sends; receives cost nothing of their own (they wait)."""
    samples: dict[tuple, list[float]] = defaultdict(list)
    for e in events:
        if e["phase"] == "train" and e["step"] >= first_step:
            samples[(e["stage"], e["dst"], e["kind"])].append(e["end"] - e["start"])
    table = {k: statistics.median(v) for k, v in samples.items()}

    def cost(a: Action) -> float:
        return table.get((a.stage, a.dst, a.kind.value), 0.0)

    return cost
