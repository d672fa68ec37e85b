"""``model.compile=true``: regional compilation of the trained DiT's blocks trains like eager."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
import torch

from mmpipe.config import DataConfig, ModelConfig, RunConfig, TrainConfig
from mmpipe.errors import PlanError
from mmpipe.rundir import read_metrics
from mmpipe.runtime.executor import compile_blocks
from mmpipe.train import train

SMALL = DataConfig(frames=5, height=32, width=32, val_samples=2)


def run(tmp: Path, compiled: bool) -> list[float]:
    cfg = RunConfig(
        run_dir=str(tmp / ("compiled" if compiled else "eager")),
        device="cpu",
        data=SMALL,
        model=dataclasses.replace(ModelConfig(dit_layers=2), compile=compiled),
        train=TrainConfig(steps=2, batch_size=2, micro_batches=1, progress=False, log_every=1, val_every=1000),
    )
    return [r["loss"] for r in read_metrics(train(cfg).run_dir) if "loss" in r]


@pytest.mark.slow
def test_compiled_blocks_train_like_eager(tmp_path: Path) -> None:
    eager, compiled = run(tmp_path, False), run(tmp_path, True)
    # Inductor fuses and reorders float32 elementwise work; two steps of a tiny DiT stay within 1e-4.
    np.testing.assert_allclose(compiled, eager, rtol=1e-4, atol=1e-5)


def test_compile_needs_repeated_blocks() -> None:
    with pytest.raises(PlanError, match=r"model.compile=true: Linear has no repeated blocks"):
        compile_blocks(torch.nn.Linear(2, 2))
    blocks = torch.nn.Sequential(torch.nn.ModuleList([torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)]))
    compile_blocks(blocks)
    assert all(b._compiled_call_impl is not None for b in blocks[0])
