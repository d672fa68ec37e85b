"""Plan IR: text round trip, generated schedules, and validation failures with the rank x step table."""

from __future__ import annotations

import dataclasses
import itertools

import pytest
from toy_graphs import FANOUT, T2V, U2G, G

from mmpipe.errors import PlanError
from mmpipe.sched.plan import (
    Action,
    ActionKind,
    DeviceGroup,
    Plan,
    collective_ranks,
    overlapping_ranks,
    send_window,
)
from mmpipe.sched.results import parse_placement
from mmpipe.sched.schedule import ScheduleKind, build_plan

PLACEMENTS = [
    (T2V, {"text": [0], "vae": [0], "dit": [0]}, 1),
    (T2V, {"text": [0], "vae": [0], "dit": [1]}, 2),
    (T2V, {"text": [0], "vae": [1], "dit": [2]}, 3),
    (T2V, {"text": [0], "vae": [0], "dit": {"ranks": [1, 2], "dp": 2}}, 3),
    (T2V, {"text": [0, 1], "vae": [0, 1], "dit": {"ranks": [0, 1], "dp": 2, "replicate": True}}, 2),
    (U2G, {"vit": [0], "llm": [1], "connector": [1], "dit": [2]}, 3),
    (U2G, {"vit": [0], "llm": {"ranks": [1, 2], "dp": 2}, "connector": [3], "dit": [3]}, 4),
    (U2G, {"vit": [0], "llm": {"ranks": [0, 1], "dp": 2}, "connector": {"ranks": [0, 1], "dp": 2}, "dit": [1]}, 2),
    (T2V, {"text": [0], "vae": [0], "dit": {"ranks": [0, 1], "ulysses": 2}}, 2),
    (FANOUT, {"enc": [0], "a": [1], "b": [2]}, 3),
]


@pytest.mark.parametrize("schedule", list(ScheduleKind))
@pytest.mark.parametrize(("graph", "placement", "world"), PLACEMENTS)
def test_generated_plans_validate_and_round_trip(graph: G, placement: dict, world: int, schedule: ScheduleKind) -> None:
    plan = build_plan(graph, parse_placement(placement), 4, world_size=world, schedule=schedule)
    assert Plan.from_text(plan.to_text()) == plan
    for rank in range(world):
        kinds = [a.kind for a in plan.actions[rank]]
        trainable_here = [s for s in plan.stages_on(rank) if s in plan.trainable]
        assert kinds.count(ActionKind.STEP) == len(trainable_here)
    sends = sum(a.kind == ActionKind.SEND for acts in plan.actions for a in acts)
    recvs = sum(a.kind == ActionKind.RECV for acts in plan.actions for a in acts)
    assert sends == recvs


def test_1f1b_bounds_in_flight_micro_batches() -> None:
    plan = build_plan(U2G, parse_placement({"vit": [0], "llm": [1], "connector": [1], "dit": [2]}), 6, world_size=3)
    # rank 1 is one hop from the end of the backward path: at most 2 forwards ahead of its backwards.
    in_flight = peak = 0
    for a in plan.actions[1]:
        if a.kind == ActionKind.F and a.stage == "llm":
            in_flight += 1
        if a.kind == ActionKind.B and a.stage == "llm":
            in_flight -= 1
        peak = max(peak, in_flight)
    assert peak == 2
    gpipe = build_plan(
        U2G,
        parse_placement({"vit": [0], "llm": [1], "connector": [1], "dit": [2]}),
        6,
        world_size=3,
        schedule=ScheduleKind.GPIPE,
    )
    kinds = [a.kind for a in gpipe.actions[1] if a.stage == "llm" and a.kind in (ActionKind.F, ActionKind.B)]
    assert kinds == [ActionKind.F] * 6 + [ActionKind.B] * 6  # GPipe: all forwards in flight at once


def test_action_text_form() -> None:
    for text in ["dit:F:mb3", "dit:B:mb0", "text->dit:SEND:mb2@r1", "text->dit:RECVG:mb0@r3", "dit:STEP"]:
        assert str(Action.parse(text)) == text
    assert Action.parse("text->dit:SEND:mb2@r1") == Action("text", ActionKind.SEND, 2, "dit", 1)
    with pytest.raises(PlanError, match="unknown action kind 'FWD'"):
        Action.parse("dit:FWD:mb0")
    with pytest.raises(PlanError, match="malformed action text->dit:SEND:mb0"):
        Action.parse("text->dit:SEND:mb0")


def _t2v_two_rank_plan() -> Plan:
    return build_plan(T2V, parse_placement({"text": [0], "vae": [0], "dit": [1]}), 2, world_size=2)


