"""Single-process training: the loss falls, resume is bitwise exact, folder data trains."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from diffusers import WanTransformer3DModel

from mmpipe.config import DataConfig, ModelConfig, RunConfig, TrainConfig
from mmpipe.data import write_mp4
from mmpipe.rundir import latest_checkpoint, read_metrics
from mmpipe.runtime.checkpoint import load_latest_weights
from mmpipe.train import train

SMALL_DATA = DataConfig(frames=9, height=32, width=32, num_samples=64, val_samples=4)


def small_run(run_dir: Path, **train_kw: object) -> RunConfig:
    kw: dict = dict(batch_size=4, micro_batches=2, warmup_steps=2, progress=False, log_every=1, val_every=1000)
    kw.update(train_kw)
    return RunConfig(run_dir=str(run_dir), data=SMALL_DATA, train=TrainConfig(**kw))


def dit_params(run_dir: Path) -> dict[str, torch.Tensor]:
    model = WanTransformer3DModel.from_pretrained(run_dir / "pipeline" / "transformer")
    load_latest_weights(run_dir, {"dit": model})
    return {k: v.clone() for k, v in model.state_dict().items()}


def test_training_lowers_the_validation_loss(tmp_path: Path) -> None:
    result = train(small_run(tmp_path / "run", steps=40, val_every=20, ckpt_every=20, lr=3e-3))
    assert result.first_val_loss is not None
    # Random init predicts ~unit-variance noise; a few dozen steps must learn the data's mean velocity.
    assert result.last_val_loss < 0.7 * result.first_val_loss, (result.first_val_loss, result.last_val_loss)
    records = read_metrics(result.run_dir)
    assert [r["step"] for r in records] == list(range(41))
    assert {"loss", "grad_norm", "lr", "samples_per_s"} <= set(records[-1])
    assert records[20]["val_loss"] < records[0]["val_loss"]
    assert latest_checkpoint(result.run_dir).name == "step_00000040"


def test_resume_continues_bitwise_identically(tmp_path: Path) -> None:
    # constant lr: the part run stands for a crashed 6-step run, and a cosine decay would end at its step 3
    full = train(small_run(tmp_path / "full", steps=6, ckpt_every=3, lr_schedule="constant"))
    part = train(small_run(tmp_path / "part", steps=3, ckpt_every=3, lr_schedule="constant"))
    # A crashed run may have logged past its checkpoint: resume drops that tail.
    with (part.run_dir / "metrics.jsonl").open("a") as f:
        f.write(json.dumps({"step": 4, "loss": -1.0}) + "\n")
    resumed = train(small_run(tmp_path / "part", steps=6, ckpt_every=3, resume=True, lr_schedule="constant"))
    a, b = read_metrics(full.run_dir), read_metrics(resumed.run_dir)
    assert [r["step"] for r in b] == [r["step"] for r in a] == list(range(7))
    for ra, rb in zip(a[1:], b[1:], strict=True):
        assert (ra["loss"], ra["grad_norm"], ra["lr"]) == (rb["loss"], rb["grad_norm"], rb["lr"])
    pa, pb = dit_params(full.run_dir), dit_params(resumed.run_dir)
    assert pa.keys() == pb.keys()
    for k in pa:
        assert torch.equal(pa[k], pb[k]), k
    assert resumed.last_val_loss == full.last_val_loss


def test_resume_and_run_dir_misuse_is_rejected(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="has no checkpoint"):
        train(small_run(tmp_path / "empty", steps=2, resume=True))
    train(small_run(tmp_path / "run", steps=1))
    with pytest.raises(ValueError, match="already has checkpoints: pass train.resume=true"):
        train(small_run(tmp_path / "run", steps=2))
    changed = small_run(tmp_path / "run", steps=2, resume=True)
    changed.model = ModelConfig(dit_layers=3)
    with pytest.raises(ValueError, match="model config differs"):
        train(changed)


def test_trains_on_a_folder_of_videos(tmp_path: Path) -> None:
    root = tmp_path / "videos"
    root.mkdir()
    rng = np.random.default_rng(0)
    lines = []
    for i, caption in enumerate(["a blue ball rolls", "waves on a beach", "a car drives by"]):
        frames = (rng.random((12, 40, 56, 3)) * 255).astype(np.uint8)
        write_mp4(frames, root / f"clip{i}.mp4")
        lines.append(json.dumps({"video": f"clip{i}.mp4", "caption": caption}))
    write_mp4(np.zeros((3, 40, 56, 3), np.uint8), root / "short.mp4")  # too short: skipped
    lines.append(json.dumps({"video": "short.mp4", "caption": "too short"}))
    (root / "captions.jsonl").write_text("\n".join(lines) + "\n")
    cfg = small_run(tmp_path / "run", steps=2, batch_size=2)
    cfg.data = DataConfig(root=str(root), frames=9, height=32, width=32, val_samples=2)
    with pytest.warns(UserWarning, match="skipped 1 of 4 videos"):
        result = train(cfg)
    assert len(read_metrics(result.run_dir)) == 3
    vocab = json.loads((result.run_dir / "pipeline" / "tokenizer" / "tokenizer.json").read_text())["model"]["vocab"]
    assert {"waves", "beach", "car"} <= set(vocab)


def test_bf16_autocast_trains(tmp_path: Path) -> None:
    result = train(small_run(tmp_path / "run", steps=2, precision="bf16"))
    losses = [r["loss"] for r in read_metrics(result.run_dir)[1:]]
    assert len(losses) == 2 and all(np.isfinite(losses))
    assert np.isfinite(result.last_val_loss)


def test_a_save_killed_between_files_resumes_from_the_previous_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Fault injection: the save of step 4 dies after DCP wrote its files and before they are
    synced and published. ``latest`` still names step 2; the next run removes the leftover
    ``step_00000004.tmp`` and ends bitwise where an uninterrupted run ends."""
    import mmpipe.runtime.checkpoint as ckpt

    full = train(small_run(tmp_path / "full", steps=6, ckpt_every=2))
    real = ckpt._fsync_tree

    def dies_at_step_4(root: Path) -> None:
        if root.name == "step_00000004.tmp":
            assert any(root.iterdir())  # DCP has written files: the crash is between files and marker
            raise OSError("injected fault: the process died mid-save")
        real(root)

    monkeypatch.setattr(ckpt, "_fsync_tree", dies_at_step_4)
    with pytest.raises(OSError, match="injected fault"):
        train(small_run(tmp_path / "part", steps=6, ckpt_every=2))
    root = tmp_path / "part" / "checkpoints"
    assert (root / "latest").read_text().strip() == "step_00000002"
    assert (root / "step_00000004.tmp").is_dir() and not (root / "step_00000004").exists()
    monkeypatch.setattr(ckpt, "_fsync_tree", real)
    resumed = train(small_run(tmp_path / "part", steps=6, ckpt_every=2, resume=True))
    assert not list(root.glob("*.tmp"))  # the stale folder went at the start
    pa, pb = dit_params(full.run_dir), dit_params(resumed.run_dir)
    for k in pa:
        assert torch.equal(pa[k], pb[k]), k


