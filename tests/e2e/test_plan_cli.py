"""``mmpipe plan`` and ``mmpipe profile`` end to end, and ``placement=auto`` training."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from cli_here import mmpipe_here

from mmpipe.config import ModelConfig
from mmpipe.sched.calibration import Calibration

SMALL = [
    "data.frames=9",
    "data.height=32",
    "data.width=32",
    "data.val_samples=4",
    "train.batch_size=4",
    "train.micro_batches=2",
    "train.progress=false",
]


def mmpipe(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "mmpipe.cli", *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MMPIPE_CACHE": str(cwd / "cache")}
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)


def test_plan_full_size_preset_prints_plan_and_baselines(tmp_path: Path) -> None:
    res = mmpipe("plan", "model=wan14b_t2v", "cluster=h200_64", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    out = res.stdout
    for needle in ("plan for wan14b_t2v on h200_64 (64 devices)", "colocated-sequential", "uniform split"):
        assert needle in out
    assert "lower bound" in out and "MFU" in out and "per-rank schedule" in out
    for stage in ("text", "vae", "dit"):
        assert any(line.startswith(stage) for line in out.splitlines())


def test_plan_json_for_local_ranks_is_a_runnable_placement(tmp_path: Path) -> None:
    res = mmpipe("plan", "model=t2v_tiny", "cluster=local", "nproc=2", "global_batch=4", "--json", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    report = json.loads(res.stdout)
    assert report["gpus"] == 2 and report["fits_memory"]
    assert set(report["placement"]) == {"text", "vae", "dit"}
    for group in report["placement"].values():
        # no memory policy on the local runtime; tiny sequences are not worth splitting over gloo
        assert group["ulysses"] == group["ring"] == 1 and group["recompute"] == group["offload"] == 0
        assert set(group["ranks"]) <= {0, 1}
    assert report["vs_lower_bound"] <= 1.0 + 1e-9


def test_plan_json_placement_trains_unchanged(tmp_path: Path) -> None:
    """What ``mmpipe plan --json`` prints, saved to a file, is a placement ``mmpipe train`` runs as it is."""
    res = mmpipe("plan", "model=t2v_tiny", "cluster=local", "nproc=2", "global_batch=4", "micro_batches=2",
                 "data.frames=9", "data.height=32", "data.width=32", "--json", cwd=tmp_path)  # fmt: skip
    assert res.returncode == 0, res.stderr
    (tmp_path / "plan.json").write_text(res.stdout)
    printed = json.loads(res.stdout)["placement"]
    run = tmp_path / "run"
    res = mmpipe(
        "train", "launch.nproc=2", "placement=plan.json", f"run_dir={run}", "train.steps=1", *SMALL, cwd=tmp_path
    )
    assert res.returncode == 0, res.stderr
    assert yaml.safe_load((run / "config.yaml").read_text())["placement"] == printed
    assert (run / "checkpoints" / "latest").is_file()


def test_plan_and_train_reject_bad_input_before_starting(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # In this process: every case ends before a worker starts (the subprocess path: test_cli.py)
    code, err = mmpipe_here("plan", "cluster=h100_9", cwd=tmp_path, capsys=capsys)
    assert code == 2 and "cluster" in err and "h100_9" in err
    code, err = mmpipe_here("plan", "global_batch=-1", cwd=tmp_path, capsys=capsys)
    assert code == 2 and "global_batch" in err
    code, err = mmpipe_here("plan", "model=wan14b_t2v", "model.video.frames=80", cwd=tmp_path, capsys=capsys)
    assert code == 2 and "frames must be 4k+1" in err
    code, err = mmpipe_here("train", "--json", cwd=tmp_path, capsys=capsys)
    assert code == 2 and "--json" in err
    code, err = mmpipe_here(
        "train",
        "launch.nproc=2",
        "placement={text:[0],vae:[0],dit:[0,1]}",
        "parallel.dit.ulysses=3",
        f"run_dir={tmp_path / 'run'}",
        cwd=tmp_path,
        capsys=capsys,
    )
    assert code == 2 and "parallel.dit: ulysses=3 x ring=1 = 3 does not divide the 2 ranks" in err
    code, err = mmpipe_here(
        "train", "launch.nproc=3", "parallel.llm.ring=2", f"run_dir={tmp_path / 'run'}", cwd=tmp_path, capsys=capsys
    )
    assert code == 2 and "no stage 'llm'" in err
    assert not (tmp_path / "run").exists()
    # the default placement is known once the graph is built (the run directory then exists; no worker started)
    code, err = mmpipe_here(
        "train", "launch.nproc=3", "parallel.dit.ring=4", f"run_dir={tmp_path / 'ring4'}", cwd=tmp_path, capsys=capsys
    )
    assert code == 2 and "ring=4 = 4 does not divide the 2 ranks placed for 'dit'" in err
    code, err = mmpipe_here(
        "train",
        "launch.nproc=4",
        "placement={text:[0],vae:[0],dit:[1,2,3]}",
        "parallel.dit.ulysses=3",
        f"run_dir={tmp_path / 'heads'}",
        cwd=tmp_path,
        capsys=capsys,
    )
    assert code == 2 and f"{ModelConfig().dit_heads} attention heads cannot be split over ulysses=3" in err
    code, err = mmpipe_here(
        "train", "model=wan14b_t2v", "train.steps=1", f"run_dir={tmp_path / 'big'}", cwd=tmp_path, capsys=capsys
    )
    assert code == 2 and "architecture-only" in err


def test_profile_then_train_with_the_planned_placement(tmp_path: Path) -> None:
    cal_path = tmp_path / "cache" / "calibration-cpu.json"  # where placement=auto looks ($MMPIPE_CACHE)
    res = mmpipe(
        "profile",
        "steps=4",
        "warmup=1",
        "data.frames=9",
        "data.height=32",
        "data.width=32",
        f"out={cal_path}",
        cwd=tmp_path,
    )
    assert res.returncode == 0, res.stderr
    cal = Calibration.load(cal_path)
    assert cal.device == "cpu" and set(cal.stages) == {"text", "vae", "dit"}
    assert all(entry["forward"] > 0 for entry in cal.stages.values())
    # one line through 2 and 4 samples, one through 1 and 2 ("upto_2") that prices smaller actions
    assert all(entry["forward_upto_2"] > 0 and "forward_overhead_s_upto_2" in entry for entry in cal.stages.values())
    assert "(below 2 samples: " in res.stdout
    assert cal.stages["dit"]["backward"] > 0 and cal.stages["dit"]["step_s"] > 0
    assert cal.latency_s is not None and cal.latency_s > 0 and cal.bandwidth

    run = tmp_path / "run"
    res = mmpipe("train", "launch.nproc=2", "placement=auto", "train.steps=2", f"run_dir={run}", *SMALL, cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    assert "calibrating" not in res.stdout + res.stderr  # planned with the profile just made
    saved = yaml.safe_load((run / "config.yaml").read_text())["placement"]
    assert set(saved) == {"text", "vae", "dit"} and all(set(g["ranks"]) <= {0, 1} for g in saved.values())
    assert "validation loss:" in res.stdout
