"""``mmpipe serve pipeline=DIR`` for a family served whole-request (here Wan 2.2's two experts),
through the official ``openai`` client: a video equal to offline ``graph.generate`` for the seed,
bitwise (uint8 frames), and the placement rule refused before any worker starts."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import openai
import pytest

from mmpipe.config import ServeConfig
from mmpipe.data import frames_to_uint8
from mmpipe.models.pipeline_graph import from_diffusers
from mmpipe.serve.engine import Engine

sys.path.insert(0, str(Path(__file__).parents[1] / "serve"))
from serve_doubles import running_server  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:The Sora API:DeprecationWarning")


def serve_config(path: Path, run_dir: Path, **more: object) -> ServeConfig:
    kw: dict = dict(pipeline=str(path), run_dir=str(run_dir), timeout_s=120.0, port=0, threads=1)
    kw |= dict(height=32, width=48, frames=9, steps=3, guidance=4.0)
    return ServeConfig(**(kw | more))


@pytest.fixture(scope="module")
def served(wan22_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Engine, str]]:
    engine = Engine(serve_config(wan22_dir, tmp_path_factory.mktemp("serve22")))
    try:
        with running_server(engine) as url:
            yield engine, url
    finally:
        engine.close(drain=False)


def test_two_expert_video_equals_offline_generate(served: tuple[Engine, str], wan22_dir: Path) -> None:
    engine, url = served
    assert engine.family == "WanPipeline" and engine.cfg.placement == {s: [0, 1] for s in ("text", "denoise", "decode")}
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=120)
    extra = {"seed": 5, "negative_prompt": "blurry static", "guidance": 4.0, "frames": 9}
    video = client.videos.create(prompt="a red circle moving left", size="48x32", extra_body=extra)  # type: ignore[arg-type]
    done = client.videos.poll(video.id, poll_interval_ms=50)
    assert (done.status, done.error) == ("completed", None)
    job = engine.get(video.id)
    assert job is not None and job.frames is not None
    offline = from_diffusers(wan22_dir).generate(
        prompt="a red circle moving left",
        negative_prompt="blurry static",
        height=32,
        width=48,
        num_frames=9,
        num_inference_steps=3,
        guidance_scale=4.0,
        seed=5,
        progress=False,
    )
    assert np.array_equal(job.frames, frames_to_uint8(offline[0]))


def test_a_split_placement_is_refused_before_any_worker_starts(wan22_dir: Path, tmp_path: Path) -> None:
    placement = {"text": [0], "denoise": [0, 1], "decode": [0, 1]}
    with pytest.raises(ValueError, match=r"placement.text=\[0\]: WanPipeline is served whole-request"):
        Engine(serve_config(wan22_dir, tmp_path / "run", placement=placement))
    assert not (tmp_path / "run").exists()
