"""The official ``openai`` client against ``mmpipe serve``'s HTTP front end over the real engine.

The engine runs the tiny random-weight Wan pipeline (``tiny_wan_dir``) on two worker processes
(``text: [0], denoise: [0, 1], decode: [1]``). Outputs are compared with offline
``from_diffusers(dir, max_sequence_length=16).generate(...)`` for the same seed, bitwise: images through their PNG
(lossless), videos through the engine's uint8 ``job.frames`` (the MP4 download is lossy, so it is
only checked to decode to the right frame count and size, and to be close).
"""

from __future__ import annotations

import base64
import io
import json
import socket
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import openai
import pytest
from PIL import Image
from serve_doubles import FAIL_PROMPT, call, error_of, graph_failing_on_prompt, running_server

from mmpipe.config import ServeConfig
from mmpipe.data import frames_to_uint8, read_video
from mmpipe.models.wan import T2VGraph, from_diffusers
from mmpipe.serve.engine import Engine
from mmpipe.serve.protocol import Job, JobStatus

pytestmark = pytest.mark.filterwarnings("ignore:The Sora API:DeprecationWarning")

NEGATIVE = "blurry static"
SLOW = {"size": "64x64", "frames": 17, "steps": 100}  # seconds per request on the tiny model: stays queued


@pytest.fixture(scope="module")
def served(tiny_wan_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Engine, str]]:
    cfg = ServeConfig(
        pipeline=str(tiny_wan_dir),
        run_dir=str(tmp_path_factory.mktemp("serve_run")),
        text_len=16,
        timeout_s=60.0,
        port=0,
        placement={"text": [0], "denoise": [0, 1], "decode": [1]},
        threads=1,
        max_batch=4,
        max_queue=8,
        height=32,
        width=32,
        frames=5,
        steps=4,
        guidance=3.0,
    )
    engine = Engine(cfg, graph_factory=graph_failing_on_prompt)
    try:
        with running_server(engine) as url:
            yield engine, url
    finally:
        engine.close(drain=False)


@pytest.fixture(scope="module")
def offline(tiny_wan_dir: Path) -> Callable[..., np.ndarray]:
    graph: T2VGraph = from_diffusers(tiny_wan_dir, max_sequence_length=16)

    def render(prompt: str, seed: int, *, frames: int = 5, size: int = 32, steps: int = 4) -> np.ndarray:
        video = graph.generate(
            prompt,
            NEGATIVE,
            height=size,
            width=size,
            num_frames=frames,
            num_inference_steps=steps,
            guidance_scale=3.0,
            seed=seed,
            progress=False,
        )
        return frames_to_uint8(video[0])

    return render


@pytest.fixture
def client(served: tuple[Engine, str]) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{served[1]}/v1", api_key="x", max_retries=0, timeout=120)


def png_pixels(b64: str) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(base64.b64decode(b64))).convert("RGB"))


def extras(seed: int, **more: Any) -> dict[str, Any]:
    return {"seed": seed, "negative_prompt": NEGATIVE, "guidance": 3.0} | more


def test_video_job_polled_downloaded_and_equal_to_offline(
    served: tuple[Engine, str], client: openai.OpenAI, offline: Callable[..., np.ndarray], tmp_path: Path
) -> None:
    engine, url = served
    video = client.videos.create(prompt="a red circle moving left", size="32x32", extra_body=extras(11, frames=5))  # type: ignore[arg-type]
    assert video.status in ("queued", "in_progress")
    done = client.videos.poll(video.id, poll_interval_ms=50)
    assert (done.status, done.progress, done.error) == ("completed", 100, None)
    path = tmp_path / "v.mp4"
    path.write_bytes(client.videos.download_content(video.id).content)
    decoded = read_video(path)
    expected = offline("a red circle moving left", 11)
    assert decoded.shape == expected.shape == (5, 32, 32, 3)
    job = engine.get(video.id)
    assert job is not None and job.frames is not None
    assert np.array_equal(job.frames, expected)  # the same seed gives offline generate's frames, bitwise
    assert np.abs(decoded.astype(int) - expected).mean() < 12  # MP4 (yuv420p, lossy) decodes close to them
    text = call(url + "/metrics")[2].decode()
    for stage in ("text", "denoise", "decode"):
        assert f'mmpipe_serve_stage_run_seconds_count{{stage="{stage}"}}' in text
    assert 'mmpipe_serve_edge_bytes_total{edge="text->denoise"}' in text


def test_images_equal_offline(client: openai.OpenAI, offline: Callable[..., np.ndarray]) -> None:
    result = client.images.generate(prompt="a blue square", n=2, size="32x32", extra_body=extras(5))  # type: ignore[arg-type]
    assert result.data is not None and len(result.data) == 2
    for i, image in enumerate(result.data):
        assert image.b64_json is not None
        assert np.array_equal(png_pixels(image.b64_json), offline("a blue square", 5 + i, frames=1)[0])


