"""``mmpipe generate device=cuda`` on a machine without CUDA, through the console script: exit
status 2, the error names ``device=cuda``, and nothing is written."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import yaml

from mmpipe.config import RunConfig, to_dict


def test_device_cuda_without_a_gpu_exits_2_before_writing(tiny_wan_dir: Path, tmp_path: Path) -> None:
    run = tmp_path / "run"
    shutil.copytree(tiny_wan_dir, run / "pipeline")
    cfg = to_dict(RunConfig(run_dir=str(run)))
    cfg["model"]["path"] = str(run / "pipeline")
    (run / "config.yaml").write_text(yaml.safe_dump(cfg))
    (run / "checkpoints" / "step_00000001").mkdir(parents=True)
    (run / "checkpoints" / "latest").write_text("step_00000001\n")
    before = sorted(tmp_path.rglob("*"))
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}  # no GPU, wherever this runs
    done = subprocess.run(
        [sys.executable, "-m", "mmpipe.cli", "generate", f"ckpt={run}", "device=cuda", f"out={tmp_path / 'out'}"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 2, done.stderr[-3000:]
    assert "mmpipe generate: error: device=cuda, but this machine has no usable CUDA device" in done.stderr
    assert sorted(tmp_path.rglob("*")) == before
