"""``benchmarks/pipeline.py``'s regret: auto's placement against the best *other* placement, with a
finalist that is auto's own placement counted as a second measurement of it, never raced against it;
and ``--rescore`` recomputing an earlier run's regrets from its JSON line."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
from bench_scripts import bench_module

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "pipeline.py"


def _bench() -> ModuleType:
    return bench_module("pipeline")


def test_a_placement_is_not_raced_against_a_second_run_of_itself() -> None:
    b = _bench()
    auto = [10.0, 12.0, 11.0]
    finals = {"same": [12.0, 10.0, 11.0], "other": [9.0, 9.0, 12.0]}
    # Raced (the old figure): auto / the larger of its own second run and the other, per round.
    assert b.per_round(auto, list(finals.values())) == pytest.approx([10 / 12, 12 / 10, 11 / 12])
    # Pooled: (auto + itself) / 2 over the other placement.
    assert b.regret_per_round(auto, finals, ["same"]) == pytest.approx([11 / 9, 11 / 9, 11 / 12])
    # Nothing named as itself: the raced figure; nothing else measured: 1 every round.
    assert b.regret_per_round(auto, finals, []) == pytest.approx(b.per_round(auto, list(finals.values())))
    assert b.regret_per_round(auto, {"same": finals["same"]}, ["same"]) == [1.0, 1.0, 1.0]


def test_the_pooled_regret_is_unbiased_where_the_raced_one_is_not() -> None:
    """Auto chose one of two equally fast placements, and its placement is also a finalist: the
    regret's median should sit at 1. Racing auto's run against its own second run and the other
    placement puts the larger of two noisy draws in the denominator (median below 1); pooling the
    two runs of auto's placement does not."""
    import random
    import statistics

    b = _bench()
    rng = random.Random(0)
    raced, pooled = [], []
    for _ in range(400):
        auto, again, tie = ([rng.gauss(10.0, 0.5)] for _ in range(3))
        raced += b.per_round(auto, [again, tie])
        pooled += b.regret_per_round(auto, {"itself": again, "tie": tie}, ["itself"])
    assert statistics.median(raced) < 0.985
    assert 0.985 < statistics.median(pooled) < 1.015


def test_rescore_recomputes_an_earlier_runs_regret(tmp_path: Path) -> None:
    rows = [
        {"name": "auto", "finalist": True, "samples_per_s_per_repeat": [10.0, 12.0, 11.0]},
        {"name": "a@0 b@1", "finalist": True, "samples_per_s_per_repeat": [12.0, 10.0, 11.0]},
        {"name": "a@1 b@0", "finalist": True, "samples_per_s_per_repeat": [9.0, 9.0, 12.0]},
        {"name": "a@dp b@dp", "finalist": False, "samples_per_s_per_repeat": []},
    ]
    run = {
        "workloads": [{"name": "w", "auto_name": "a@0 b@1", "placements": rows, "data_parallel_baselines": ["a@0 b@1"]}]
    }
    log = tmp_path / "run.log"
    log.write_text("screen ...\n" + json.dumps(run) + "\n")
    out = subprocess.run(
        [sys.executable, str(SCRIPT), "--rescore", str(log)], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    (entry,) = json.loads(out.stdout.splitlines()[-1])["workloads"]
    assert entry["regret_pooled_with"] == ["a@0 b@1"]
    assert entry["regret"] == round(11 / 9, 3) and entry["regret_range"] == [round(11 / 12, 3), round(11 / 9, 3)]
    assert entry["regret_unpooled"] == round(11 / 12, 3)  # rounds: 10/12, 12/10, 11/12
    # auto's placement is the only data-parallel baseline: auto is data parallelism, 1 every round
    assert entry["vs_data_parallel"] == 1.0 and entry["vs_data_parallel_range"] == [1.0, 1.0]
    missing = subprocess.run(
        [sys.executable, str(SCRIPT), "--rescore", str(tmp_path / "none.log")], cwd=ROOT, capture_output=True, text=True
    )
    assert missing.returncode != 0 and "no such file" in missing.stderr and "Traceback" not in missing.stderr
