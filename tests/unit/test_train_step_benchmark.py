"""benchmarks/train_step.py's step timing, on hand-made event files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from bench_scripts import bench_module


def write_events(run_dir: Path, starts: dict[int, list[float]], phase: str = "train") -> None:
    (run_dir / "events").mkdir(parents=True)
    with (run_dir / "events" / "rank0.jsonl").open("w") as f:
        for step, times in starts.items():
            for t in times:  # a step's events, not in time order
                f.write(json.dumps({"phase": phase, "step": step, "start": t, "end": t + 0.001}) + "\n")


def test_median_step_is_between_consecutive_steps_first_events_over_the_window(tmp_path: Path) -> None:
    # steps 0..9 one second apart (each step's later events must not count), then 3 fast steps
    starts = {s: [s + 0.9 * (s % 2), float(s)] for s in range(10)}
    starts |= {10: [10.2], 11: [10.4], 12: [10.6]}
    write_events(tmp_path, starts)
    median_step_s = bench_module("train_step").median_step_s
    assert median_step_s(tmp_path, 3) == pytest.approx(0.2)  # intervals 10->11->12 and 9->10 (1.2, 0.2, 0.2)
    assert median_step_s(tmp_path, 12) == pytest.approx(1.0)


def test_validation_events_are_not_steps(tmp_path: Path) -> None:
    write_events(tmp_path, {0: [0.0], 1: [0.1], 2: [0.2]})
    with (tmp_path / "events" / "rank0.jsonl").open("a") as f:
        f.write(json.dumps({"phase": "val", "step": 1, "start": 0.05, "end": 0.06}) + "\n")
    assert bench_module("train_step").median_step_s(tmp_path, 2) == pytest.approx(0.1)
