"""The plan IR: placement of stages on device groups plus every rank's ordered action list.

A plan is plain, frozen data with a text form that round-trips (``Plan.to_text`` /
``Plan.from_text``). Actions (``rank`` is implied by the list they sit in)::

    dit:F:mb3              forward of stage ``dit`` on micro-batch 3
    dit:B:mb3              backward of it
    text->dit:SEND:mb3@r1  send text's outputs consumed by dit (this rank's rows of them) to rank 1
    text->dit:RECV:mb3@r0  receive them from rank 0
    text->dit:SENDG:mb3@r0 send the gradients of dit's inputs fed by text back to rank 0
    text->dit:RECVG:mb3@r1 receive those gradients from rank 1
    dit:STEP               clip gradients and step dit's optimizer

``Plan.validate`` checks ranks, placement, send/receive pairing and dependencies by a dry run of
all action lists (a send never blocks, a receive waits for its send, an action that runs a
collective waits for every rank of its group to reach it: see :func:`collective_ranks`); a failure raises
:class:`PlanError` whose message is the rank x step table with ``<-- ERROR HERE`` at the action
that could not run.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import re
from collections import Counter
from collections.abc import Mapping, Sequence

from mmpipe.errors import PlanError


class ActionKind(enum.StrEnum):
    """What one action of a rank does."""

    F = "F"
    B = "B"
    SEND = "SEND"
    RECV = "RECV"
    SEND_GRAD = "SENDG"
    RECV_GRAD = "RECVG"
    STEP = "STEP"


SENDS = (ActionKind.SEND, ActionKind.SEND_GRAD)
RECVS = (ActionKind.RECV, ActionKind.RECV_GRAD)
TRANSFERS = SENDS + RECVS

_ACTION_RE = re.compile(
    r"^(?P<stage>[^:>\s-]+)(?:->(?P<dst>[^:\s]+))?:(?P<kind>[A-Z]+)(?::mb(?P<mb>\d+))?(?:@r(?P<peer>\d+))?$"
)


@dataclasses.dataclass(frozen=True)
class Action:
    """One step of a rank's list. Transfers name the edge bundle ``stage -> dst`` and the peer rank."""

    stage: str
    kind: ActionKind
    mb: int | None = None
    dst: str | None = None
    peer: int | None = None

    def __str__(self) -> str:
        name = f"{self.stage}->{self.dst}" if self.dst is not None else self.stage
        mb = f":mb{self.mb}" if self.mb is not None else ""
        peer = f"@r{self.peer}" if self.peer is not None else ""
        return f"{name}:{self.kind.value}{mb}{peer}"

    @classmethod
    def parse(cls, text: str) -> Action:
        """The inverse of ``str(action)``."""
        m = _ACTION_RE.match(text.strip())
        if m is None:
            raise PlanError(f"cannot parse action {text!r} (expected e.g. 'dit:F:mb0' or 'text->dit:SEND:mb0@r1')")
        try:
            kind = ActionKind(m["kind"])
        except ValueError:
            raise PlanError(f"unknown action kind {m['kind']!r} in {text!r}") from None
        mb = int(m["mb"]) if m["mb"] is not None else None
        peer = int(m["peer"]) if m["peer"] is not None else None
        action = cls(m["stage"], kind, mb, m["dst"], peer)
        action.check_form()
        return action

    def check_form(self) -> None:
        """Transfers carry ``dst``, ``mb`` and ``peer``; F/B carry ``mb``; STEP carries nothing."""
        is_transfer = self.kind in TRANSFERS
        ok = (self.dst is not None and self.peer is not None) == is_transfer and (
            (self.mb is None) == (self.kind == ActionKind.STEP)
        )
        if not ok:
            raise PlanError(f"malformed action {self}")


