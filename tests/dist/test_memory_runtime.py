"""Activation policies inside the pipelined runtime: the DiT on its own rank with 4 micro-batches in
flight (1F1B), half its blocks recomputed and a quarter offloaded to the file tier, trains bit for
bit like the single-process run without any policy."""

from __future__ import annotations

from pathlib import Path

import torch
from test_parity import dit_params

from mmpipe.config import DataConfig, LaunchConfig, RunConfig, TrainConfig
from mmpipe.train import read_metrics, train


def _run(run_dir: Path, nproc: int, placement: dict | None) -> None:
    # 64 x 64 clips of 17 frames: the DiT's saved activations exceed the offload threshold (64 KiB)
    train(
        RunConfig(
            run_dir=str(run_dir),
            data=DataConfig(frames=17, height=64, width=64, num_samples=32, val_samples=8),
            train=TrainConfig(
                steps=2, batch_size=8, micro_batches=4, warmup_steps=1, log_every=1, val_every=1000,
                ckpt_every=2, progress=False, threads=1,
            ),
            launch=LaunchConfig(nproc=nproc, timeout_s=120),
            placement=placement,
        )
    )  # fmt: skip


def test_recompute_and_offload_in_the_pipeline_are_bitwise_identical(tmp_path: Path) -> None:
    _run(tmp_path / "ref", 1, None)
    # 4 blocks: recompute 0.5 -> 2 recomputed; offload 0.5 of the other 2 -> 1 offloaded, 1 kept
    dit = {"ranks": [1], "recompute": 0.5, "offload": 0.5}
    _run(tmp_path / "mem", 2, {"text": [0], "vae": [0], "dit": dit})
    ref, got = read_metrics(tmp_path / "ref"), read_metrics(tmp_path / "mem")
    assert [r.get("loss") for r in got] == [r.get("loss") for r in ref]
    assert [r.get("grad_norm") for r in got] == [r.get("grad_norm") for r in ref]
    assert got[-1]["val_loss"] == ref[-1]["val_loss"]
    pr, pg = dit_params(tmp_path / "ref"), dit_params(tmp_path / "mem")
    assert all(torch.equal(pr[k], pg[k]) for k in pr), [k for k in pr if not torch.equal(pr[k], pg[k])]
    offloaded = [r["offloaded_bytes"] for r in got if "offloaded_bytes" in r]
    assert len(offloaded) == 2 and 0 < offloaded[0] < offloaded[1]  # cumulative, every step moved some
    assert not list((tmp_path / "mem" / "spill" / "rank1").glob("*.bin"))  # every tensor came back
