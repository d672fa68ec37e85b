"""The serving engine on its own (no HTTP): batching that keeps outputs bitwise, timeouts, a dead group.

One engine for the module: the tiny Wan pipeline (``tiny_wan_dir``) on two worker processes, with
one DiT group so that concurrent requests must share its batches.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from serve_doubles import graph_failing_to_start

from mmpipe.config import ServeConfig
from mmpipe.data import frames_to_uint8
from mmpipe.models.wan import from_diffusers
from mmpipe.serve.engine import Engine, ServeStartError
from mmpipe.serve.metrics import ServeMetrics
from mmpipe.serve.protocol import GenerationRequest, JobStatus

# Four prompts for 16 x 16 single-frame requests: one latent token per sample, the shape where a
# batched DiT's cross-attention gave other bits than the row alone at 2 and 4 threads (measured on
# the DiT in test_serve_batching.py; uint8 frames hide most such last-bit differences).
ONE_TOKEN = [
    "a blue square moving up",
    "a red square moving down",
    "a green circle moving left",
    "a red circle moving up",
]


class RecordingMetrics(ServeMetrics):
    """The real metrics, plus the batch sizes each stage ran."""

    def __init__(self) -> None:
        super().__init__()
        self.batches: dict[str, list[int]] = {}

    def observe_stage(self, stage: str, queue_s: float, run_s: float, batch_size: int) -> None:
        super().observe_stage(stage, queue_s, run_s, batch_size)
        self.batches.setdefault(stage, []).append(batch_size)


@pytest.fixture(scope="module")
def engine(tiny_wan_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engine]:
    cfg = ServeConfig(
        pipeline=str(tiny_wan_dir),
        run_dir=str(tmp_path_factory.mktemp("serve_run")),
        text_len=16,
        placement={"text": [0], "denoise": [1], "decode": [0]},
        threads=1,
        max_batch=4,
        max_wait_ms=300.0,  # the first DiT batch waits for its companions
    )
    with Engine(cfg, metrics=RecordingMetrics()) as eng:
        yield eng


@pytest.fixture(scope="module", params=[1, 2, 4], ids=lambda n: f"threads{n}")
def threaded_engine(
    request: pytest.FixtureRequest, tiny_wan_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Engine]:
    """An engine whose DiT group computes with ``request.param`` torch threads (one group: every
    DiT batch is shared). At one thread, the module's ``engine`` (one engine fewer to start)."""
    if request.param == 1:
        yield request.getfixturevalue("engine")
        return
    cfg = ServeConfig(
        pipeline=str(tiny_wan_dir),
        run_dir=str(tmp_path_factory.mktemp("serve_threads_run")),
        text_len=16,
        placement={"text": [0], "denoise": [1], "decode": [0]},
        threads=request.param,
        max_batch=4,
        max_wait_ms=300.0,  # the first DiT batch waits for its companions
    )
    with Engine(cfg, metrics=RecordingMetrics()) as eng:
        yield eng


@pytest.fixture
def same_threads(threaded_engine: Engine) -> Iterator[int]:
    """This process's torch threads set to the engine's (outputs are only equal at equal thread
    counts: a GEMM may split its work otherwise), restored afterwards."""
    before = torch.get_num_threads()
    torch.set_num_threads(threaded_engine.cfg.threads)
    try:
        yield threaded_engine.cfg.threads
    finally:
        torch.set_num_threads(before)


def offline(path: Path, r: GenerationRequest) -> np.ndarray:
    graph = from_diffusers(path, max_sequence_length=16)
    video = graph.generate(
        r.prompt,
        r.negative_prompt,
        height=r.height,
        width=r.width,
        num_frames=r.frames,
        num_inference_steps=r.steps,
        guidance_scale=r.guidance,
        seed=r.seed,
        progress=False,
    )
    return frames_to_uint8(video[0])


def test_batched_requests_equal_their_offline_runs(
    threaded_engine: Engine, same_threads: int, tiny_wan_dir: Path
) -> None:
    engine = threaded_engine
    base = GenerationRequest(prompt="a red circle moving left", height=32, width=32, frames=5, steps=6)
    requests = [
        base,
        GenerationRequest(
            prompt="a blue square moving up",
            negative_prompt="blurry static",
            height=32,
            width=32,
            frames=5,
            steps=6,
            seed=3,
        ),
        GenerationRequest(
            prompt="a green triangle moving right", height=32, width=32, frames=5, steps=4, seed=4, guidance=5.0
        ),
        GenerationRequest(
            prompt="a red square moving down", height=32, width=32, frames=5, steps=6, seed=5, guidance=1.0
        ),
        GenerationRequest(prompt="a red circle moving left", height=48, width=32, frames=9, steps=5, seed=6),
        GenerationRequest(prompt="a red circle moving left", height=32, width=32, frames=5, steps=6, seed=7),
    ]
    if same_threads > 1:  # one-token rows: where batched kernels differ most (not needed at one thread)
        requests += [
            GenerationRequest(prompt=p, height=16, width=16, frames=1, steps=4, seed=8 + i)
            for i, p in enumerate(ONE_TOKEN)
        ]
    jobs = [engine.submit(r) for r in requests]
    for job in jobs:
        assert job.wait(120), f"{job.id} did not finish"
        assert job.status is JobStatus.COMPLETED, job.error
    metrics = engine.metrics
    assert isinstance(metrics, RecordingMetrics)
    assert max(metrics.batches["denoise"]) >= 3, f"no DiT batch formed: {metrics.batches['denoise']}"
    for r, job in zip(requests, jobs, strict=True):
        assert job.frames is not None and job.frames.shape == (r.frames, r.height, r.width, 3)
        assert np.array_equal(job.frames, offline(tiny_wan_dir, r)), f"seed {r.seed}: batched output differs"
    body, _ = metrics.render()
    assert b'mmpipe_serve_edge_bytes_total{edge="text->denoise"}' in body