@dataclasses.dataclass(frozen=True)
class DeviceGroup:
    """The ranks a stage runs on: ``dp`` data-parallel replicas (FSDP2-sharded for trainable stages)
    that split each micro-batch, each replica ``ulysses x ring`` consecutive ranks that split its
    sequence; ``recompute`` / ``offload``: the fractions of the stage's blocks whose activations are
    recomputed in backward / offloaded to host memory (of the blocks that are kept); ``gather_once``:
    an FSDP-sharded trainable stage gathers its parameters once per step and keeps them until the
    step's last backward (instead of gathering them for every micro-batch's forward and backward);
    ``blocks``: an explicit policy per repeated block, one letter each (``k`` keep, ``o`` offload,
    ``r`` recompute, ``s`` selective recompute), which the runtime applies instead of the fractions
    (these then count the blocks for the cost model); ``replicate``: a trainable stage keeps whole
    parameters and optimizer state on every rank of the group and all-reduces its gradients once
    per step (DDP) instead of sharding them (FSDP2): for a model small enough that sharding saves
    memory nobody needs and costs a gather per forward and sharded tensors in the optimizer step."""

    ranks: tuple[int, ...]
    dp: int = 1
    ulysses: int = 1
    ring: int = 1
    recompute: float = 0.0
    offload: float = 0.0
    gather_once: bool = False
    blocks: str = ""
    replicate: bool = False

    def __post_init__(self) -> None:
        if self.blocks.strip("kors"):
            raise PlanError(f"device group {list(self.ranks)}: blocks={self.blocks!r} may hold only k, o, r and s")
        if not self.ranks or len(set(self.ranks)) != len(self.ranks):
            raise PlanError(f"device group ranks must be distinct and non-empty, got {list(self.ranks)}")
        if min(self.dp, self.ulysses, self.ring) < 1:
            raise PlanError(f"device group {list(self.ranks)}: dp, ulysses and ring must be >= 1")
        if self.dp * self.sp != len(self.ranks):
            raise PlanError(
                f"device group {list(self.ranks)}: dp={self.dp} x ulysses={self.ulysses} x ring={self.ring} "
                f"must equal its number of ranks ({len(self.ranks)})"
            )
        for key in ("recompute", "offload"):
            if not 0.0 <= getattr(self, key) <= 1.0:
                raise PlanError(f"device group {list(self.ranks)}: {key}={getattr(self, key)} must be in [0, 1]")
        if self.replicate and self.gather_once:
            raise PlanError(
                f"device group {list(self.ranks)}: gather_once applies to sharded (FSDP) parameters; "
                "a replicated group keeps them whole (replicate and gather_once exclude each other)"
            )

    @property
    def sp(self) -> int:
        """Sequence-parallel degree: ranks per replica."""
        return self.ulysses * self.ring

    @functools.cached_property
    def _index(self) -> dict[int, int]:
        return {r: i for i, r in enumerate(self.ranks)}

    def __contains__(self, rank: object) -> bool:
        """Whether ``rank`` is in the group (constant time)."""
        return rank in self._index

    def replica(self, rank: int) -> int:
        """The data-parallel replica ``rank`` belongs to (replicas are ``sp`` consecutive ranks)."""
        return self._index[rank] // self.sp

    def sp_index(self, rank: int) -> int:
        """``rank``'s position inside its replica (the sequence-parallel index)."""
        return self._index[rank] % self.sp

    def rows(self, rank: int, batch: int, mb: int = 0) -> tuple[int, int]:
        """The rows ``[start, stop)`` of micro-batch ``mb`` (of ``batch`` samples) that ``rank`` holds:
        equal shares, or when ``dp`` does not divide ``batch`` (frozen stages only), shares that differ
        by one row (empty when ``dp > batch``) and rotate over the replicas from one micro-batch to
        the next, so that over ``dp`` micro-batches every replica encodes the same number of samples."""
        i = self.replica(rank)
        if batch % self.dp:
            i = (i + mb) % self.dp
        return i * batch // self.dp, (i + 1) * batch // self.dp

    def holds(self, rank: int, batch: int, mb: int) -> bool:
        """Whether ``rank`` holds any row of micro-batch ``mb`` (a replica may hold none when ``dp > batch``)."""
        lo, hi = self.rows(rank, batch, mb)
        return hi > lo or not batch

    def __str__(self) -> str:
        return f"ranks=[{format_ranks(self.ranks)}] {self.options()}"

    def options(self) -> str:
        """``dp=.. [ulysses=..] [ring=..] [recompute=..] [offload=..] [gather_once=1] [blocks=..]
        [replicate=1]`` (non-default ones)."""
        out = [f"dp={self.dp}"]
        out += [f"{k}={getattr(self, k)}" for k in ("ulysses", "ring") if getattr(self, k) != 1]
        out += [f"{k}={getattr(self, k):g}" for k in ("recompute", "offload") if getattr(self, k)]
        out += ["gather_once=1"] if self.gather_once else []
        out += [f"blocks={self.blocks}"] if self.blocks else []
        out += ["replicate=1"] if self.replicate else []
        return " ".join(out)


