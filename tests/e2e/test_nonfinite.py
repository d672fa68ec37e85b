"""``train.nonfinite``: an injected NaN stops the run naming step, stage and tensor (the last good
checkpoint kept), or drops that step's update and goes on (``skip``), up to ``train.max_skipped``."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import pytest
import torch
from diffusers import WanTransformer3DModel

from mmpipe.config import DataConfig, RunConfig, TrainConfig
from mmpipe.rundir import latest_checkpoint, read_metrics
from mmpipe.runtime.checkpoint import load_latest_weights
from mmpipe.train import train
from mmpipe.train.loop import TrainLoop

SMALL = DataConfig(frames=5, height=32, width=32, val_samples=2)


def run(tmp: Path, **kw: Any) -> RunConfig:
    base: dict[str, Any] = dict(steps=5, batch_size=2, micro_batches=1, progress=False, log_every=1, val_every=1000)
    return RunConfig(run_dir=str(tmp), device="cpu", data=SMALL, train=TrainConfig(**{**base, **kw}))


def nan_video_at(monkeypatch: pytest.MonkeyPatch, steps: Iterable[int]) -> None:
    """Training steps (0-based) whose clips are NaN: the VAE's latents, then the loss, go NaN."""
    real: Callable[[TrainLoop, int], Any] = TrainLoop.batch_fn
    bad = set(steps)

    def batch_fn(self: TrainLoop, step: int) -> Callable[[int], dict[str, torch.Tensor]]:
        fn = real(self, step)
        if step not in bad:
            return fn
        return lambda mb: {**fn(mb), "video": torch.full_like(fn(mb)["video"], float("nan"))}

    monkeypatch.setattr(TrainLoop, "batch_fn", batch_fn)


def test_stop_names_the_step_stage_and_loss_and_keeps_the_last_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    nan_video_at(monkeypatch, [2])
    with pytest.raises(RuntimeError, match=r"training step 3: stage 'dit': the loss is nan \(train.nonfinite=stop\)"):
        train(run(tmp_path, ckpt_every=2))
    ckpt = latest_checkpoint(tmp_path)
    assert ckpt is not None and ckpt.name == "step_00000002"
    assert [r["step"] for r in read_metrics(tmp_path)] == [0, 1, 2]  # nothing logged for the bad step


def test_stop_names_the_parameter_whose_gradient_went_nan(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real = TrainLoop.train_step

    def train_step(self: TrainLoop, step: int) -> Any:
        if step != 1:
            return real(self, step)
        name, param = next(iter(self.executor.modules["dit"].named_parameters()))
        handle = param.register_hook(lambda g: torch.full_like(g, float("nan")))  # the loss stays finite
        try:
            return real(self, step)
        finally:
            handle.remove()

    monkeypatch.setattr(TrainLoop, "train_step", train_step)
    with pytest.raises(RuntimeError, match=r"training step 2: stage 'dit': the gradient of \S+ is NaN"):
        train(run(tmp_path))


def test_skip_drops_the_update_counts_it_and_goes_on(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    nan_video_at(monkeypatch, [2])
    result = train(run(tmp_path, nonfinite="skip", ckpt_every=1))
    records = {r["step"]: r for r in read_metrics(result.run_dir)}
    assert records[3]["skipped_updates"] == 1 and records[3]["skipped_steps"] == 1
    assert "skipped_updates" not in records[4] and records[5]["loss"] == records[5]["loss"]  # finite again
    # the dropped update left the parameters (and the lr schedule) as they were after step 2
    after2 = dit_params_at(result.run_dir, 2)
    after3 = dit_params_at(result.run_dir, 3)
    assert all(torch.equal(after2[k], after3[k]) for k in after2)
    assert records[2]["lr"] == records[3]["lr"] < records[4]["lr"]  # the warm-up schedule waited a step


def test_skip_stops_after_max_skipped_in_a_row(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    nan_video_at(monkeypatch, [1, 2, 3])
    with pytest.raises(RuntimeError, match=r"training step 4: 3 steps in a row had non-finite gradients"):
        train(run(tmp_path, nonfinite="skip", max_skipped=3, ckpt_every=1))
    ckpt = latest_checkpoint(tmp_path)
    assert ckpt is not None and ckpt.name == "step_00000003"


def dit_params_at(run_dir: Path, step: int) -> dict[str, torch.Tensor]:
    """The DiT's weights of checkpoint ``step`` (through the public loader, as generate reads them)."""
    marker = run_dir / "checkpoints" / "latest"
    saved = marker.read_text()
    marker.write_text(f"step_{step:08d}\n")
    try:
        model = WanTransformer3DModel.from_pretrained(run_dir / "pipeline" / "transformer")
        load_latest_weights(run_dir, {"dit": model})
        return {k: v.clone() for k, v in model.state_dict().items()}
    finally:
        marker.write_text(saved)
