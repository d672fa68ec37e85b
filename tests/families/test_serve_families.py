"""``mmpipe serve pipeline=DIR`` for the families served whole-request, through the official
``openai`` client: every family's video (``/v1/videos``) or image (``/v1/images/generations``)
equals offline ``graph.generate`` for the seed, bitwise (uint8 frames, lossless PNG), and the
placement rule is refused before any worker starts."""

from __future__ import annotations

import base64
import importlib
import io
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import openai
import pytest
from PIL import Image

from mmpipe.config import ServeConfig
from mmpipe.data import frames_to_uint8
from mmpipe.models.loading import from_diffusers
from mmpipe.serve.engine import Engine
from tests.families.conftest import save_tiny_wan22

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
    _video_equals_offline_generate(engine, url, wan22_dir)


def test_ti2v_video_equals_offline_generate(tmp_path: Path) -> None:
    """Wan 2.2 TI2V as diffusers ships it (``WanPipeline`` with ``expand_timesteps``: text-to-video,
    one timestep per token), served whole-request."""
    path = save_tiny_wan22(tmp_path / "ti2v", expand_timesteps=True)
    one_group = {s: [0] for s in ("text", "denoise", "decode")}
    with Engine(serve_config(path, tmp_path / "run", placement=one_group)) as engine, running_server(engine) as url:
        assert engine.family == "WanPipeline"
        _video_equals_offline_generate(engine, url, path)


def _video_equals_offline_generate(engine: Engine, url: str, path: Path) -> None:
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=120)
    extra = {"seed": 5, "negative_prompt": "blurry static", "guidance": 4.0, "frames": 9}
    video = client.videos.create(prompt="a red circle moving left", size="48x32", extra_body=extra)  # type: ignore[arg-type]
    done = client.videos.poll(video.id, poll_interval_ms=50)
    assert (done.status, done.error) == ("completed", None)
    job = engine.get(video.id)
    assert job is not None and job.frames is not None
    offline = from_diffusers(path).generate(
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
    # The image's VAE encode (3-D convolutions) may block differently with the worker's one thread
    # than with this process's threads: float32 reassociation, at most one uint8 level after decode.
    diff = np.abs(job.frames.astype(int) - frames_to_uint8(offline[0]).astype(int))
    assert diff.max() <= 1 and diff.mean() < 0.01, (diff.max(), diff.mean())


TEXT_FAMILIES = {
    "flux": ("mmpipe.models.flux", "save_tiny_flux_pipeline", "image"),
    "qwenimage": ("mmpipe.models.qwenimage", "save_tiny_qwenimage_pipeline", "image"),
    "hunyuan": ("mmpipe.models.hunyuan", "save_tiny_hunyuan_pipeline", "video"),
    "ltx": ("mmpipe.models.ltx", "save_tiny_ltx_pipeline", "video"),
    "cogvideox": ("mmpipe.models.cogvideox", "save_tiny_cogvideox_pipeline", "video"),
}


@pytest.mark.parametrize("name", sorted(TEXT_FAMILIES))
def test_every_family_serves_what_offline_generate_renders(name: str, tmp_path: Path) -> None:
    module, saver, output = TEXT_FAMILIES[name]
    path = getattr(importlib.import_module(module), saver)(tmp_path / name, seed=0)
    # LTX: multiples of 32; the tiny CogVideoX 2B's fixed sin-cos positions: its sample size
    height, width = {"ltx": (32, 64), "cogvideox": (16, 32)}.get(name, (32, 48))
    one_group = {s: [0] for s in ("text", "denoise", "decode")}
    text_len = 0 if name == "cogvideox" else 16  # CogVideoX's positions need its own text length (226)
    cfg = serve_config(
        path, tmp_path / "run", placement=one_group, text_len=text_len, height=height, width=width, steps=2
    )
    prompt, extra = "a red circle moving left", {"seed": 3, "negative_prompt": "blurry static", "guidance": 4.0}
    with Engine(cfg) as engine, running_server(engine) as url:
        assert engine.output == output
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=120)
        graph: Any = from_diffusers(path, max_sequence_length=text_len or None)
        call = dict(prompt=prompt, negative_prompt="blurry static", height=height, width=width, num_inference_steps=2)
        call[graph.family.cfg_argument] = 4.0
        if output == "image":
            result = client.images.generate(prompt=prompt, size=f"{width}x{height}", extra_body=extra)  # type: ignore[arg-type]
            assert result.data is not None and result.data[0].b64_json is not None
            got = np.asarray(Image.open(io.BytesIO(base64.b64decode(result.data[0].b64_json))).convert("RGB"))
            expected = frames_to_uint8(graph.generate(**call, seed=3, progress=False, output_type="np")[0][None])[0]
            with pytest.raises(openai.BadRequestError, match="generates images"):
                client.videos.create(prompt=prompt)
        else:
            video = client.videos.create(prompt=prompt, size=f"{width}x{height}", extra_body=extra | {"frames": 9})  # type: ignore[arg-type]
            done = client.videos.poll(video.id, poll_interval_ms=50)
            assert (done.status, done.error) == ("completed", None)
            job = engine.get(video.id)
            assert job is not None and job.frames is not None
            got = job.frames
            expected = frames_to_uint8(
                graph.generate(**call, num_frames=9, seed=3, progress=False, output_type="np")[0]
            )
        assert got.shape == expected.shape and np.array_equal(got, expected)
        assert expected.std() > 1  # not a constant output


