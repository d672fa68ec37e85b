"""The HTTP front end against an in-process engine double (tests/serve/serve_doubles.py).

Covers the OpenAI shapes with the official ``openai`` client, every validation case (400 / 422
naming the field), overload (429 + Retry-After), failures (500), cancellation by DELETE, by a
client that disconnects and by the handler's timeout, and the Prometheus text of ``/metrics``.
The real engine behind the same server is tested in ``test_engine_http.py``.
"""

from __future__ import annotations

import base64
import io
import json
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import openai
import pytest
from PIL import Image
from prometheus_client.parser import text_string_to_metric_families
from serve_doubles import FAIL_PROMPT, FakeEngine, call, error_of, fake_frames, running_server

from mmpipe.config import ServeConfig
from mmpipe.data import read_video
from mmpipe.serve import app as app_module
from mmpipe.serve.metrics import ServeMetrics
from mmpipe.serve.protocol import GenerationRequest, Job, JobStatus

VIDEOS, IMAGES = "/v1/videos", "/v1/images/generations"
# The client marks its video helpers deprecated (OpenAI's own video service is closing): they still
# are the documented way to call this API.
pytestmark = pytest.mark.filterwarnings("ignore:The Sora API:DeprecationWarning")


def make_cfg(**overrides: object) -> ServeConfig:
    limits: dict[str, object] = {"max_frames": 33, "max_steps": 50, "max_prompt_chars": 100}
    limits |= {"max_width": 256, "max_height": 256, "max_queue": 4}
    return ServeConfig(port=0, height=32, width=32, frames=5, steps=4, fps=8, **(limits | overrides))  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def served() -> Iterator[tuple[FakeEngine, str]]:
    """One server for the module's tests that need no engine of their own."""
    engine = FakeEngine(make_cfg())
    with running_server(engine) as url:
        yield engine, url


@pytest.fixture
def engine(served: tuple[FakeEngine, str]) -> FakeEngine:
    engine = served[0]
    engine.jobs.clear()
    engine.submitted.clear()
    engine.healthy, engine.fatal = True, None
    return engine


@pytest.fixture
def url(served: tuple[FakeEngine, str]) -> str:
    return served[1]


@pytest.fixture
def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)


def png_pixels(data: bytes) -> np.ndarray:
    image = Image.open(io.BytesIO(data))
    assert image.format == "PNG"
    return np.asarray(image.convert("RGB"))


def counter(metrics_text: str, name: str, **labels: str) -> float:
    for family in text_string_to_metric_families(metrics_text):
        for sample in family.samples:
            if sample.name == name and sample.labels == labels:
                return sample.value
    return 0.0


# ---- validation -----------------------------------------------------------------------------

