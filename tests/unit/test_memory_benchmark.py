"""``benchmarks/memory.py``: its measured run (one fresh process a policy and length) and how the sweep
judges rows, at tiny sizes. No timings are asserted."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
from bench_scripts import bench_module

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "memory.py"
TINY = ["--layers", "8", "--heads", "2", "--head-dim", "16"]


def _bench() -> ModuleType:
    return bench_module("memory")


def _child(blocks: str, frames: int, env: dict[str, str]) -> subprocess.Popen[str]:
    command = [sys.executable, str(SCRIPT), "--child", *TINY, "--frames", str(frames), "--blocks", blocks]
    return subprocess.Popen(
        [*command, "--reps", "1"], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="the peak is read from Linux's /proc")
def test_recomputing_every_block_measures_a_lower_peak_than_keeping_everything() -> None:
    """At 2048 tokens through 8 blocks the saved activations are most of keep-everything's peak (observed
    93 MB against 40 MB recomputing every block, about 34 MB of which is the same in both). The two runs
    go side by side (the peak is per process). glibc's mmap threshold is fixed at 128 KiB for them, so
    that freed activations leave the process and the peaks compare what the policies hold rather than
    where glibc's heap put it (its dynamic threshold keeps freed tensors resident: 115 MB against 82 MB)."""
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072", "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}
    runs = {blocks: _child(blocks, 8, env) for blocks in ("k" * 8, "r" * 8)}
    got = {}
    for blocks, run in runs.items():
        out, err = run.communicate(timeout=300)
        assert run.returncode == 0, err[-3000:]
        got[blocks] = json.loads(out.strip().splitlines()[-1])
    for result in got.values():
        assert set(result) == {"peak_bytes", "step_s", "offloaded_bytes", "device"}
        assert result["peak_bytes"] > 0 and result["step_s"] > 0
        assert result["offloaded_bytes"] == 0 and result["device"] == "cpu"
    keep, recompute = got["k" * 8]["peak_bytes"], got["r" * 8]["peak_bytes"]
    # 0.6: the activation part (above the ~34 MB both share) more than halves; observed 0.43
    assert recompute < 0.6 * keep, (keep, recompute)


def test_a_failed_run_does_not_fit_and_says_why() -> None:
    bench = _bench()
    args = argparse.Namespace(reps=1, child_timeout=300.0)
    runner = bench.Runner(args, bench.make_setup("cpu", 2, 2, 16))
    runner.cap = 1 << 40
    row = runner.measure("auto", 1, "kx")  # not a policy letter: the child exits at its argument check
    assert not row.fits and row.peak_bytes is None
    assert "exit status 2" in row.error and "--blocks 'kx'" in row.error


def test_bad_arguments_name_the_value(capsys: pytest.CaptureFixture[str]) -> None:
    bench = _bench()
    for argv, says in [
        (["--reps", "0"], "--reps 0: must be at least 1"),
        (["--layers", "1"], "--layers 1: must be at least 2"),
        (["--cap-frames", "4", "--max-frames", "3"], "--max-frames 3: must be at least --cap-frames (4)"),
        (["--cap-factor", "0"], "--cap-factor 0.0: must be positive"),
        (["--device", "tpu"], "--device 'tpu': cpu or cuda[:N]"),
    ]:
        with pytest.raises(SystemExit) as exit_:
            bench.parse_args(argv)
        assert exit_.value.code == 2
        assert says in capsys.readouterr().err
    assert bench.parse_args(["--cap-frames", "3"]).max_frames == 24  # 8 x the cap's length by default


def test_a_column_stops_at_its_first_length_that_does_not_fit_and_auto_is_compared_where_both_fit() -> None:
    bench = _bench()
    Row = bench.Row
    rows = [
        Row("keep", 2, "kk", fits=True, step_s=1.0),
        Row("recompute_all", 2, "rr", fits=True, step_s=1.3),
        Row("auto", 2, "kk", fits=True, step_s=1.0),
        Row("keep", 3, "kk", fits=False),
        Row("recompute_all", 3, "rr", fits=True, step_s=2.0),
        Row("auto", 3, "rk", fits=True, step_s=1.9),
        Row("recompute_all", 4, "rr", fits=True, step_s=3.0),
        Row("auto", 4, "", fits=False),
        Row("auto", 5, "rr", fits=True, step_s=4.0),  # after a miss: not counted
    ]
    assert [bench.longest(rows, c) for c in bench.COLUMNS] == [2, 4, 3]
    ratios = bench.step_ratios(rows)
    assert ratios == pytest.approx({2: 1 / 1.3, 3: 0.95})
    assert bench.no_slower(rows, ratios) is False  # auto does not fit at 4, where recompute-all does
    assert bench.no_slower(rows[:6], bench.step_ratios(rows[:6])) is True