def test_a_split_placement_is_refused_before_any_worker_starts(wan22_dir: Path, tmp_path: Path) -> None:
    placement = {"text": [0], "denoise": [0, 1], "decode": [0, 1]}
    with pytest.raises(ValueError, match=r"placement.text=\[0\]: WanPipeline is served whole-request"):
        Engine(serve_config(wan22_dir, tmp_path / "run", placement=placement))
    assert not (tmp_path / "run").exists()


def test_image_to_video_serves_an_input_reference(tmp_path: Path) -> None:
    """Wan 2.1 I2V behind ``/v1/videos``: OpenAI's ``input_reference`` upload becomes the pipeline's
    ``image``; the video equals offline ``generate`` with the same image; no image is a 400."""
    from mmpipe.models.wan_i2v import save_tiny_wan_i2v_pipeline

    path = save_tiny_wan_i2v_pipeline(tmp_path / "i2v", seed=0)
    picture = Image.new("RGB", (48, 32), (20, 20, 40))
    picture.paste((220, 30, 30), (8, 6, 28, 26))
    png = io.BytesIO()
    picture.save(png, format="PNG")
    one_group = {s: [0] for s in ("text", "denoise", "decode")}
    cfg = serve_config(path, tmp_path / "run", placement=one_group, text_len=16, steps=2)
    prompt, extra = "a red circle moving left", {"seed": 4, "negative_prompt": "blurry static", "frames": 9}
    with Engine(cfg) as engine, running_server(engine) as url:
        assert engine.image_input == "required"
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=120)
        with pytest.raises(openai.BadRequestError, match="input_reference is required"):
            client.videos.create(prompt=prompt, size="48x32", extra_body=extra)  # type: ignore[arg-type]
        video = client.videos.create(
            prompt=prompt,
            size="48x32",
            input_reference=("first.png", png.getvalue(), "image/png"),
            extra_body=extra,  # type: ignore[arg-type]
        )
        done = client.videos.poll(video.id, poll_interval_ms=50)
        assert (done.status, done.error) == ("completed", None)
        job = engine.get(video.id)
        assert job is not None and job.frames is not None
    offline = from_diffusers(path, max_sequence_length=16).generate(
        image=picture,
        prompt=prompt,
        negative_prompt="blurry static",
        height=32,
        width=48,
        num_frames=9,
        num_inference_steps=2,
        guidance_scale=4.0,
        seed=4,
        progress=False,
    )
    # The image's VAE encode (3-D convolutions) may block differently with the worker's one thread
    # than with this process's threads: float32 reassociation, at most one uint8 level after decode.
    diff = np.abs(job.frames.astype(int) - frames_to_uint8(offline[0]).astype(int))
    assert diff.max() <= 1 and diff.mean() < 0.01, (diff.max(), diff.mean())
