"""The plan simulator on hand-built costs, where the answer is known in closed form."""

from __future__ import annotations

import pytest
from toy_graphs import T2V, U2G

from mmpipe.sched.plan import Action, ActionKind
from mmpipe.sched.results import parse_placement
from mmpipe.sched.schedule import build_plan
from mmpipe.sched.simulator import bubble_fractions, calibrate, simulate


def unit_costs(table: dict[tuple[str, ActionKind], float]):
    return lambda a: table.get((a.stage, a.kind), 0.0)


def test_single_rank_step_time_is_the_sum_of_its_work() -> None:
    plan = build_plan(T2V, parse_placement({"text": [0], "vae": [0], "dit": [0]}), 4, world_size=1)
    cost = unit_costs(
        {
            ("text", ActionKind.F): 0.5,
            ("vae", ActionKind.F): 2.0,
            ("dit", ActionKind.F): 1.0,
            ("dit", ActionKind.B): 2.0,
            ("dit", ActionKind.STEP): 0.25,
        }
    )
    sim = simulate(plan, cost, steps=3)
    assert sim.step_time == pytest.approx(4 * (0.5 + 2.0 + 1.0 + 2.0) + 0.25)
    assert sim.bubble == {0: pytest.approx(0.0)}


def test_pipelined_step_time_is_the_busiest_rank_once_producers_run_ahead() -> None:
    # rank 0: 4 x (text 0.5 + vae 1.5) = 8; rank 1: 4 x (1 + 1.5) + 0.5 = 10.5 -> steady state 10.5 per step
    plan = build_plan(T2V, parse_placement({"text": [0], "vae": [0], "dit": [1]}), 4, world_size=2)
    cost = unit_costs(
        {
            ("text", ActionKind.F): 0.5,
            ("vae", ActionKind.F): 1.5,
            ("dit", ActionKind.F): 1.0,
            ("dit", ActionKind.B): 1.5,
            ("dit", ActionKind.STEP): 0.5,
        }
    )
    sim = simulate(plan, cost, steps=6, max_inflight=64)
    assert sim.step_time == pytest.approx(10.5)
    # the window opens when rank 0 (running ahead) starts step 2, slightly before rank 1 does
    assert sim.bubble[1] < 0.1 and 0.2 < sim.bubble[0] < 0.35
    # one message in flight is enough here: rank 0 is the faster rank and computes its next
    # micro-batch while its previous send waits
    assert simulate(plan, cost, steps=6, max_inflight=1).step_time == pytest.approx(10.5)


def test_gradients_crossing_ranks_serialise_the_backward() -> None:
    plan = build_plan(U2G, parse_placement({"vit": [0], "llm": [1], "connector": [1], "dit": [2]}), 1, world_size=3)
    cost = unit_costs({(s, k): 1.0 for s in ("vit", "llm", "connector", "dit") for k in (ActionKind.F, ActionKind.B)})
    # one micro-batch: vit F, llm F, connector F, dit F, dit B, connector B, llm B -> 7 units in a chain
    assert simulate(plan, cost, steps=3).step_time == pytest.approx(6.0)  # vit's F overlaps the previous step


def test_calibrate_uses_median_measured_durations() -> None:
    events = [
        {"phase": "train", "step": s, "stage": "dit", "dst": None, "kind": "F", "rank": 0, "start": 0.0, "end": d}
        for s, d in [(1, 9.0), (2, 1.0), (3, 2.0), (4, 3.0)]
    ]
    for e, start in zip(events, [-9.0, 0.0, 1.0, 4.0], strict=True):  # back to back, then a 1 s gap
        e["end"] += start - e["start"]
        e["start"] = start
    cost = calibrate(events, first_step=2)
    assert cost(Action("dit", ActionKind.F, 0)) == 2.0  # step 1 (warm-up) ignored
    assert cost(Action("dit", ActionKind.B, 0)) == 0.0
    assert bubble_fractions(events, first_step=2) == {0: pytest.approx(1 / 7)}