# The options of a device group besides its ranks (a plan's ``place`` line, a placement's keys).
GROUP_OPTIONS = frozenset(f.name for f in dataclasses.fields(DeviceGroup)) - {"ranks"}


def format_ranks(ranks: Sequence[int], *, max_runs: int | None = None) -> str:
    """``0-3,8`` for ranks 0, 1, 2, 3, 8; with more than ``max_runs`` runs, ``first,...,last (count)``."""
    runs: list[list[int]] = []
    for r in ranks:
        if runs and r == runs[-1][1] + 1:
            runs[-1][1] = r
        else:
            runs.append([r, r])
    parts = [f"{a}" if a == b else f"{a}-{b}" for a, b in runs]
    if max_runs is not None and len(parts) > max_runs:
        return f"{parts[0]},...,{parts[-1]} ({len(ranks)})"
    return ",".join(parts)


@dataclasses.dataclass(frozen=True)
class Plan:
    """Placement, micro-batch count and one ordered action list per rank."""

    world_size: int
    placement: tuple[tuple[str, DeviceGroup], ...]
    micro_batches: int
    actions: tuple[tuple[Action, ...], ...]
    edges: tuple[tuple[str, str], ...] = ()  # stage-level producer -> consumer
    backward: frozenset[str] = frozenset()  # stages that run B (trainable, or between trainable ones)
    trainable: frozenset[str] = frozenset()  # stages that STEP an optimizer
    batch: int = 0  # samples per micro-batch; 0: not fixed (every group then splits it evenly)

    def producers(self, stage: str) -> list[str]:
        """Stages feeding ``stage``."""
        return self._neighbours[0].get(stage, [])

    def consumers(self, stage: str) -> list[str]:
        """Stages fed by ``stage``."""
        return self._neighbours[1].get(stage, [])

    @functools.cached_property
    def _neighbours(self) -> tuple[dict[str, list[str]], dict[str, list[str]]]:
        producers: dict[str, list[str]] = {}
        consumers: dict[str, list[str]] = {}
        for p, c in self.edges:
            producers.setdefault(c, []).append(p)
            consumers.setdefault(p, []).append(c)
        return producers, consumers

    @functools.cached_property
    def groups(self) -> dict[str, DeviceGroup]:
        """``stage -> DeviceGroup``."""
        return dict(self.placement)

    def stages_on(self, rank: int) -> list[str]:
        """Stages placed on ``rank`` (placement order)."""
        return [s for s, g in self.placement if rank in g]

    # ---- text form ----------------------------------------------------------------------------
    def to_text(self) -> str:
        """A line-oriented form that :meth:`from_text` parses back to an equal plan."""
        lines = [f"world_size {self.world_size}", f"micro_batches {self.micro_batches}"]
        lines += [f"batch {self.batch}"] if self.batch else []
        lines += [f"place {s} ranks={','.join(map(str, g.ranks))} {g.options()}" for s, g in self.placement]
        lines += [f"edge {p}->{c}" for p, c in self.edges]
        lines += [f"backward {s}" for s in sorted(self.backward)]
        lines += [f"trainable {s}" for s in sorted(self.trainable)]
        lines += [f"rank {r}: " + " ".join(map(str, acts)) for r, acts in enumerate(self.actions)]
        return "\n".join(lines) + "\n"

    @classmethod
    def from_text(cls, text: str) -> Plan:
        """Parse :meth:`to_text`'s output."""
        world = micro = None
        batch = 0
        placement: list[tuple[str, DeviceGroup]] = []
        edges: list[tuple[str, str]] = []
        sets: dict[str, set[str]] = {"backward": set(), "trainable": set()}
        actions: dict[int, tuple[Action, ...]] = {}
        for n, line in enumerate(text.splitlines(), 1):
            head, _, rest = line.strip().partition(" ")
            if not head:
                continue
            if head == "world_size":
                world = int(rest)
            elif head == "micro_batches":
                micro = int(rest)
            elif head == "batch":
                batch = int(rest)
            elif head == "place":
                m = re.fullmatch(r"(\S+) ranks=([\d,]+)((?: \w+=[\w.]+)*)", rest)
                if m is None:
                    raise PlanError(f"line {n}: bad placement {line!r}")
                opts = dict(kv.split("=") for kv in m[3].split())
                unknown = set(opts) - GROUP_OPTIONS
                if unknown:
                    raise PlanError(f"line {n}: unknown placement options {sorted(unknown)}")
                group = DeviceGroup(
                    tuple(int(r) for r in m[2].split(",")),
                    dp=int(opts.get("dp", 1)),
                    ulysses=int(opts.get("ulysses", 1)),
                    ring=int(opts.get("ring", 1)),
                    recompute=float(opts.get("recompute", 0)),
                    offload=float(opts.get("offload", 0)),
                    gather_once=opts.get("gather_once", "0") == "1",
                    blocks=opts.get("blocks", ""),
                    replicate=opts.get("replicate", "0") == "1",
                )
                placement.append((m[1], group))
            elif head == "edge":
                src, _, dst = rest.partition("->")
                edges.append((src, dst))
            elif head in sets:
                sets[head].add(rest)
            elif head == "rank":
                r, _, acts = rest.partition(":")
                actions[int(r)] = tuple(Action.parse(a) for a in acts.split())
            else:
                raise PlanError(f"line {n}: unknown directive {head!r}")
        if world is None or micro is None:
            raise PlanError("plan text needs 'world_size N' and 'micro_batches N' lines")
        per_rank = tuple(actions.get(r, ()) for r in range(world))
        return cls(
            world,
            tuple(placement),
            micro,
            per_rank,
            tuple(edges),
            frozenset(sets["backward"]),
            frozenset(sets["trainable"]),
            batch,
        )

    # ---- validation ---------------------------------------------------------------------------
    def validate(self) -> None:
        """Check ranks, placement, pairing and dependencies by a dry run; raise :class:`PlanError`."""
        if len(self.actions) != self.world_size:
            raise PlanError(f"plan has {len(self.actions)} action lists for world_size {self.world_size}")
        groups = self.groups
        if len(groups) != len(self.placement):
            dup = [s for s, c in Counter(s for s, _ in self.placement).items() if c > 1]
            raise PlanError(f"stages placed more than once: {dup}")
        for stage, group in self.placement:
            bad = [r for r in group.ranks if not 0 <= r < self.world_size]
            if bad:
                raise PlanError(f"stage {stage!r} is placed on ranks {bad} outside world_size {self.world_size}")
            check_split(stage, group, self.batch or None, backward=stage in self.backward)
        for rank, acts in enumerate(self.actions):
            for step, a in enumerate(acts):
                problem = _static_problem(self, rank, a)
                if problem:
                    raise PlanError(f"rank {rank} step {step}: {a}: {problem}\n{self.format_table({rank: step})}")
        _check_complete(self)
        _dry_run(self)

    def format_table(self, marks: Mapping[int, int] | None = None) -> str:
        """The rank x step table; ``marks`` maps a rank to the step flagged ``<-- ERROR HERE``."""
        marks = marks or {}
        width = max((len(str(a)) for acts in self.actions for a in acts), default=4) + 2
        lines = ["step | " + "".join(f"rank {r}".ljust(width) for r in range(self.world_size))]
        for i in range(max((len(a) for a in self.actions), default=0)):
            cells = [str(acts[i]) if i < len(acts) else "" for acts in self.actions]
            row = f"{i:4d} | " + "".join(c.ljust(width) for c in cells)
            flagged = [r for r, s in marks.items() if s == i]
            lines.append(row.rstrip() + (f"   <-- ERROR HERE (rank {', '.join(map(str, flagged))})" if flagged else ""))
        return "\n".join(lines)