INVALID = [
    (VIDEOS, {"size": "30x32"}, 400, "size"),
    (VIDEOS, {"size": "64"}, 400, "size"),
    (VIDEOS, {"size": "0x32"}, 400, "size"),
    (VIDEOS, {"size": "512x32"}, 400, "size"),  # over max_width
    (VIDEOS, {"size": "32x512"}, 400, "size"),  # over max_height
    (VIDEOS, {"frames": 6}, 400, "frames"),  # not 4k+1
    (VIDEOS, {"frames": 0}, 400, "frames"),
    (VIDEOS, {"frames": 37}, 400, "frames"),  # over max_frames
    (VIDEOS, {"seconds": 10}, 400, "seconds"),  # 81 frames at 8 fps: over max_frames
    (VIDEOS, {"seconds": -1}, 400, "seconds"),
    (VIDEOS, {"steps": 0}, 400, "steps"),
    (VIDEOS, {"steps": 51}, 400, "steps"),  # over max_steps
    (IMAGES, {"steps": 51}, 400, "steps"),
    (VIDEOS, {"guidance": -1}, 400, "guidance"),
    (VIDEOS, {"seed": -1}, 400, "seed"),
    (VIDEOS, {"timeout_s": 0}, 400, "timeout_s"),
    (VIDEOS, {"prompt": "x" * 101}, 400, "prompt"),  # over max_prompt_chars
    (VIDEOS, {"negative_prompt": "x" * 101}, 400, "negative_prompt"),
    (VIDEOS, {"prompt": ""}, 400, "prompt"),
    (VIDEOS, {"prompt": "   "}, 400, "prompt"),
    (VIDEOS, {"model": "sora-2"}, 400, "model"),
    (IMAGES, {"model": "dall-e-3"}, 400, "model"),
    (IMAGES, {"n": 0}, 400, "n"),
    (IMAGES, {"n": 11}, 400, "n"),
    (IMAGES, {"size": "33x32"}, 400, "size"),
    # Extra fields of the wrong type: 422.
    (VIDEOS, {"seed": "abc"}, 422, "seed"),
    (VIDEOS, {"steps": 4.5}, 422, "steps"),
    (VIDEOS, {"frames": True}, 422, "frames"),
    (VIDEOS, {"guidance": "high"}, 422, "guidance"),
    (VIDEOS, {"negative_prompt": 5}, 422, "negative_prompt"),
    (VIDEOS, {"prompt": 7}, 422, "prompt"),
    (VIDEOS, {"prompt": None}, 422, "prompt"),
    (IMAGES, {"seed": 1.5}, 422, "seed"),
    (IMAGES, {"response_format": "gif"}, 422, "response_format"),
    (IMAGES, {"output_format": "jpeg"}, 422, "output_format"),
]


@pytest.mark.parametrize(("path", "fields", "status", "param"), INVALID)
def test_invalid_request_names_the_field(
    engine: FakeEngine, url: str, path: str, fields: dict[str, object], status: int, param: str
) -> None:
    invalid = counter(call(url + "/metrics")[2].decode(), "mmpipe_serve_requests_total", status="invalid")
    code, _, body = call(url + path, "POST", {"prompt": "a red circle"} | fields)
    assert code == status, body
    error = error_of(body)
    assert error["param"] == param and error["type"] == "invalid_request_error"
    assert param in error["message"]
    assert engine.submitted == []  # nothing reached the engine
    text = call(url + "/metrics")[2].decode()
    assert counter(text, "mmpipe_serve_requests_total", status="invalid") == invalid + 1


@pytest.mark.parametrize(("path", "body"), [(VIDEOS, {}), (IMAGES, {"n": 1})])
def test_missing_prompt_is_422(engine: FakeEngine, url: str, path: str, body: dict[str, object]) -> None:
    code, _, raw = call(url + path, "POST", body)
    assert code == 422 and error_of(raw)["param"] == "prompt"


@pytest.mark.parametrize("raw", [b"{not json", b"[1, 2]"])
def test_body_that_is_not_a_json_object_is_400(engine: FakeEngine, url: str, raw: bytes) -> None:
    code, _, body = call(url + VIDEOS, "POST", raw)
    assert code == 400 and "JSON" in error_of(body)["message"]
    assert engine.submitted == []


def test_openai_client_multipart_fields_are_typed(engine: FakeEngine, client: openai.OpenAI) -> None:
    """The client posts create-video as multipart form data: every extra field arrives as text."""
    video = client.videos.create(  # any WxH size, beyond the client's typed list
        prompt="a blue square",
        size="32x64",  # type: ignore[arg-type]
        extra_body={"seed": 7, "steps": 3, "frames": 9, "guidance": 4.5, "negative_prompt": "blurry"},
    )
    r = engine.submitted[0].request
    assert (r.width, r.height, r.seed, r.steps, r.frames, r.guidance) == (32, 64, 7, 3, 9, 4.5)
    assert r.negative_prompt == "blurry" and isinstance(r.seed, int) and isinstance(r.steps, int)
    assert (video.size, video.seconds, video.model) == ("32x64", "1.125", "mmpipe-wan")
    with pytest.raises(openai.UnprocessableEntityError) as typed:
        client.videos.create(prompt="a", extra_body={"seed": "abc"})
    assert typed.value.param == "seed"  # type: ignore[attr-defined]
    with pytest.raises(openai.BadRequestError) as bad:
        client.videos.create(prompt="a", extra_body={"frames": 6})
    assert bad.value.param == "frames"  # type: ignore[attr-defined]
    assert len(engine.submitted) == 1