def test_the_marker_moves_atomically(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``latest`` is replaced by a rename of a synced temporary file, never rewritten in place."""
    import os

    import mmpipe.runtime.checkpoint as ckpt

    replaced: list[tuple[str, str]] = []
    real = os.replace
    monkeypatch.setattr(ckpt.os, "replace", lambda a, b: (replaced.append((Path(a).name, Path(b).name)), real(a, b)))
    train(small_run(tmp_path / "run", steps=2, ckpt_every=1))
    assert replaced == [("latest.tmp", "latest")] * 2
    assert (tmp_path / "run" / "checkpoints" / "latest").read_text() == "step_00000002\n"


def test_frozen_output_cache_keeps_the_losses_and_skips_the_frozen_stages(tmp_path: Path) -> None:
    # 8 samples, 4 a step: epochs 2 and 3 are served from the cache (VAE latents, text embeddings)
    data = DataConfig(frames=9, height=32, width=32, num_samples=8, val_samples=4)
    runs = {}
    for gb in (0.0, 1.0):
        cfg = small_run(tmp_path / f"cache{gb}", steps=6, cache_frozen_gb=gb, caption_dropout=0.25)
        runs[gb] = read_metrics(train(dataclasses.replace(cfg, data=data)).run_dir)
    for off, on in zip(runs[0.0][1:], runs[1.0][1:], strict=True):
        assert on["loss"] == pytest.approx(off["loss"], rel=1e-5, abs=1e-7), (off, on)
    assert not any("frozen_cache_hits" in r for r in runs[0.0])
    hits = [r.get("frozen_cache_hits", 0) for r in runs[1.0][1:]]
    # epoch 1 (steps 1-2) computes every row; after it the VAE's every row comes from the cache
    # (its latents do not depend on the caption dropout), the text encoder's where the micro-batch's
    # captions were all seen (a dropped one is the one empty caption)
    assert hits[:2] == [0, 0] and hits[-1] > 0 and hits == sorted(hits), hits
    events = (tmp_path / "cache1.0" / "events" / "rank0.jsonl").read_text().splitlines()
    served = [e for e in map(json.loads, events) if "frozen_cache_rows" in e and e["phase"] == "train"]
    assert {e["stage"] for e in served} <= {"text", "vae"} and all(e["kind"] == "F" for e in served)
    assert sum(e["frozen_cache_rows"] for e in served) == hits[-1]
    assert sum(e["frozen_cache_rows"] for e in served if e["stage"] == "vae") == 4 * 4  # steps 3-6, 4 rows each
