"""The report's time accounting on hand-built events, against hand computation and the simulator."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mmpipe.report.analysis import edge_traffic, load_run, rank_shares, stage_shares, steady_window
from mmpipe.report.recording import chrome_trace
from mmpipe.sched.simulator import bubble_fractions, measured_step_time


def ev(rank: int, step: int, stage: str, kind: str, start: float, end: float, **kw: object) -> dict:
    return {"rank": rank, "step": step, "phase": kw.pop("phase", "train"), "stage": stage, "dst": kw.pop("dst", None),
            "peer": kw.pop("peer", None), "mb": kw.pop("mb", 0), "kind": kind, "start": start, "end": end,
            "bytes": kw.pop("bytes", 0)}  # fmt: skip


def pipeline_events(*, validation: bool, runahead: bool) -> list[dict]:
    """Rank 0 runs a frozen encoder and sends to rank 1, which trains ``dit``; three steps.

    Step 1 ends at t=10. Step 2: rank 0 encodes [10, 12] (from 9 when it ran ahead) and sends
    [12, 12.5]; rank 1 receives [10, 12.6], F [12.6, 14], B [14, 16], STEP [16, 16.5]. A validation
    pass (both ranks) spans [17, 19]. Step 3 repeats step 2 shifted by 9 s and ends at 25.5.
    """
    events = [
        ev(0, 1, "enc", "F", 0, 2), ev(0, 1, "enc", "SEND", 2, 2.5, dst="dit", peer=1, bytes=100),
        ev(1, 1, "enc", "RECV", 0, 2.6, dst="dit", peer=0, bytes=100), ev(1, 1, "dit", "F", 2.6, 4),
        ev(1, 1, "dit", "B", 4, 6), ev(1, 1, "dit", "STEP", 6, 10, mb=None),
    ]  # fmt: skip
    for step, t in ((2, 10.0), (3, 19.0)):
        events += [
            ev(0, step, "enc", "F", t - 1 if runahead and step == 2 else t, t + 2),
            ev(0, step, "enc", "SEND", t + 2, t + 2.5, dst="dit", peer=1, bytes=100),
            ev(1, step, "enc", "RECV", t, t + 2.6, dst="dit", peer=0, bytes=100),
            ev(1, step, "dit", "F", t + 2.6, t + 4),
            ev(1, step, "dit", "B", t + 4, t + 6),
            ev(1, step, "dit", "STEP", t + 6, t + 6.5, mb=None),
        ]
    if validation:
        events += [ev(0, 2, "enc", "F", 17, 18, phase="val"), ev(1, 2, "dit", "F", 18, 19, phase="val")]
    return events


def test_fractions_match_hand_computation() -> None:
    events = pipeline_events(validation=True, runahead=True)
    w = steady_window(events)
    assert w is not None and (w.first, w.last, w.start, w.end) == (2, 3, 10, 25.5)
    assert w.wall == pytest.approx(25.5 - 10 - 2)  # the validation pass [17, 19] is not training time
    assert w.step_time == pytest.approx(13.5 / 2)
    shares = rank_shares(events, w)
    # Rank 0: encodes 2 + 2 s in the window (the run-ahead second before t=10 is outside), sends 0.5 + 0.5 s.
    assert shares[0].busy_fraction == pytest.approx(4 / 13.5)
    assert shares[0].comm_fraction == pytest.approx(1 / 13.5)
    assert shares[0].idle_fraction == pytest.approx(8.5 / 13.5)
    assert shares[0].bubble == pytest.approx(9.5 / 13.5)
    assert (shares[0].frozen, shares[0].trainable) == pytest.approx((4, 0))
    # Rank 1: F 1.4 + B 2 + STEP 0.5 per step; receives 2.6 s per step.
    assert shares[1].busy_fraction == pytest.approx(7.8 / 13.5)
    assert shares[1].comm_fraction == pytest.approx(5.2 / 13.5)
    assert shares[1].idle_fraction == pytest.approx(0.5 / 13.5)
    assert (shares[1].frozen, shares[1].trainable) == pytest.approx((0, 7.8))
    stages = stage_shares(events, w)
    assert list(stages) == ["enc", "dit"]
    (enc_ranks, enc), (dit_ranks, dit) = stages["enc"], stages["dit"]
    assert enc_ranks == (0,) and (enc.compute, enc.comm, enc.frozen) == pytest.approx((4, 1, 4))
    assert dit_ranks == (1,) and (dit.compute, dit.comm, dit.trainable) == pytest.approx((7.8, 5.2, 7.8))
    (edge,) = edge_traffic(events, w)
    assert (edge.src, edge.dst, edge.grad, edge.messages, edge.bytes) == ("enc", "dit", False, 2, 200)
    assert (edge.send_s, edge.recv_s) == pytest.approx((1.0, 5.2))


def test_a_generation_run_is_one_window_and_a_rank_without_transfers_has_no_comm() -> None:
    """``mmpipe generate``: one rank, frozen stages only, no transfers; text [0, 1], denoiser calls
    [1, 2] and [2.5, 3.5], decode [4, 5]."""
    events = [
        ev(0, 0, "text", "F", 0, 1, phase="generate"),
        ev(0, 0, "denoise", "F", 1, 2, phase="generate"),
        ev(0, 0, "denoise", "F", 2.5, 3.5, phase="generate", mb=1),
        ev(0, 0, "decode", "F", 4, 5, phase="generate"),
    ]
    w = steady_window(events)
    assert w is not None and (w.start, w.end, w.wall) == (0, 5, 5)
    (share,) = rank_shares(events, w).values()
    assert (share.compute, share.comm, share.frozen) == (4, 0, 4) and share.idle_fraction == pytest.approx(0.2)
    assert stage_shares(events, w)["denoise"][1].compute == 2


def test_bubble_and_step_time_agree_with_the_simulators_definitions() -> None:
    events = pipeline_events(validation=False, runahead=False)
    w = steady_window(events)
    assert w is not None
    shares = rank_shares(events, w)
    expected = bubble_fractions(events, first_step=2)
    assert {r: s.bubble for r, s in shares.items()} == pytest.approx(expected)
    assert w.step_time == pytest.approx(measured_step_time(events, first_step=1, last_step=3))


def test_chrome_trace_of_hand_built_events() -> None:
    events = pipeline_events(validation=True, runahead=False)
    trace = chrome_trace(events)["traceEvents"]
    assert len([e for e in trace if e["ph"] == "X"]) == len(events)
    starts = [e for e in trace if e["ph"] == "s"]
    finishes = [e for e in trace if e["ph"] == "f"]
    assert len(starts) == len(finishes) == 3  # one arrow per send, to the receive of the same message
    for s, f in zip(starts, finishes, strict=True):
        assert (s["pid"], f["pid"], s["id"]) == (0, 1, f["id"]) and f["ts"] >= s["ts"]


def test_load_run_names_the_bad_path(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="is not a directory"):
        load_run(tmp_path / "nope")
    with pytest.raises(ValueError, match=f"{tmp_path}.*has no recorded events"):
        load_run(tmp_path)
    (tmp_path / "events").mkdir()
    (tmp_path / "events" / "rank0.jsonl").write_text("\n".join(json.dumps(e) for e in pipeline_events(
        validation=False, runahead=False)) + "\n")  # fmt: skip
    run = load_run(tmp_path)
    assert run.config is None and len(run.events) == 18


def test_the_prediction_is_of_the_plan_the_run_wrote_memory_policy_included(tmp_path: Path) -> None:
    """The report predicts the plan in ``plan.txt`` (read back, not re-derived), so a run's
    ``memory.<stage>`` policy counts: recomputing every DiT block costs its forward again in backward."""
    from mmpipe.assemble.graphs import planning_graph
    from mmpipe.assemble.placement import make_plans, write_plans
    from mmpipe.config import DataConfig, RunConfig, StageMemoryConfig, TrainConfig
    from mmpipe.report.analysis import Run, _workload, predict_run

    data = DataConfig(frames=9, height=32, width=32, val_samples=4)
    train = TrainConfig(batch_size=4, micro_batches=2)
    keep = RunConfig(data=data, train=train)
    recompute = RunConfig(data=data, train=train, memory={"dit": StageMemoryConfig(policy="recompute")})
    graph, _ = planning_graph(keep.model, keep.data)
    predictions = {}
    for name, cfg in (("keep", keep), ("recompute", recompute)):
        run_dir = tmp_path / name
        run_dir.mkdir()
        write_plans(run_dir, *make_plans(graph, cfg))
        (run_dir / "events").mkdir()
        (run_dir / "events" / "rank0.jsonl").write_text(json.dumps(ev(0, 1, "dit", "F", 0, 1)) + "\n")
        run = load_run(run_dir)
        assert run.plan is not None and run.plan.to_text() == (run_dir / "plan.txt").read_text()
        run = Run(run.run_dir, run.events, run.memory, run.metrics, cfg, plan=run.plan)
        predictions[name] = predict_run(run, *_workload(cfg))
    assert run.plan.groups["dit"].recompute == 1.0
    assert predictions["recompute"].step_time > predictions["keep"].step_time