def send_window(plan: Plan, *, minimum: int = 4) -> int:
    """How many unreceived sends a rank may keep in flight: at least ``minimum``, and twice the
    longest run of consecutive sends of any rank, so that a fan-out to many peers never waits on
    one of them (the simulator checks the plan under the same bound), plus every send a rank makes
    before its first action of a stage that runs a backward (the frozen stages' forwards it runs
    ahead, see :mod:`mmpipe.sched.schedule`): those may wait for the step's last micro-batch to be
    received, and must neither block the rank nor take the trained stages' room."""
    longest = most_ahead = 0
    for acts in plan.actions:
        run = ahead = 0
        trained = False
        for a in acts:
            run = run + 1 if a.kind in SENDS else 0
            longest = max(longest, run)
            trained = trained or a.stage in plan.backward and a.kind in (ActionKind.F, ActionKind.B)
            ahead += a.kind in SENDS and not trained
        if trained:  # these may stay unreceived until the step's last micro-batch
            most_ahead = max(most_ahead, ahead)
    return max(minimum, 2 * longest + most_ahead)


def _check_complete(plan: Plan) -> None:
    """Every rank of a stage's group runs F (and B) once per micro-batch it holds rows of, and STEPs
    once if trainable."""
    for stage, group in plan.placement:
        for rank in group.ranks:
            held = [m for m in range(plan.micro_batches) if group.holds(rank, plan.batch, m)]
            expected: list[tuple[ActionKind, int | None]] = [(ActionKind.F, m) for m in held]
            if stage in plan.backward:
                expected += [(ActionKind.B, m) for m in held]
            if stage in plan.trainable:
                expected.append((ActionKind.STEP, None))
            acts = plan.actions[rank]
            have = Counter((a.kind, a.mb) for a in acts if a.stage == stage and a.kind not in TRANSFERS)
            missing = [
                f"{stage}:{k.value}" + (f":mb{m}" if m is not None else "") for k, m in expected if not have[(k, m)]
            ]
            extra = [k for k, c in have.items() if c > 1 or k not in expected]
            if missing or extra:
                what = (
                    f"missing {missing}"
                    if missing
                    else f"duplicated or unexpected {[f'{k.value}:mb{m}' for k, m in extra]}"
                )
                raise PlanError(f"rank {rank}: stage {stage!r} {what}\n{plan.format_table({rank: len(acts)})}")


