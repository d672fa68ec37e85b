"""``mmpipe serve`` with a replica placement: one request's denoising split over two worker
processes (Ulysses, CFG), through the official ``openai`` client; its video matches offline
``graph.generate`` for the seed. Bad replica placements are refused before any worker starts."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import openai
import pytest
from serve_doubles import running_server

from mmpipe.config import ServeConfig
from mmpipe.data import frames_to_uint8
from mmpipe.models.loading import from_diffusers
from mmpipe.serve.engine import Engine

pytestmark = pytest.mark.filterwarnings("ignore:The Sora API:DeprecationWarning")

SIZE = dict(height=32, width=48, frames=9, steps=3, guidance=4.0)


def _config(path: Path, run_dir: Path, placement: dict[str, Any], **more: Any) -> ServeConfig:
    kw: dict[str, Any] = dict(pipeline=str(path), run_dir=str(run_dir), timeout_s=120.0, port=0, threads=1)
    return ServeConfig(**(kw | SIZE | {"placement": placement, "text_len": 16} | more))


@pytest.fixture(scope="module")
def served(tiny_wan_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Engine, str]]:
    # the example on 2 ranks: text on the leader, the denoiser and the decode over both
    placement = {"text": [0], "denoise": {"ranks": [0, 1], "ulysses": 2}, "decode": [0, 1]}
    engine = Engine(_config(tiny_wan_dir, tmp_path_factory.mktemp("serve-sp"), placement))
    try:
        with running_server(engine) as url:
            yield engine, url
    finally:
        engine.close(drain=False)


def test_ulysses_replica_video_equals_offline_generate(served: tuple[Engine, str], tiny_wan_dir: Path) -> None:
    engine, url = served
    assert engine.replicas == [(0, 1)] and engine.world == 2 and engine.parallel_decode
    assert "denoise over ranks [0, 1] (ulysses=2)" in engine.placement_text()
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=120)
    for seed in (3, 4):  # two requests in a row: the replica's ranks stay in step
        video = client.videos.create(
            prompt="a red circle moving left",
            size="48x32",
            extra_body={"seed": seed, "negative_prompt": "blurry static", "guidance": 4.0, "frames": 9},  # type: ignore[arg-type]
        )
        done = client.videos.poll(video.id, poll_interval_ms=50)
        assert (done.status, done.error) == ("completed", None)
        job = engine.get(video.id)
        assert job is not None and job.frames is not None
        offline = from_diffusers(tiny_wan_dir, max_sequence_length=16).generate(
            prompt="a red circle moving left",
            negative_prompt="blurry static",
            height=32,
            width=48,
            num_frames=9,
            num_inference_steps=3,
            guidance_scale=4.0,
            seed=seed,
            progress=False,
        )
        # Ulysses attention sums in another order than one process (float32, ~1e-6): at most one
        # uint8 level after the decode
        diff = np.abs(job.frames.astype(int) - frames_to_uint8(offline[0]).astype(int))
        assert diff.max() <= 1 and diff.mean() < 0.01, (diff.max(), diff.mean())


@pytest.mark.parametrize(
    ("placement", "more", "match"),
    [
        ({"denoise": {"ranks": [0, 1], "ulysses": 3}}, {}, r"ulysses=3 .* 3 ranks"),
        ({"denoise": {"ranks": [0, 1, 2], "ulysses": 3}}, {}, "attention heads cannot be split over ulysses=3"),
        ({"denoise": {"ranks": [0, 1], "ulysses": 2}, "text": [1]}, {}, r"placement.text=\[1\]"),
        ({"denoise": {"ranks": [0, 1, 2, 3], "cfg": 2, "dp": 2}, "decode": [0, 1, 2]}, {}, r"decode=\[0, 1, 2\]"),
        ({"denoise": {"ranks": [0, 1], "ulysses": 2}}, {"frames": 1}, "at least one frame"),
        ({"denoise": {"ranks": [0, 1], "ulysses": 2}}, {"cache": {"policy": "first_block"}}, "first_block"),
        ({"denoise": {"ranks": [0, 1], "sp": 2}}, {}, r"placement.denoise.sp"),
        ({"text": [0], "denoise": [0, 1], "decode": [0]}, {"cache": {"policy": "mag"}}, "step-batched serving"),
    ],
)
def test_bad_replica_placements_are_refused_before_any_worker(
    tiny_wan_dir: Path, tmp_path: Path, placement: dict[str, Any], more: dict[str, Any], match: str
) -> None:
    from mmpipe.config import StepCacheConfig

    if "cache" in more:
        more = more | {"cache": StepCacheConfig(**more["cache"])}
    with pytest.raises(ValueError, match=match):
        Engine(_config(tiny_wan_dir, tmp_path / "run", placement, **more))
    assert not (tmp_path / "run" / "events").exists()


def test_placement_auto_serves_the_planners_choice(tmp_path: Path) -> None:
    """``placement=auto`` (the tiny preset): the serving planner's placement for this machine's
    cores, then a request completes on it; a source the planner does not plan is refused first."""
    import os

    from mmpipe.assemble.serve_planning import serving_placement
    from mmpipe.config import DataConfig, ModelConfig
    from mmpipe.serve.protocol import GenerationRequest

    cfg = ServeConfig(run_dir=str(tmp_path / "run"), port=0, threads=1, placement="auto", **SIZE)
    expected, _ = serving_placement(
        ModelConfig(), DataConfig(frames=9, height=32, width=48), nproc=os.cpu_count() or 1, steps=3, guidance=4.0
    )
    with Engine(cfg) as engine:
        placed = engine.cfg.placement
        assert isinstance(placed, dict)
        den = expected["denoise"]
        if isinstance(den, dict):  # a replica placement: text and decode on each replica's first rank
            assert engine.replicas and [list(r) for r in engine.replicas] == [den["ranks"]]
        else:
            assert placed == expected
        job = engine.submit(
            GenerationRequest(prompt="a red circle moving left", height=32, width=48, frames=9, steps=3)
        )
        import time

        deadline = time.monotonic() + 120
        while not job.status.done and time.monotonic() < deadline:
            time.sleep(0.01)
        assert job.status.value == "completed", job.error
    with pytest.raises(ValueError, match="placement=auto plans the model preset"):
        Engine(ServeConfig(pipeline=str(tmp_path), run_dir=str(tmp_path / "r2"), placement="auto"))


def test_whole_request_replicas_run_the_step_cache(tiny_wan_dir: Path, tmp_path: Path) -> None:
    """``cache.policy`` in serving: replicas of one rank (``dp: 2``) run whole requests with the
    denoiser's step cache, and a request's frames are offline ``generate``'s with the same cache."""
    from mmpipe.config import StepCacheConfig
    from mmpipe.runtime.inference import configure_denoiser
    from mmpipe.serve.protocol import GenerationRequest

    cache = StepCacheConfig(policy="teacache", threshold=0.5)
    placement = {"denoise": {"ranks": [0, 1], "dp": 2}}
    with Engine(_config(tiny_wan_dir, tmp_path / "run", placement, cache=cache)) as engine:
        assert engine.replicas == [(0,), (1,)]
        job = engine.submit(
            GenerationRequest(
                prompt="a red circle moving left", height=32, width=48, frames=9, steps=3, guidance=4.0, seed=2
            )
        )
        import time

        deadline = time.monotonic() + 120
        while not job.status.done and time.monotonic() < deadline:
            time.sleep(0.01)
        assert job.status.value == "completed", job.error
        assert job.frames is not None
    graph = from_diffusers(tiny_wan_dir, max_sequence_length=16)
    configure_denoiser(graph, cache, compile=False)
    offline = graph.generate(
        prompt="a red circle moving left",
        height=32,
        width=48,
        num_frames=9,
        num_inference_steps=3,
        guidance_scale=4.0,
        seed=2,
        progress=False,
    )
    diff = np.abs(job.frames.astype(int) - frames_to_uint8(offline[0]).astype(int))
    assert diff.max() <= 1, diff.max()
