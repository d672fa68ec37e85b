"""The serving engine on CUDA (skipped without a GPU): stages placed in serving precision, and the
difference batching makes to a request's output, bounded.

On CPU the engine's batching is bitwise (``test_engine.py``). On CUDA bf16 GEMMs and attention may
choose another kernel, hence another reduction order, for another batch size (cuBLAS by problem
shape, flash attention's split-KV by blocks per SM), so a request batched with others is compared
with the same request run alone under a stated bound instead.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from mmpipe.config import ServeConfig
from mmpipe.models.wan import from_diffusers
from mmpipe.serve.batching import make_row_exact
from mmpipe.serve.engine import Engine
from mmpipe.serve.metrics import ServeMetrics
from mmpipe.serve.placement import place_stages
from mmpipe.serve.protocol import GenerationRequest, JobStatus

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

SMALL = {"height": 32, "width": 32, "frames": 5, "steps": 6, "guidance": 5.0}
PROMPTS = ["a red circle moving left", "a blue square moving up", "a green triangle moving right"]
# Bounds on uint8 frames (0..255) of the tiny pipeline, from a CPU measurement: perturbing the
# DiT's output by a random +-1 bf16 ulp at every step (what a changed reduction order does to one
# rounding) moved its frames by 0.3-0.5 levels on average (6-10 at most); by +-4 ulps, 1.4-1.9 on
# average (37-41 at most). Another seed of the same prompt moves them by 9 levels on average (78 at
# most), so a request computed from another's rows would fail. So: a mean of 2 levels (about 4 ulps
# of noise per step) and a maximum of a quarter of the range.
MEAN_LEVELS, MAX_LEVELS = 2.0, 64


class RecordingMetrics(ServeMetrics):
    """The real metrics, plus the DiT's batch sizes."""

    def __init__(self) -> None:
        super().__init__()
        self.dit_batches: list[int] = []

    def observe_stage(self, stage: str, queue_s: float, run_s: float, batch_size: int) -> None:
        super().observe_stage(stage, queue_s, run_s, batch_size)
        if stage == "denoise":
            self.dit_batches.append(batch_size)


@pytest.fixture(scope="module")
def engine(tiny_wan_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engine]:
    cfg = ServeConfig(
        pipeline=str(tiny_wan_dir),
        device="cuda",
        run_dir=str(tmp_path_factory.mktemp("serve_cuda_run")),
        text_len=16,
        max_batch=4,
        max_wait_ms=300.0,  # the first DiT batch waits for its companions
    )
    with Engine(cfg, metrics=RecordingMetrics()) as eng:
        yield eng


def _frames(engine: Engine, requests: list[GenerationRequest]) -> list[np.ndarray]:
    jobs = [engine.submit(r) for r in requests]
    for job in jobs:
        assert job.wait(120), "request did not finish"
        assert job.status is JobStatus.COMPLETED, job.error
        assert job.frames is not None
    return [job.frames.astype(np.int16) for job in jobs if job.frames is not None]


def test_default_placement_on_one_gpu_is_one_group_running_every_stage(engine: Engine) -> None:
    gpus = torch.cuda.device_count()
    assert engine.cfg.placement == {s: list(range(gpus)) for s in ("text", "denoise", "decode")}


def test_a_batched_request_stays_within_the_bound_of_its_run_alone(engine: Engine) -> None:
    target = GenerationRequest(prompt=PROMPTS[0], seed=7, **SMALL)
    (alone,) = _frames(engine, [target])
    others = [GenerationRequest(prompt=PROMPTS[i % 3], seed=100 + i, **SMALL) for i in range(3)]
    batched = _frames(engine, [target, *others])
    assert isinstance(engine.metrics, RecordingMetrics) and max(engine.metrics.dit_batches) >= 3, "no DiT batch formed"
    diff = np.abs(batched[0] - alone)
    assert diff.mean() <= MEAN_LEVELS and diff.max() <= MAX_LEVELS, (diff.mean(), diff.max())
    # the bound is tight enough to tell requests apart: the same prompt with another seed is far outside it
    assert np.abs(batched[1] - alone).mean() > 2 * MEAN_LEVELS


def test_stages_are_placed_in_serving_precision_on_the_gpu(tiny_wan_dir: Path) -> None:
    graph = from_diffusers(tiny_wan_dir, max_sequence_length=16)
    place_stages(graph, torch.device("cuda", 0), {"text", "denoise"})
    dit = graph.denoise.module
    assert {p.device.type for p in dit.parameters()} == {"cuda"}
    assert dit.patch_embedding.weight.dtype == torch.bfloat16
    assert dit.scale_shift_table.dtype == torch.float32  # diffusers keeps it in float32
    assert next(graph.text.module.parameters()).dtype == torch.bfloat16
    vae = graph.decode.module
    assert {(p.device.type, p.dtype) for p in vae.parameters()} == {("cpu", torch.float32)}  # not this group's


def test_dit_rows_batched_stay_within_a_few_bf16_ulps_of_their_rows_alone(tiny_wan_dir: Path) -> None:
    graph = from_diffusers(tiny_wan_dir, max_sequence_length=16)
    place_stages(graph, torch.device("cuda", 0), {"denoise"})
    dit = graph.denoise.module
    make_row_exact(dit)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(4, 16, 2, 8, 8, generator=gen).to("cuda", torch.bfloat16)
    ctx = torch.randn(4, 16, dit.config.text_dim, generator=gen).to("cuda", torch.bfloat16)
    ts = torch.tensor([999.0, 750.0, 500.0, 10.0], device="cuda")
    with torch.no_grad():
        batched = dit(hidden_states=x, timestep=ts, encoder_hidden_states=ctx, return_dict=False)[0].float()
        for i in range(4):
            row = {"hidden_states": x[i : i + 1], "timestep": ts[i : i + 1], "encoder_hidden_states": ctx[i : i + 1]}
            alone = dit(**row, return_dict=False)[0].float()
            # One reduction order for another flips bf16 roundings of intermediate activations by an
            # ulp; through the tiny DiT's layers that stays within a few ulps of the output's scale.
            bound = 4 * torch.finfo(torch.bfloat16).eps * alone.abs().max().item()
            assert (batched[i : i + 1] - alone).abs().max().item() <= bound, i