# ---- the dry run --------------------------------------------------------------------------------
def transfer_key(rank: int, a: Action) -> tuple:
    """Identify a message from both ends: (kind of message, edge, mb, sender, receiver)."""
    grad = a.kind in (ActionKind.SEND_GRAD, ActionKind.RECV_GRAD)
    sending = a.kind in SENDS
    assert a.peer is not None
    src, dst = (rank, a.peer) if sending else (a.peer, rank)
    return ("G" if grad else "A", a.stage, a.dst, a.mb, src, dst)


def collective_ranks(plan: Plan, rank: int, a: Action) -> tuple[int, ...] | None:
    """The ranks that join the collective ``a`` runs on ``rank``, or ``None`` when it runs none.

    A trainable stage on more than one rank is FSDP-sharded over its whole group: its forward and
    backward gather parameters and its last backward reduce-scatters gradients, its STEP reduces
    the gradient norm. A sequence-parallel stage's forward and backward exchange activations
    (all-to-all, ring) among the ranks of one replica. These collectives block (gloo) and match
    by order within their process group, so every rank of the group must run them in the same
    order, and two groups sharing ranks must not wait on each other."""
    group = plan.groups[a.stage]
    if a.kind not in (ActionKind.F, ActionKind.B, ActionKind.STEP) or len(group.ranks) == 1:
        return None
    if a.stage in plan.trainable:
        return group.ranks
    if group.sp > 1 and a.kind != ActionKind.STEP:
        i = group.replica(rank) * group.sp
        return group.ranks[i : i + group.sp]
    return None