def _with_rank_actions(plan: Plan, rank: int, actions: list[Action]) -> Plan:
    acts = list(plan.actions)
    acts[rank] = tuple(actions)
    return dataclasses.replace(plan, actions=tuple(acts))


def test_deadlock_is_reported_with_the_table() -> None:
    plan = _t2v_two_rank_plan()
    # rank 1 waits for micro-batch 1 before micro-batch 0 while rank 0 ... still completes (sends are buffered);
    # swapping rank 0's forward and its receive of a gradient that never comes is a true stall:
    acts = list(plan.actions[1])
    f0 = acts.index(Action("dit", ActionKind.F, 0))
    b0 = acts.index(Action("dit", ActionKind.B, 0))
    acts[f0], acts[b0] = acts[b0], acts[f0]
    with pytest.raises(PlanError) as err:
        _with_rank_actions(plan, 1, acts).validate()
    text = str(err.value)
    assert "deadlock or unmet dependency: rank 1 waits at dit:B:mb0" in text
    assert "<-- ERROR HERE (rank 1)" in text and "step | rank 0" in text
    flagged = next(line for line in text.splitlines() if "ERROR HERE" in line)
    assert "dit:B:mb0" in flagged


def _collectives(plan: Plan, rank: int, ranks: tuple[int, ...]) -> list[Action]:
    return [a for a in plan.actions[rank] if collective_ranks(plan, rank, a) == ranks]


@pytest.mark.parametrize("schedule", list(ScheduleKind))
@pytest.mark.parametrize("micro", [1, 2, 4, 5])
def test_ranks_sharing_collectives_run_them_in_one_order(schedule: ScheduleKind, micro: int) -> None:
    """The LLM and the connector FSDP-sharded over ranks 0 and 1, the DiT on rank 1 only: rank 0 is
    a hop deeper for 1F1B, yet both ranks must gather and reduce in the same order."""
    dp = {"ranks": [0, 1], "dp": 2}
    placement = parse_placement({"vit": [0], "llm": dp, "connector": dp, "dit": [1]})
    plan = build_plan(U2G, placement, micro, world_size=2, schedule=schedule)
    assert _collectives(plan, 0, (0, 1)) == _collectives(plan, 1, (0, 1))
    assert len(_collectives(plan, 0, (0, 1))) == 2 * (2 * micro + 1)  # F and B per micro-batch, STEP
    if schedule == ScheduleKind.ONE_F_ONE_B and micro > 2:  # still 1F1B: not every forward first
        kinds = [a.kind for a in _collectives(plan, 1, (0, 1)) if a.stage == "llm"]
        assert kinds.index(ActionKind.B) < micro


def test_collectives_out_of_order_are_a_deadlock() -> None:
    """Rank 1 gathers the connector before the LLM while rank 0 gathers the LLM first: both block in
    a collective the other never joins (with gloo, a crash or a hang at run time)."""
    dp = {"ranks": [0, 1], "dp": 2}
    plan = build_plan(U2G, parse_placement({"vit": [0], "llm": dp, "connector": dp, "dit": [1]}), 2, world_size=2)
    acts = list(plan.actions[1])
    i, j = acts.index(Action("llm", ActionKind.B, 0)), acts.index(Action("connector", ActionKind.B, 0))
    acts[i], acts[j] = acts[j], acts[i]
    with pytest.raises(PlanError) as err:
        _with_rank_actions(plan, 1, acts).validate()
    text = str(err.value)
    assert "rank 0 waits at connector:B:mb0 (a collective over ranks [0, 1])" in text
    assert "rank 1 waits at llm:B:mb0 (a collective over ranks [0, 1])" in text
    # a forward-only stage on one rank, and a frozen replica, run no collective
    assert collective_ranks(plan, 0, Action("vit", ActionKind.F, 0)) is None
    frozen = build_plan(
        T2V, parse_placement({"text": [0], "vae": {"ranks": [0, 1], "dp": 2}, "dit": [1]}), 2, world_size=2
    )
    assert collective_ranks(frozen, 1, Action("vae", ActionKind.F, 0)) is None
    sp = build_plan(
        T2V,
        parse_placement({"text": [0], "vae": {"ranks": [0, 1, 2, 3], "dp": 2, "ulysses": 2}, "dit": [3]}),
        2,
        world_size=4,
    )
    assert collective_ranks(sp, 3, Action("vae", ActionKind.F, 0)) == (2, 3)  # its replica's sequence group


def test_unpaired_send_and_receive() -> None:
    plan = _t2v_two_rank_plan()
    acts = [a for a in plan.actions[1] if a != Action("text", ActionKind.RECV, 1, "dit", 0)]
    with pytest.raises(PlanError, match=r"SEND without a matching RECV: text->dit:SEND:mb1@r1 on rank 0"):
        _with_rank_actions(plan, 1, acts).validate()