def test_the_run_directory_has_events_memory_and_a_report(tiny_wan_dir: Path, tmp_path: Path) -> None:
    """On an engine of its own, so that what its run directory holds does not depend on which other
    tests ran before (the suite runs shuffled)."""
    from mmpipe.report.analysis import edge_traffic, load_run, rank_shares, stage_shares, steady_window, summarize
    from mmpipe.report.html import write_report

    cfg = ServeConfig(
        pipeline=str(tiny_wan_dir),
        run_dir=str(tmp_path / "serve_run"),
        text_len=16,
        placement={"text": [0], "denoise": [1], "decode": [0]},
        threads=1,
        max_batch=4,
        max_wait_ms=300.0,
    )
    with Engine(cfg) as engine:
        jobs = [
            engine.submit(GenerationRequest(prompt=p, height=32, width=32, frames=5, steps=3, seed=i))
            for i, p in enumerate(["a red circle moving left", "a blue square moving up"] * 3)
        ]
        assert all(job.wait(120) and job.status is JobStatus.COMPLETED for job in jobs)
        time.sleep(0.5)  # the memory samplers' next records
        run = load_run(engine.run_dir)
        assert {e["phase"] for e in run.events} == {"serve"}
        assert {e["rank"] for e in run.memory} == {0, 1}
        window = steady_window(run.events)
        assert window is not None
        shares = rank_shares(run.events, window)
        assert set(shares) == {0, 1} and all(0 < s.busy_fraction <= 1 for s in shares.values())
        stages = stage_shares(run.events, window)
        assert stages["text"][0] == (0,) and stages["denoise"][0] == (1,) and stages["decode"][0] == (0,)
        edges = {(t.src, t.dst): t for t in edge_traffic(run.events, window)}
        assert edges[("text", "denoise")].messages >= 6 and edges[("denoise", "decode")].bytes > 0
        summary = summarize(run, predict=False)
        assert any("serving run" in n and "6 requests finished" in n for n in summary.notes), summary.notes
        page = write_report([engine.run_dir]).read_text()
        assert "rank 0" in page and "rank 1" in page and "serving run" in page


def test_timeout_fails_the_request_and_frees_the_group(engine: Engine) -> None:
    slow = GenerationRequest(
        prompt="a red circle moving left", height=64, width=64, frames=17, steps=100, timeout_s=0.5
    )
    job = engine.submit(slow)
    assert job.wait(30)
    assert job.status is JobStatus.FAILED and job.error == "timed out after 0.5 s"
    quick = engine.submit(GenerationRequest(prompt="a red circle moving left", height=32, width=32, frames=5, steps=2))
    assert quick.wait(60) and quick.status is JobStatus.COMPLETED
    assert engine.metrics.render()[0].count(b'mmpipe_serve_requests_total{status="failed"} 1.0') == 1


def test_only_the_newest_finished_jobs_are_kept(engine: Engine) -> None:
    keep = engine.cfg.keep_results
    engine.cfg.keep_results = 2
    try:
        jobs = []
        for seed in range(3):
            jobs.append(
                engine.submit(
                    GenerationRequest(
                        prompt="a red circle moving left", height=32, width=32, frames=1, steps=1, seed=seed
                    )
                )
            )
            assert jobs[-1].wait(60) and jobs[-1].status is JobStatus.COMPLETED
        assert engine.get(jobs[0].id) is None  # forgotten: its frames are freed
        assert engine.get(jobs[1].id) is jobs[1] and engine.get(jobs[2].id) is jobs[2]
    finally:
        engine.cfg.keep_results = keep


def test_a_failed_start_ends_the_other_groups_through_their_exit_handlers(tiny_wan_dir: Path, tmp_path: Path) -> None:
    """Group 0 fails to build its graph while group 1 is still busy: the engine reports group 0's
    cause and ends group 1 with SIGTERM, which the worker turns into an orderly exit (a plain
    SIGTERM would skip its finalizers, and the semaphores they unlink would be reported leaked)."""
    pipeline = tmp_path / "pipeline"  # a link: the factory writes its marker beside it, in tmp_path
    pipeline.symlink_to(tiny_wan_dir, target_is_directory=True)
    cfg = ServeConfig(
        pipeline=str(pipeline),
        run_dir=str(tmp_path / "run"),
        text_len=16,
        placement={"text": [0], "denoise": [1], "decode": [0]},
        threads=1,
    )
    with pytest.raises(ServeStartError, match="serving group 0 failed to start: RuntimeError: injected fault") as err:
        Engine(cfg, graph_factory=graph_failing_to_start)
    assert err.value.group == 0
    assert (tmp_path / "exited-group1").read_text() == "exit handlers ran"