def _dry_run(plan: Plan) -> None:
    """Execute all lists symbolically: sends are buffered, receives wait for their send, collectives
    wait for every rank of their group (a rendezvous); report the first stall."""
    sends = Counter(transfer_key(r, a) for r, acts in enumerate(plan.actions) for a in acts if a.kind in SENDS)
    recvs = Counter(transfer_key(r, a) for r, acts in enumerate(plan.actions) for a in acts if a.kind in RECVS)
    for key in (sends - recvs) + (recvs - sends):
        _raise_unpaired(plan, key, sends)
    pos = [0] * plan.world_size
    sent: set[tuple] = set()
    done: list[set[tuple]] = [set() for _ in range(plan.world_size)]
    # A rank runs until an action is not ready. Only a receive can become ready later (when its
    # message is sent): the rank waits on that message and is woken by its send.
    waiting: dict[tuple, int] = {}
    arrived: dict[tuple, set[int]] = {}  # collectives some of whose ranks wait in them
    met: set[tuple] = set()  # collectives every rank of the group reached
    ready = list(range(plan.world_size))
    while ready:
        rank = ready.pop()
        acts = plan.actions[rank]
        while pos[rank] < len(acts) and _ready(plan, rank, acts[pos[rank]], sent, done[rank]):
            a = acts[pos[rank]]
            ranks = collective_ranks(plan, rank, a)
            if ranks is not None:
                key = (a.stage, a.kind, a.mb, ranks)
                if key not in met:
                    here = arrived.setdefault(key, set())
                    here.add(rank)
                    if len(here) < len(ranks):
                        break  # wait for the rest of the group
                    met.add(key)
                    ready.extend(r for r in arrived.pop(key) if r != rank)
            if a.kind in SENDS:
                key = transfer_key(rank, a)
                sent.add(key)
                if key in waiting:
                    ready.append(waiting.pop(key))
            done[rank].add((a.stage, a.kind, a.mb, a.dst, a.peer))
            pos[rank] += 1
        if pos[rank] < len(acts) and acts[pos[rank]].kind in RECVS:
            waiting[transfer_key(rank, acts[pos[rank]])] = rank
    stuck = {r: p for r, p in enumerate(pos) if p < len(plan.actions[r])}
    if stuck:
        detail = "; ".join(
            f"rank {r} waits at {a}" + (f" (a collective over ranks {list(ranks)})" if ranks else "")
            for r, p in stuck.items()
            for a in [plan.actions[r][p]]
            for ranks in [collective_ranks(plan, r, a)]
        )
        raise PlanError(f"deadlock or unmet dependency: {detail}\n{plan.format_table(stuck)}")


def _static_problem(plan: Plan, rank: int, a: Action) -> str | None:
    groups = plan.groups
    if a.stage not in groups or (a.dst is not None and a.dst not in groups):
        return f"unknown stage in action (placed: {sorted(groups)})"
    if a.mb is not None and not 0 <= a.mb < plan.micro_batches:
        return f"micro-batch {a.mb} outside 0..{plan.micro_batches - 1}"
    if a.peer is not None and not 0 <= a.peer < plan.world_size:
        return f"peer rank {a.peer} outside world_size {plan.world_size}"
    owner = a.dst if a.kind in (ActionKind.RECV, ActionKind.SEND_GRAD) and a.dst is not None else a.stage
    if rank not in groups[owner]:
        return f"stage {owner!r} is not placed on rank {rank} ({groups[owner]})"
    return None


def _raise_unpaired(plan: Plan, key: tuple, sends: Counter) -> None:
    kind, stage, dst, mb, src, dst_rank = key
    side = "SEND without a matching RECV" if key in sends else "RECV without a matching SEND"
    rank = src if key in sends else dst_rank
    step = next(i for i, a in enumerate(plan.actions[rank]) if a.kind in TRANSFERS and transfer_key(rank, a) == key)
    raise PlanError(f"{side}: {plan.actions[rank][step]} on rank {rank}\n{plan.format_table({rank: step})}")


