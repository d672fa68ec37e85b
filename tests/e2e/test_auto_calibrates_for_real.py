"""``placement=auto`` with an empty ``$MMPIPE_CACHE``: the real calibration (``mmpipe profile``'s runs,
in a child process) is made once, written whole, and the next run plans from it without
calibrating again. No training worker starts: ``prepare_run`` is what runs before them."""

from __future__ import annotations

from pathlib import Path

import pytest

from mmpipe.config import DataConfig, LaunchConfig, ModelConfig, RunConfig, TrainConfig
from mmpipe.sched.calibration import Calibration
from mmpipe.train import prepare


def test_auto_calibrates_for_real_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MMPIPE_CACHE", str(tmp_path / "cache"))
    calls: list[Path] = []
    real = prepare.run_calibration

    def counted(model: ModelConfig, data: DataConfig, path: Path) -> None:
        calls.append(path)
        real(model, data, path)

    monkeypatch.setattr(prepare, "run_calibration", counted)
    placements = []
    for name in ("a", "b"):
        cfg = RunConfig(
            run_dir=str(tmp_path / name),
            data=DataConfig(frames=9, height=32, width=32, val_samples=4),
            train=TrainConfig(steps=2, batch_size=4, micro_batches=2, progress=False),
            launch=LaunchConfig(nproc=2),
            placement="auto",
        )
        placements.append(prepare.prepare_run(cfg)[2].placement)
    path = tmp_path / "cache" / "calibration-cpu.json"
    assert calls == [path]
    cal = Calibration.load(path)
    assert set(cal.stages) == {"text", "vae", "dit"} and cal.stages["dit"]["backward"] > 0
    sharded = {f"sharded_{k}_overhead_s" for k in ("forward", "backward", "step")}
    assert sharded <= set(cal.stages["dit"])  # the two-rank FSDP run: the trained stage only
    assert not sharded & (set(cal.stages["text"]) | set(cal.stages["vae"]))
    assert cal.latency_s is not None and cal.bandwidth
    assert sorted(p.name for p in path.parent.iterdir()) == ["calibration-cpu.json", "costs"]  # no temporary left
    assert placements[0] == placements[1] and isinstance(placements[0], dict)
