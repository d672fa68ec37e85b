"""``mmpipe serve`` and the device: ``device=cuda`` refused on a machine without CUDA before any
worker starts or anything is written, and the placement a user who names none gets per device."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mmpipe.config import ServeConfig
from mmpipe.devices import DeviceType
from mmpipe.serve.engine import Engine
from mmpipe.serve.placement import default_placement, resolve_placement


def test_engine_refuses_device_cuda_without_cuda(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    cfg = ServeConfig(device="cuda", run_dir=str(tmp_path / "run"), port=0)
    with pytest.raises(ValueError, match="device=cuda"):
        Engine(cfg)
    assert not (tmp_path / "run").exists()


def test_cli_refuses_device_cuda_without_cuda_with_status_2(tmp_path: Path) -> None:
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}  # no GPU for the child, on any machine
    cmd = [sys.executable, "-m", "mmpipe.cli", "serve", "device=cuda", "port=0", f"run_dir={tmp_path / 'run'}"]
    done = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr[-2000:]
    assert "device=cuda" in done.stderr
    assert "mmpipe serve:" not in done.stdout  # no URL: no server, no worker
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # no run directory, nothing else


def test_default_placement_per_device() -> None:
    assert default_placement(DeviceType.CPU, 0) == {"text": [0], "denoise": [0, 1], "decode": [0, 1]}
    assert ServeConfig().placement is None  # the device decides
    assert default_placement(DeviceType.CUDA, 1) == {"text": [0], "denoise": [0], "decode": [0]}
    assert default_placement(DeviceType.CUDA, 2) == {"text": [0, 1], "denoise": [0, 1], "decode": [0, 1]}


def test_a_given_placement_is_kept_and_the_default_follows_the_device() -> None:
    given = {"text": [0], "denoise": [1], "decode": [0]}
    for device, gpus in ((DeviceType.CPU, 0), (DeviceType.CUDA, 1)):
        assert resolve_placement(given, device, gpus) == given
    assert resolve_placement(None, DeviceType.CPU, 0) == {"text": [0], "denoise": [0, 1], "decode": [0, 1]}
    assert resolve_placement(None, DeviceType.CUDA, 1) == {"text": [0], "denoise": [0], "decode": [0]}
    # the default CPU layout written out is kept on a GPU as given (two groups sharing it)
    cpu = {"text": [0], "denoise": [0, 1], "decode": [0, 1]}
    assert resolve_placement(cpu, DeviceType.CUDA, 1) == cpu
