"""Schedule generation: a placement of a graph's stages -> every rank's ordered action list.

Each rank runs, per micro-batch, a *forward unit* (receive the inputs of its stages, run their
forwards in topological order, send the outputs) and, for stages on the backward path, a
*backward unit* in reverse order (receive output gradients, backward, send input gradients).
``gpipe`` runs all forward units then all backward units; ``1f1b`` runs ``depth + 1`` forward
units first (``depth``: how many rank hops the rank is from the end of the backward path) and then
alternates one backward and one forward unit, which bounds the activations held per rank. Ranks
that only host frozen stages run their forward units back to back: frozen producers run ahead of
the trainable consumers, bounded at run time by the number of unfinished sends. Ranks that host
both run their frozen stages' forward units for every micro-batch first, then the trained ones.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from typing import Protocol

import networkx as nx

from mmpipe.errors import PlanError
from mmpipe.sched.plan import Action, ActionKind, DeviceGroup, Plan, overlapping_ranks


class ScheduleKind(enum.StrEnum):
    """Micro-batch orders across groups."""

    GPIPE = "gpipe"
    ONE_F_ONE_B = "1f1b"


class StageInfo(Protocol):
    """What the generator needs of a stage: its name and whether it is frozen."""

    name: str
    frozen: bool


class GraphInfo(Protocol):
    """What the generator needs of a graph (``mmpipe.Graph`` satisfies it)."""

    @property
    def stages(self) -> Mapping[str, StageInfo]: ...

    def topological_order(self) -> list[str]: ...

    def stage_edges(self) -> list[tuple[str, str]]: ...


def backward_stages(graph: GraphInfo) -> frozenset[str]:
    """Stages that run a backward: trainable ones and every stage downstream of one."""
    edges = graph.stage_edges()
    g = nx.DiGraph(edges)
    g.add_nodes_from(graph.stages)
    trainable = [n for n, s in graph.stages.items() if not s.frozen]
    out = set(trainable)
    for n in trainable:
        out |= nx.descendants(g, n)
    return frozenset(out)


def build_plan(
    graph: GraphInfo,
    placement: Mapping[str, DeviceGroup],
    micro_batches: int,
    *,
    world_size: int,
    schedule: ScheduleKind = ScheduleKind.ONE_F_ONE_B,
    train: bool = True,
    batch: int = 0,
) -> Plan:
    """The plan of ``graph`` under ``placement``; ``train=False`` gives a forward-only plan.
    ``batch``: samples per micro-batch, which lets frozen groups split it unequally."""
    missing = sorted(set(graph.stages) - set(placement))
    unknown = sorted(set(placement) - set(graph.stages))
    if missing or unknown:
        raise PlanError(f"placement must name every stage once: missing {missing}, unknown {unknown}")
    if micro_batches <= 0:
        raise PlanError(f"micro_batches must be positive, got {micro_batches}")
    edges = tuple(dict.fromkeys(graph.stage_edges()))
    order = graph.topological_order()
    backward = backward_stages(graph) if train else frozenset()
    trainable = frozenset(n for n, s in graph.stages.items() if not s.frozen) if train else frozenset()
    skeleton = Plan(
        world_size, tuple((n, placement[n]) for n in order), micro_batches, (), edges, backward, trainable, batch
    )
    depth = _rank_depths(skeleton, world_size)
    actions = tuple(tuple(_rank_actions(skeleton, r, order, depth.get(r), schedule)) for r in range(world_size))
    plan = Plan(world_size, skeleton.placement, micro_batches, actions, edges, backward, trainable, batch)
    plan.validate()
    return plan


def _forward_unit(plan: Plan, rank: int, local: Sequence[str], mb: int) -> list[Action]:
    groups, out = plan.groups, []
    for s in local:
        if not groups[s].holds(rank, plan.batch, mb):
            continue  # a frozen replica with no row of this micro-batch
        for p in plan.producers(s):
            out += [
                Action(p, ActionKind.RECV, mb, s, q)
                for q in overlapping_ranks(groups[s], rank, groups[p], plan.batch, mb)
                if q != rank
            ]
        out.append(Action(s, ActionKind.F, mb))
        for c in plan.consumers(s):
            out += [
                Action(s, ActionKind.SEND, mb, c, q)
                for q in overlapping_ranks(groups[s], rank, groups[c], plan.batch, mb)
                if q != rank
            ]
    return out


def _backward_unit(plan: Plan, rank: int, local: Sequence[str], mb: int) -> list[Action]:
    groups, out = plan.groups, []
    for s in reversed([s for s in local if s in plan.backward]):
        for c in (c for c in plan.consumers(s) if c in plan.backward):
            peers = overlapping_ranks(groups[s], rank, groups[c], plan.batch, mb)
            out += [Action(s, ActionKind.RECV_GRAD, mb, c, q) for q in peers if q != rank]
        out.append(Action(s, ActionKind.B, mb))
        for p in (p for p in plan.producers(s) if p in plan.backward):
            peers = overlapping_ranks(groups[s], rank, groups[p], plan.batch, mb)
            out += [Action(p, ActionKind.SEND_GRAD, mb, s, q) for q in peers if q != rank]
    return out


def _rank_actions(
    plan: Plan, rank: int, order: Sequence[str], depth: int | None, schedule: ScheduleKind
) -> list[Action]:
    local = [s for s in order if rank in plan.groups[s]]
    n = plan.micro_batches
    # A rank that also trains runs its frozen stages' forwards for every micro-batch first (frozen
    # stages never depend on a trained one): a frozen stage whose replicas take turns over the
    # micro-batches (more replicas than rows) then encodes all its turns while its sequence-parallel
    # peers do the same, instead of stalling them in the middle of the trained stages' schedule.
    ahead: list[Action] = []
    if any(s in plan.backward for s in local) and not all(s in plan.backward for s in local):
        frozen = [s for s in local if s not in plan.backward]
        ahead = [a for m in range(n) for a in _forward_unit(plan, rank, frozen, m)]
        local = [s for s in local if s in plan.backward]
    fwd = [_forward_unit(plan, rank, local, m) for m in range(n)]
    bwd = [_backward_unit(plan, rank, local, m) for m in range(n)]
    has_backward = any(bwd)
    if schedule == ScheduleKind.GPIPE or depth is None or not has_backward:
        units = [ahead, *fwd, *bwd]
    else:
        warm = min(n, depth + 1)
        units = [ahead, *fwd[:warm]]
        for m in range(n):
            units.append(bwd[m])
            if m + warm < n:
                units.append(fwd[m + warm])
    steps = [Action(s, ActionKind.STEP) for s in local if s in plan.trainable]
    return [a for unit in units for a in unit] + steps


def _rank_depths(plan: Plan, world_size: int) -> dict[int, int]:
    """Hops from each rank to the end of the backward path (empty when rank hops form a cycle)."""
    g = nx.DiGraph()
    g.add_nodes_from(range(world_size))
    groups = plan.groups
    for p, c in plan.edges:
        if p in plan.backward and c in plan.backward:  # ranks exchanging activations and gradients
            for a in groups[p].ranks:
                g.add_edges_from((a, b) for b in overlapping_ranks(groups[p], a, groups[c], plan.batch) if a != b)
    if not nx.is_directed_acyclic_graph(g):
        return {}
    depth: dict[int, int] = {}
    for r in reversed(list(nx.topological_sort(g))):
        depth[r] = max((depth[q] + 1 for q in g.successors(r)), default=0)
    # Ranks of one collective group (an FSDP-sharded or sequence-parallel stage on the backward
    # path) must run its forwards and backwards in the same order (its collectives match by
    # order), so they take the same depth, the deepest of them. A rank then stays at least as deep
    # as the ranks it sends to (one hop deeper is what keeps 1F1B's pipeline full; as deep is what
    # keeps it free of deadlock). Depths only grow, bounded by the deepest, so this ends.
    synced = [grp.ranks for stage, grp in plan.placement if stage in plan.backward and len(grp.ranks) > 1]
    changed = bool(synced)
    while changed:
        changed = False
        for ranks in synced:
            deepest = max(depth[r] for r in ranks)
            for r in ranks:
                if depth[r] < deepest:
                    depth[r], changed = deepest, True
        for a, b in g.edges:
            if depth[a] < depth[b]:
                depth[a], changed = depth[b], True
    return depth