@pytest.mark.parametrize(
    ("fields", "frames"),
    [({}, 5), ({"seconds": "1"}, 9), ({"seconds": 2}, 17), ({"seconds": 0.5}, 5), ({"seconds": 0.1}, 1)]
    + [({"seconds": 4, "frames": 13}, 13)],  # frames wins over seconds
)
def test_frames_from_seconds(engine: FakeEngine, url: str, fields: dict[str, object], frames: int) -> None:
    code, _, body = call(url + VIDEOS, "POST", {"prompt": "a"} | fields)
    assert code == 200, body
    assert engine.submitted[0].request.frames == frames == json.loads(body)["frames"]


# ---- videos ---------------------------------------------------------------------------------


def test_video_create_retrieve_download_delete(
    engine: FakeEngine, client: openai.OpenAI, url: str, tmp_path: Path
) -> None:
    video = client.videos.create(prompt="a red circle", size="32x48", seconds="1", extra_body={"seed": 3})  # type: ignore[arg-type]
    assert (video.object, video.status, video.progress, video.error) == ("video", "completed", 100, None)
    got = client.videos.retrieve(video.id)
    assert (got.id, got.status, got.prompt, got.size) == (video.id, "completed", "a red circle", "32x48")
    assert got.completed_at is not None and got.created_at <= got.completed_at
    path = tmp_path / "v.mp4"
    path.write_bytes(client.videos.download_content(video.id).content)
    decoded = read_video(path)
    expected = fake_frames(engine.submitted[0].request)
    assert decoded.shape == expected.shape == (9, 48, 32, 3)
    # MP4 is lossy (yuv420p, H.264 crf 18): the decoded frames are close, not equal.
    assert np.abs(decoded.astype(int) - expected).mean() < 12
    thumb = call(f"{url}/v1/videos/{video.id}/content?variant=thumbnail")
    assert thumb[0] == 200 and np.array_equal(png_pixels(thumb[2]), expected[0])
    deleted = client.videos.delete(video.id)
    assert (deleted.id, deleted.deleted, deleted.object) == (video.id, True, "video.deleted")
    with pytest.raises(openai.NotFoundError):
        client.videos.retrieve(video.id)
    with pytest.raises(openai.NotFoundError):
        client.videos.delete(video.id)


def test_content_before_completion_is_409_and_unknown_is_404() -> None:
    engine = FakeEngine(make_cfg(), hold=True)
    with running_server(engine) as url:
        job = json.loads(call(url + VIDEOS, "POST", {"prompt": "a"})[2])
        assert job["status"] == "queued" and job["completed_at"] is None
        code, headers, body = call(f"{url}/v1/videos/{job['id']}/content")
        assert code == 409 and error_of(body)["code"] == "video_not_ready"
        assert call(f"{url}/v1/videos/{job['id']}")[1]["openai-poll-after-ms"] == "250"
        assert call(f"{url}/v1/videos/video_nope/content")[0] == 404
        assert call(f"{url}/v1/videos/video_nope")[0] == 404
        engine.release()
        code, headers, body = call(f"{url}/v1/videos/{job['id']}/content")
        assert code == 200 and headers["content-type"] == "video/mp4" and body[4:8] == b"ftyp"
        assert call(f"{url}/v1/videos/{job['id']}/content?variant=spritesheet")[0] == 400