def test_cross_rank_receive_cycle_deadlocks() -> None:
    plan = _t2v_two_rank_plan()
    # rank 0 first waits for a gradient that rank 1 can only send after rank 0's forward: a cycle.
    bogus = Action("text", ActionKind.RECV_GRAD, 0, "dit", 1)
    rank1 = list(plan.actions[1])
    rank1.insert(rank1.index(Action("dit", ActionKind.B, 0)) + 1, Action("text", ActionKind.SEND_GRAD, 0, "dit", 0))
    p = _with_rank_actions(_with_rank_actions(plan, 0, [bogus, *plan.actions[0]]), 1, rank1)
    with pytest.raises(PlanError, match="rank 0 waits at text->dit:RECVG:mb0@r1"):
        p.validate()


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (
            lambda p: dataclasses.replace(p, placement=p.placement + (("dit", DeviceGroup((0,))),)),
            "placed more than once",
        ),
        (
            lambda p: dataclasses.replace(p, placement=(("text", DeviceGroup((5,))),) + p.placement[1:]),
            "ranks [5] outside world_size 2",
        ),
        (
            lambda p: _with_rank_actions(p, 1, [a for a in p.actions[1] if a.kind != ActionKind.STEP]),
            "stage 'dit' missing ['dit:STEP']",
        ),
        (
            lambda p: _with_rank_actions(p, 0, [Action("dit", ActionKind.F, 0), *p.actions[0]]),
            "stage 'dit' is not placed on rank 0",
        ),
        (
            lambda p: _with_rank_actions(p, 1, [Action("dit", ActionKind.F, 7), *p.actions[1]]),
            "micro-batch 7 outside 0..1",
        ),
    ],
)
def test_static_errors(edit, message: str) -> None:
    with pytest.raises(PlanError) as err:
        edit(_t2v_two_rank_plan()).validate()
    assert message in str(err.value)


def test_placement_config_errors() -> None:
    with pytest.raises(PlanError, match=r"dp=3 x ulysses=1 x ring=1 must equal its number of ranks \(2\)"):
        parse_placement({"dit": {"ranks": [1, 2], "dp": 3}})
    with pytest.raises(PlanError, match=r"placement.dit: unknown keys \['sp'\]"):
        parse_placement({"dit": {"ranks": [1], "sp": 2}})
    with pytest.raises(PlanError, match=r"placement.dit.replicate must be true or false, got 'yes'"):
        parse_placement({"dit": {"ranks": [0, 1], "replicate": "yes"}})
    with pytest.raises(PlanError, match=r"placement.dit: replicate=true keeps whole parameters"):
        parse_placement({"dit": {"ranks": [0, 1], "replicate": True, "gather_once": True}})
    with pytest.raises(PlanError, match=r"replicate and gather_once exclude each other"):
        DeviceGroup((0, 1), 2, gather_once=True, replicate=True)
    with pytest.raises(PlanError, match="missing \\['vae'\\], unknown \\['vea'\\]"):
        build_plan(T2V, parse_placement({"text": [0], "vea": [0], "dit": [1]}), 2, world_size=2)


def test_derived_placement_puts_frozen_stages_on_rank_0(tiny_wan_dir) -> None:
    from mmpipe.assemble.placement import make_plans
    from mmpipe.config import LaunchConfig, RunConfig
    from mmpipe.models.wan import build_t2v_training_graph

    graph = build_t2v_training_graph(tiny_wan_dir, text_len=16)
    one, _ = make_plans(graph, RunConfig(launch=LaunchConfig(nproc=1)))
    assert {s: g.ranks for s, g in one.placement} == {"text": (0,), "vae": (0,), "dit": (0,)}
    three, val = make_plans(graph, RunConfig(launch=LaunchConfig(nproc=3)))
    assert {s: (g.ranks, g.dp) for s, g in three.placement} == {"text": ((0,), 1), "vae": ((0,), 1), "dit": ((1, 2), 2)}
    assert not val.backward and not val.trainable  # the validation plan is forward-only
    assert all(a.kind in (ActionKind.F, ActionKind.SEND, ActionKind.RECV) for acts in val.actions for a in acts)


