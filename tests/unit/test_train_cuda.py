"""``mmpipe train device=cuda`` on one GPU: the stages on the device in the run's precision, the
loop's losses finite, the CUDA allocator in the memory samples. Skipped without CUDA (the GPU
script runs it)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from mmpipe.config import DataConfig, RunConfig, TrainConfig
from mmpipe.graph import Graph
from mmpipe.rundir import read_metrics
from mmpipe.train import train
from mmpipe.train.loop import start_rank
from mmpipe.train.prepare import prepare_run

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

SMALL = DataConfig(frames=9, height=32, width=32, val_samples=4)


def cuda_run(run_dir: Path, **train_kw: object) -> RunConfig:
    kw: dict = dict(batch_size=4, micro_batches=2, steps=3, progress=False, log_every=1, val_every=1000)
    kw.update(train_kw)
    return RunConfig(run_dir=str(run_dir), device="cuda", data=SMALL, train=TrainConfig(**kw))


def test_stages_live_on_the_gpu_in_bf16_with_fp32_masters(tmp_path: Path) -> None:
    cfg = cuda_run(tmp_path / "run")
    _, graph, cfg = prepare_run(cfg)
    assert isinstance(graph, Graph)
    loop = start_rank(cfg, graph, rank=0, world_size=1)
    mods = loop.executor.modules
    assert all(p.is_cuda for m in mods.values() for p in m.parameters())
    assert {p.dtype for p in mods["text"].parameters()} == {torch.bfloat16}  # frozen: bf16 weights
    assert {p.dtype for p in mods["dit"].parameters()} == {torch.float32}  # trained: fp32 masters
    record = loop.train_step(0)
    assert record is not None and np.isfinite(record["loss"])


def test_training_on_cuda_records_the_allocator(tmp_path: Path) -> None:
    result = train(cuda_run(tmp_path / "run", steps=2))
    losses = [r["loss"] for r in read_metrics(result.run_dir)[1:]]
    assert len(losses) == 2 and all(np.isfinite(losses))
    samples = [json.loads(x) for p in (result.run_dir / "memory").glob("*.jsonl") for x in p.read_text().splitlines()]
    assert samples and all("cuda_peak" in s for s in samples), samples[:2]


def test_events_time_the_device_not_the_launch(tmp_path: Path) -> None:
    import time

    from mmpipe.runtime.events import EventRecorder, read_events
    from mmpipe.sched.plan import Action

    rec = EventRecorder(tmp_path, 0, torch.device("cuda"))
    t0 = time.perf_counter()
    start = rec.mark()
    torch.cuda._sleep(100_000_000)  # ~50 ms of device time at ~2 GHz, launched in microseconds
    end = rec.mark()
    launched = time.perf_counter() - t0
    rec.record(Action.parse("dit:F:mb0"), start, end, 0)
    rec.close()
    (event,) = read_events(tmp_path)
    assert event["end"] - event["start"] > 0.02 > launched, (event, launched)