def test_accepted_connections_send_without_nagle() -> None:
    # Keep-alive clients (the openai SDK) waited ~40 ms a request for Nagle + delayed ACK before this.
    from mmpipe.serve.server import bind

    with bind("127.0.0.1", 0) as listener, socket.create_connection(listener.getsockname()[:2]):
        accepted, _ = listener.accept()
        with accepted:
            assert accepted.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) != 0


def test_poll_hint_is_half_the_remaining_time_its_progress_predicts() -> None:
    job = Job(GenerationRequest(prompt="a"))
    assert app_module.poll_after_ms(job) == 250  # queued: the fixed hint
    job.status, job.started_at, job.progress = JobStatus.IN_PROGRESS, 100.0, 50
    assert app_module.poll_after_ms(job, now=101.0) == 500  # 1 s for half: 1 s left, poll in 0.5 s
    job.progress = 99
    assert app_module.poll_after_ms(job, now=101.0) == 10  # never below the floor
    job.progress = 5
    assert app_module.poll_after_ms(job, now=110.0) == 1000  # never above the cap
    job.finish(JobStatus.COMPLETED)
    assert app_module.poll_after_ms(job, now=110.0) == 10


def test_create_and_poll_follows_the_job() -> None:
    engine = FakeEngine(make_cfg(), hold=True)
    with running_server(engine) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
        threading.Timer(0.6, engine.release).start()
        video = client.videos.create_and_poll(prompt="a", poll_interval_ms=100)
        assert video.status == "completed" and video.progress == 100


def test_delete_cancels_a_queued_video() -> None:
    engine = FakeEngine(make_cfg(), hold=True)
    with running_server(engine) as url:
        job = json.loads(call(url + VIDEOS, "POST", {"prompt": "a"})[2])
        code, _, body = call(f"{url}/v1/videos/{job['id']}", "DELETE")
        assert code == 200 and json.loads(body)["deleted"] is True
        assert engine.submitted[0].status is JobStatus.CANCELLED
        assert call(f"{url}/v1/videos/{job['id']}")[0] == 404


def test_failed_video_reports_the_stage_error(client: openai.OpenAI, url: str) -> None:
    video = client.videos.create(prompt=FAIL_PROMPT)
    assert video.status == "failed" and video.error is not None
    assert video.error.code == "generation_failed" and "boom" in video.error.message
    code, _, body = call(f"{url}/v1/videos/{video.id}/content")
    assert code == 409 and "boom" in error_of(body)["message"]


# ---- images ---------------------------------------------------------------------------------


def test_images_b64_json_with_consecutive_seeds(engine: FakeEngine, client: openai.OpenAI) -> None:
    result = client.images.generate(prompt="a cat", n=3, size="64x32", extra_body={"seed": 10})  # type: ignore[arg-type]
    assert result.data is not None and len(result.data) == 3 and result.size == "64x32"
    assert [j.request.seed for j in engine.submitted] == [10, 11, 12]
    for image, job in zip(result.data, engine.submitted, strict=True):
        assert job.request.frames == 1 and image.b64_json is not None
        assert np.array_equal(png_pixels(base64.b64decode(image.b64_json)), fake_frames(job.request)[0])


def test_images_as_data_url_and_as_png_bytes(engine: FakeEngine, client: openai.OpenAI, url: str) -> None:
    result = client.images.generate(prompt="a cat", response_format="url", extra_body={"seed": 4})
    assert result.data is not None and result.data[0].url is not None
    head, b64 = result.data[0].url.split(",", 1)
    assert head == "data:image/png;base64"
    expected = fake_frames(engine.submitted[0].request)[0]
    assert np.array_equal(png_pixels(base64.b64decode(b64)), expected)
    code, headers, body = call(url + IMAGES, "POST", {"prompt": "a cat", "seed": 4}, headers={"Accept": "image/png"})
    assert code == 200 and headers["content-type"] == "image/png"
    assert np.array_equal(png_pixels(body), expected)
    code, _, body = call(url + IMAGES, "POST", {"prompt": "a", "n": 2}, headers={"Accept": "image/png"})
    assert code == 400 and error_of(body)["param"] == "n"