def test_frozen_groups_may_split_a_micro_batch_unequally() -> None:
    vae = DeviceGroup((0, 1), dp=2)
    assert [vae.rows(r, 3) for r in (0, 1)] == [(0, 1), (1, 3)]
    dit = DeviceGroup((2,), dp=1)
    assert overlapping_ranks(dit, 2, vae, 3) == [0, 1] and overlapping_ranks(vae, 1, dit, 3) == [2]
    placement = {"text": DeviceGroup((0,)), "vae": vae, "dit": dit}
    plan = build_plan(T2V, placement, 2, world_size=3, batch=3)
    assert plan.batch == 3 and Plan.from_text(plan.to_text()) == plan
    # a stage that runs a backward needs equal shares: FSDP averages its replicas' gradients
    with pytest.raises(PlanError, match="runs a backward: its dp=2 must divide the micro-batch size 3"):
        build_plan(T2V, placement | {"dit": DeviceGroup((1, 2), dp=2)}, 2, world_size=3, batch=3)
    with pytest.raises(PlanError, match="runs a backward: its dp=4 must divide the micro-batch size 3"):
        build_plan(T2V, placement | {"dit": DeviceGroup((1, 2, 3, 4), dp=4)}, 2, world_size=5, batch=3)


def test_unequal_frozen_shares_rotate_over_micro_batches() -> None:
    vae = DeviceGroup((0, 1), dp=2)
    assert [vae.rows(r, 3, 1) for r in (0, 1)] == [(1, 3), (0, 1)]  # mb 0 gave rank 0 one row, rank 1 two
    assert overlapping_ranks(DeviceGroup((2,)), 2, vae, 3, 1) == [0, 1]
    # more replicas than rows: each micro-batch's one sample goes to the next replica in turn
    wide = DeviceGroup((0, 1, 2, 3), dp=4)
    assert [[r for r in wide.ranks if wide.holds(r, 1, m)] for m in range(8)] == [[3], [2], [1], [0]] * 2
    assert [wide.rows(r, 1, 1) for r in wide.ranks] == [(0, 0), (0, 0), (0, 1), (0, 0)]
    assert overlapping_ranks(DeviceGroup((4,)), 4, wide, 1, 1) == [2]
    assert overlapping_ranks(wide, 1, DeviceGroup((4,)), 1, 1) == []


def test_colocated_frozen_stage_takes_turns_ahead_of_the_sequence_parallel_dit() -> None:
    """The VAE on both ranks of a 2-way sequence-parallel DiT, one clip per micro-batch: the ranks
    encode alternate micro-batches, all before their first DiT action, and send each other the
    latents (the DiT ranks each need their part of every clip)."""
    placement = {
        "text": DeviceGroup((0, 1), dp=2),
        "vae": DeviceGroup((0, 1), dp=2),
        "dit": DeviceGroup((0, 1), ulysses=2),
    }
    plan = build_plan(T2V, placement, 4, world_size=2, batch=1)
    for rank, acts in enumerate(plan.actions):
        encodes = [a.mb for a in acts if a.stage == "vae" and a.kind == ActionKind.F]
        assert encodes == [m for m in range(4) if (rank + m) % 2 == 1]
        first_dit = next(i for i, a in enumerate(acts) if a.kind == ActionKind.RECV or a.stage == "dit")
        frozen = [i for i, a in enumerate(acts) if a.stage in ("text", "vae") and a.kind != ActionKind.RECV]
        assert frozen and max(frozen) < first_dit
        sends = [(a.mb, a.peer) for a in acts if a.stage == "vae" and a.kind == ActionKind.SEND]
        assert sends == [(m, 1 - rank) for m in encodes]
    assert send_window(plan) >= 4
    # forward-only (validation) plans keep the per-micro-batch order
    val = build_plan(T2V, placement, 4, world_size=2, batch=1, train=False)
    order = [str(a) for a in val.actions[0]]
    assert order.index("dit:F:mb0") < order.index("vae:F:mb1") < order.index("dit:F:mb1")


def test_overlapping_ranks_of_unequal_and_rotating_shares_match_their_rows() -> None:
    """The closed form (shares from the one holding the first row to the one holding the last)
    against the definition: every replica of the other group whose non-empty rows meet ours."""
    for batch, gdp, odp, mb in itertools.product(range(1, 9), range(1, 11), range(1, 11), range(4)):
        if not (batch % gdp or batch % odp):
            continue  # equal shares take the other path
        group, other = DeviceGroup(tuple(range(gdp)), gdp), DeviceGroup(tuple(range(50, 50 + 2 * odp)), odp, ulysses=2)
        for rank in group.ranks:
            lo, hi = group.rows(rank, batch, mb)
            want = []
            for j in range(odp):
                a, b = other.rows(other.ranks[2 * j], batch, mb)
                if lo < hi and a < b and a < hi and lo < b:
                    want += other.ranks[2 * j : 2 * j + 2]
            assert overlapping_ranks(group, rank, other, batch, mb) == want, (batch, gdp, odp, mb, rank)
