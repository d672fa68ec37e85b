"""Activation policies inside the pipelined runtime: the DiT on its own rank with 4 micro-batches in
flight (1F1B), half its blocks recomputed and a quarter offloaded to the file tier, trains bit for
bit like the single-process run without any policy."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_parity import dit_params

from mmpipe.config import DataConfig, LaunchConfig, ModelConfig, RunConfig, StageMemoryConfig, TrainConfig
from mmpipe.runtime.events import read_events
from mmpipe.rundir import read_metrics
from mmpipe.train import train


def _run(run_dir: Path, nproc: int, placement: dict | None, memory: dict | None = None) -> None:
    # 64 x 64 clips of 17 frames: the DiT's saved activations exceed the offload threshold (64 KiB);
    # a DiT of 4 blocks of 16 heads, so that half, a quarter and one policy per block are whole blocks
    train(
        RunConfig(
            run_dir=str(run_dir),
            model=ModelConfig(dit_layers=4, dit_heads=16),
            data=DataConfig(frames=17, height=64, width=64, num_samples=32, val_samples=8),
            train=TrainConfig(
                steps=2, batch_size=8, micro_batches=4, warmup_steps=1, log_every=1, val_every=1000,
                ckpt_every=2, progress=False, threads=1,
            ),
            launch=LaunchConfig(nproc=nproc, timeout_s=120),
            placement=placement,
            memory=memory or {},
        )
    )  # fmt: skip


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("ref")
    _run(root, 1, None)
    return root


def _same_training(ref_dir: Path, run_dir: Path) -> None:
    ref, got = read_metrics(ref_dir), read_metrics(run_dir)
    assert [r.get("loss") for r in got] == [r.get("loss") for r in ref]
    assert [r.get("grad_norm") for r in got] == [r.get("grad_norm") for r in ref]
    assert got[-1]["val_loss"] == ref[-1]["val_loss"]
    pr, pg = dit_params(ref_dir), dit_params(run_dir)
    assert all(torch.equal(pr[k], pg[k]) for k in pr), [k for k in pr if not torch.equal(pr[k], pg[k])]


def test_recompute_and_offload_in_the_pipeline_are_bitwise_identical(reference: Path, tmp_path: Path) -> None:
    # 4 blocks: recompute 0.5 -> 2 recomputed; offload 0.5 of the other 2 -> 1 offloaded, 1 kept
    dit = {"ranks": [1], "recompute": 0.5, "offload": 0.5}
    _run(tmp_path / "mem", 2, {"text": [0], "vae": [0], "dit": dit})
    _same_training(reference, tmp_path / "mem")
    got = read_metrics(tmp_path / "mem")
    offloaded = [r["offloaded_bytes"] for r in got if "offloaded_bytes" in r]
    assert len(offloaded) == 2 and 0 < offloaded[0] < offloaded[1]  # cumulative, every step moved some
    assert not list((tmp_path / "mem" / "spill" / "rank1").iterdir())  # the spill file left nothing behind


def test_a_policy_per_block_from_the_config_with_offload_events(reference: Path, tmp_path: Path) -> None:
    """``memory.dit.blocks=[offload, recompute, selective, keep]``: bitwise the same training, and
    every DiT forward records the bytes it offloaded, every backward the bytes it got back."""
    blocks = StageMemoryConfig(blocks=["offload", "recompute", "selective", "keep"])
    _run(tmp_path / "blocks", 2, {"text": [0], "vae": [0], "dit": [1]}, {"dit": blocks})
    _same_training(reference, tmp_path / "blocks")
    events = [e for e in read_events(tmp_path / "blocks") if e["stage"] == "dit" and e["phase"] == "train"]
    forwards = [e for e in events if e["kind"] == "F"]
    backwards = [e for e in events if e["kind"] == "B"]
    assert len(forwards) == len(backwards) == 2 * 4  # 2 steps x 4 micro-batches
    assert len({e["offloaded_bytes"] for e in forwards}) == 1 and forwards[0]["offloaded_bytes"] > 0
    assert not any("offloaded_bytes" in e for e in backwards)
    # every backward got its micro-batch's tensors back (a tensor several ops save may be read twice)
    assert all(e.get("offload_returned_bytes", 0) >= forwards[0]["offloaded_bytes"] for e in backwards)
    total = read_metrics(tmp_path / "blocks")[-1]["offloaded_bytes"]
    assert sum(e["offloaded_bytes"] for e in forwards) == total  # the metrics count the same bytes