def test_failed_image_is_500_with_the_message(client: openai.OpenAI) -> None:
    with pytest.raises(openai.InternalServerError) as err:
        client.images.generate(prompt=FAIL_PROMPT)
    assert "boom" in str(err.value) and err.value.code == "generation_failed"  # type: ignore[attr-defined]


def test_image_client_that_disconnects_cancels_its_job() -> None:
    engine = FakeEngine(make_cfg(), hold=True)
    with running_server(engine) as url:
        host, port = url.removeprefix("http://").split(":")
        body = json.dumps({"prompt": "a", "n": 2}).encode()
        head = f"POST {IMAGES} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
        with socket.create_connection((host, int(port))) as sock:
            sock.sendall(head.encode() + body)
            assert _until(lambda: len(engine.submitted) == 2)
            assert not any(j.status.done for j in engine.submitted)
        assert _until(lambda: all(j.status is JobStatus.CANCELLED for j in engine.submitted))


def test_image_wait_gives_up_after_the_timeout(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(app_module, "_TIMEOUT_GRACE_S", 0.1)
    engine = FakeEngine(make_cfg(), hold=True)  # never completes: the handler's own deadline ends it
    with running_server(engine) as url:
        code, _, body = call(url + IMAGES, "POST", {"prompt": "a", "timeout_s": 0.2})
    assert code == 504 and error_of(body)["message"] == "timed out after 0.2 s"
    assert engine.submitted[0].status is JobStatus.CANCELLED


# ---- overload, health, models, metrics ------------------------------------------------------


def test_queue_full_is_429_with_retry_after() -> None:
    engine = FakeEngine(make_cfg(max_queue=4), hold=True)
    with running_server(engine) as url:
        for _ in range(3):
            assert call(url + VIDEOS, "POST", {"prompt": "a"})[0] == 200
        # An image request for 2 fits one job, not both: the one submitted is cancelled.
        code, headers, body = call(url + IMAGES, "POST", {"prompt": "a", "n": 2})
        assert code == 429 and headers["retry-after"] == "3"  # ceil(2.5)
        assert error_of(body)["type"] == "rate_limit_error" and error_of(body)["code"] == "queue_full"
        assert engine.submitted[3].status is JobStatus.CANCELLED
        assert call(url + VIDEOS, "POST", {"prompt": "a"})[0] == 200
        assert call(url + VIDEOS, "POST", {"prompt": "a"})[0] == 429
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
        with pytest.raises(openai.RateLimitError):
            client.videos.create(prompt="a")
        text = call(url + "/metrics")[2].decode()
        assert counter(text, "mmpipe_serve_requests_total", status="rejected") == 3


def test_health_and_models(engine: FakeEngine, client: openai.OpenAI, url: str) -> None:
    assert call(url + "/health")[:1] == (200,)
    assert [m.id for m in client.models.list()] == ["mmpipe-wan"]
    assert client.models.retrieve("mmpipe-wan").owned_by == "mmpipe"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("sora-2")
    code, _, body = call(url + "/v1/nothing")
    assert code == 404 and "error" in json.loads(body)
    assert call(url + "/health", "POST", {})[0] == 405
    engine.healthy, engine.fatal = False, "serving group 1 died"
    code, _, body = call(url + "/health")
    assert code == 503 and json.loads(body)["error"] == "serving group 1 died"


def test_metrics_text() -> None:
    metrics = ServeMetrics()
    ServeMetrics().request_finished("completed")  # its own registry: no clash, no shared series
    metrics.observe_stage("denoise", 0.002, 0.25, 3)
    metrics.observe_stage("denoise", 0.02, 0.5, 1)
    metrics.observe_stage("text", 0.001, 0.01, 4)
    for status in ("completed", "completed", "failed"):
        metrics.request_finished(status)
    metrics.edge_bytes("text->denoise", 1000)
    metrics.edge_bytes("text->denoise", 24)
    metrics.set_queue_depth(5)
    body, content_type = metrics.render()
    text = body.decode()
    assert content_type.startswith("text/plain")
    assert counter(text, "mmpipe_serve_stage_batch_size_count", stage="denoise") == 2
    assert counter(text, "mmpipe_serve_stage_batch_size_sum", stage="denoise") == 4
    assert counter(text, "mmpipe_serve_stage_batch_size_bucket", stage="denoise", le="2.0") == 1
    assert counter(text, "mmpipe_serve_stage_run_seconds_sum", stage="denoise") == 0.75
    assert counter(text, "mmpipe_serve_stage_queue_seconds_bucket", stage="denoise", le="0.005") == 1
    assert counter(text, "mmpipe_serve_stage_batch_size_count", stage="text") == 1
    assert counter(text, "mmpipe_serve_requests_total", status="completed") == 2
    assert counter(text, "mmpipe_serve_requests_total", status="failed") == 1
    assert counter(text, "mmpipe_serve_edge_bytes_total", edge="text->denoise") == 1024
    assert counter(text, "mmpipe_serve_queue_depth") == 5


def test_metrics_endpoint(engine: FakeEngine, client: openai.OpenAI, url: str) -> None:
    before = call(url + "/metrics")[2].decode()
    client.videos.create(prompt="a")
    engine.metrics.observe_stage("decode", 0.0, 0.1, 1)
    code, headers, body = call(url + "/metrics")
    assert code == 200 and headers["content-type"].startswith("text/plain")
    for name, labels in [
        ("mmpipe_serve_requests_total", {"status": "completed"}),
        ("mmpipe_serve_stage_run_seconds_count", {"stage": "decode"}),
    ]:
        assert counter(body.decode(), name, **labels) == counter(before, name, **labels) + 1


def _until(predicate: object, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():  # type: ignore[operator]
            return True
        time.sleep(0.01)
    return False


def test_input_reference_is_checked_against_the_model(served: tuple[FakeEngine, str], engine: FakeEngine) -> None:
    """OpenAI's ``input_reference`` upload: refused by a text-to-video model, required by an
    image-to-video one, re-encoded as PNG when it is a readable image, a 400 naming it when not."""
    client = openai.OpenAI(base_url=f"{served[1]}/v1", api_key="x", max_retries=0)
    picture = Image.new("RGB", (16, 16), (200, 30, 30))
    buf = io.BytesIO()
    picture.save(buf, format="JPEG")
    jpeg = ("first.jpg", buf.getvalue(), "image/jpeg")
    with pytest.raises(openai.BadRequestError) as err:
        client.videos.create(prompt="a red circle", input_reference=jpeg)
    assert err.value.body["param"] == "input_reference" and "takes no input image" in err.value.body["message"]  # type: ignore[index]
    engine.image_input = "required"
    try:
        with pytest.raises(openai.BadRequestError) as err:
            client.videos.create(prompt="a red circle")
        assert "input_reference is required" in err.value.body["message"]  # type: ignore[index]
        with pytest.raises(openai.BadRequestError) as err:
            client.videos.create(prompt="a red circle", input_reference=("x.png", b"not an image", "image/png"))
        assert "input_reference is not a readable image" in err.value.body["message"]  # type: ignore[index]
        assert not engine.submitted
        client.videos.create(prompt="a red circle", input_reference=jpeg)
        (job,) = engine.submitted
        assert job.request.image is not None
        got = np.asarray(Image.open(io.BytesIO(job.request.image)))
        assert got.shape == (16, 16, 3) and np.array_equal(got, np.asarray(Image.open(io.BytesIO(jpeg[1]))))
    finally:
        engine.image_input = None