def test_eight_concurrent_requests(
    served: tuple[Engine, str], client: openai.OpenAI, offline: Callable[..., np.ndarray]
) -> None:
    engine = served[0]

    def video(i: int) -> np.ndarray:
        created = client.videos.create(prompt=f"video {i}", extra_body=extras(100 + i))
        job = engine.get(created.id)
        assert job is not None and job.wait(60) and job.status is JobStatus.COMPLETED
        assert client.videos.retrieve(created.id).status == "completed"
        assert job.frames is not None
        return job.frames

    def image(i: int) -> np.ndarray:
        result = client.images.generate(prompt=f"image {i}", extra_body=extras(100 + i))
        assert result.data is not None and result.data[0].b64_json is not None
        return png_pixels(result.data[0].b64_json)[None]

    with ThreadPoolExecutor(8) as pool:
        futures = [pool.submit(video if i % 2 else image, i) for i in range(8)]
        outputs = [f.result(timeout=120) for f in futures]
    for i, got in enumerate(outputs):
        expected = offline(f"video {i}", 100 + i) if i % 2 else offline(f"image {i}", 100 + i, frames=1)
        assert np.array_equal(got, expected), f"request {i}"


def test_stage_error_fails_only_its_request(
    served: tuple[Engine, str], client: openai.OpenAI, offline: Callable[..., np.ndarray]
) -> None:
    url = served[1]
    prompts = ["ok one", FAIL_PROMPT, "ok two", "ok three"]
    with ThreadPoolExecutor(4) as pool:
        answers = list(
            pool.map(lambda p: call(url + "/v1/images/generations", "POST", {"prompt": p} | extras(3)), prompts)
        )
    for prompt, (code, _, body) in zip(prompts, answers, strict=True):
        if prompt == FAIL_PROMPT:
            assert code == 500
            error = error_of(body)
            assert error["code"] == "generation_failed" and "stage 'text' failed" in error["message"]
            assert "injected fault" in error["message"]
        else:
            assert code == 200, body
            got = png_pixels(json.loads(body)["data"][0]["b64_json"])
            assert np.array_equal(got, offline(prompt, 3, frames=1)[0])
    video = client.videos.create(prompt=FAIL_PROMPT, extra_body=extras(1))
    failed = client.videos.poll(video.id, poll_interval_ms=50)
    assert failed.status == "failed" and failed.error is not None and "injected fault" in failed.error.message
    assert call(url + "/health")[0] == 200  # the server goes on serving


def test_overload_429_then_delete_frees_the_queue(
    served: tuple[Engine, str], client: openai.OpenAI, offline: Callable[..., np.ndarray]
) -> None:
    engine, url = served
    ids = [json.loads(call(url + "/v1/videos", "POST", {"prompt": f"slow {i}"} | SLOW)[2])["id"] for i in range(8)]
    code, headers, body = call(url + "/v1/videos", "POST", {"prompt": "one too many"})
    assert code == 429 and int(headers["retry-after"]) >= 1 and error_of(body)["code"] == "queue_full"
    for video_id in ids:
        assert call(f"{url}/v1/videos/{video_id}", "DELETE")[0] == 200
    jobs = [engine.get(i) for i in ids]
    assert all(j is not None and j.status is JobStatus.CANCELLED for j in jobs)
    assert all(call(f"{url}/v1/videos/{i}")[0] == 404 for i in ids)
    # The cancelled requests' work is dropped in every group: a new request runs at once.
    result = client.images.generate(prompt="after", extra_body=extras(9), timeout=30)
    assert result.data is not None and result.data[0].b64_json is not None
    assert np.array_equal(png_pixels(result.data[0].b64_json), offline("after", 9, frames=1)[0])


def test_image_client_that_disconnects_cancels_its_job(
    served: tuple[Engine, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    engine, url = served
    submitted: list[Job] = []
    submit = engine.submit

    def recording_submit(request: Any) -> Job:
        submitted.append(submit(request))
        return submitted[-1]

    monkeypatch.setattr(engine, "submit", recording_submit)
    host, port = url.removeprefix("http://").split(":")
    body = json.dumps({"prompt": "left behind", "size": "64x64", "steps": 100}).encode()
    head = f"POST /v1/images/generations HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    with socket.create_connection((host, int(port))) as sock:
        sock.sendall(head.encode() + body)
        assert _until(lambda: bool(submitted))
    job = submitted[0]
    assert job.wait(10) and job.status is JobStatus.CANCELLED


def _until(predicate: Callable[[], bool], timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.01)
    return False