def _ready(plan: Plan, rank: int, a: Action, sent: set[tuple], done: set[tuple]) -> bool:
    """Whether ``a`` can run on ``rank`` now, given what was sent and what ``rank`` has done."""
    if a.kind in (ActionKind.RECV, ActionKind.RECV_GRAD):
        return transfer_key(rank, a) in sent
    if a.kind == ActionKind.SEND:
        return (a.stage, ActionKind.F, a.mb, None, None) in done
    if a.kind == ActionKind.SEND_GRAD:
        return (a.dst, ActionKind.B, a.mb, None, None) in done
    if a.kind == ActionKind.F:
        return all(_has(rank, p, a.stage, a.mb, ActionKind.RECV, plan, done) for p in plan.producers(a.stage))
    if a.kind == ActionKind.B:
        grads = [c for c in plan.consumers(a.stage) if c in plan.backward]
        forward_done = (a.stage, ActionKind.F, a.mb, None, None) in done
        return forward_done and all(_has(rank, a.stage, c, a.mb, ActionKind.RECV_GRAD, plan, done) for c in grads)
    # STEP: after every micro-batch's backward of the stage on this rank.
    return all((a.stage, ActionKind.B, m, None, None) in done for m in range(plan.micro_batches))


def _has(rank: int, src: str, dst: str, mb: int | None, kind: ActionKind, plan: Plan, done: set[tuple]) -> bool:
    """Whether ``rank`` holds the ``src -> dst`` tensors (activations, or gradients) of ``mb``."""
    groups = plan.groups
    local_stage, remote = (src, groups[src]) if kind == ActionKind.RECV else (dst, groups[dst])
    mine = groups[dst] if kind == ActionKind.RECV else groups[src]
    for peer in overlapping_ranks(mine, rank, remote, plan.batch, mb or 0):
        if peer == rank:
            local_kind = ActionKind.F if kind == ActionKind.RECV else ActionKind.B
            if (local_stage, local_kind, mb, None, None) not in done:
                return False
        elif (src, kind, mb, dst, peer) not in done:
            return False
    return True


def check_split(stage: str, group: DeviceGroup, batch: int | None, *, backward: bool) -> None:
    """A group's replicas split each micro-batch of ``batch`` samples; the replicas of a stage that
    runs a backward get equal shares (FSDP averages their gradients). Frozen stages may take shares
    that differ by one row, and more replicas than rows: shares rotate over the micro-batches
    (:meth:`DeviceGroup.rows`), so a frozen stage can take every rank of a colocated layout."""
    if batch is None:
        return
    if backward and batch % group.dp:
        raise PlanError(f"stage {stage!r} runs a backward: its dp={group.dp} must divide the micro-batch size {batch}")


def overlapping_ranks(group: DeviceGroup, rank: int, other: DeviceGroup, batch: int = 0, mb: int = 0) -> list[int]:
    """Ranks of ``other`` whose share of micro-batch ``mb`` overlaps ``rank``'s share in ``group``
    (``batch``: the micro-batch size, needed when a group's shares are unequal or rotate)."""
    if batch and (batch % group.dp or batch % other.dp):
        lo, hi = group.rows(rank, batch, mb)
        if hi <= lo:
            return []
        # shares k of ``other`` from the one holding row lo to the one holding row hi - 1 (the last
        # k with k * batch // dp <= x holds row x), then the replicas holding them this micro-batch
        replicas = []
        for k in range(((lo + 1) * other.dp - 1) // batch, (hi * other.dp - 1) // batch + 1):
            if k * batch // other.dp < (k + 1) * batch // other.dp:
                replicas.append((k - mb) % other.dp if batch % other.dp else k)
        return [r for j in sorted(replicas) for r in other.ranks[j * other.sp : (j + 1) * other.sp]]
    i = group.replica(rank)
    # Replicas j of ``other`` with [j/other.dp, (j+1)/other.dp) overlapping [i/group.dp, (i+1)/group.dp).
    first = i * other.dp // group.dp
    last = -(-(i + 1) * other.dp // group.dp)  # ceil
    return list(other.ranks[first * other.sp : last * other.sp])
