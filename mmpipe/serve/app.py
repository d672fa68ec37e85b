"""The HTTP front end of ``mmpipe serve``: OpenAI's video and image endpoints over the engine.

Endpoints (shapes follow the OpenAI API, so the official ``openai`` client works against them)::

    POST   /v1/videos                 create a video job -> Video object (status "queued")
    GET    /v1/videos/{id}            the job's status and progress
    GET    /v1/videos/{id}/content    the MP4 (?variant=thumbnail: the first frame as PNG)
    DELETE /v1/videos/{id}            cancel the job (its work is freed in every group); 404 after
    POST   /v1/images/generations     synchronous: n one-frame jobs -> base64 PNGs (or image/png)
    GET    /v1/models, /v1/models/{id}, /health, /metrics (Prometheus text)

Handlers never block the event loop: they poll ``Job.wait(0)`` between short sleeps, and encode
MP4 / PNG in a worker thread. Every error is OpenAI's ``{"error": {...}}`` JSON.

With an API key (``serve.api_key``, else ``$MMPIPE_API_KEY``), every request but ``/health`` and
``/metrics`` (probes and scrapers) must carry ``Authorization: Bearer <key>``, as OpenAI's own API
wants it; others get 401 ``invalid_api_key``, which the ``openai`` client raises as
``AuthenticationError``. The key is compared in constant time and never logged or echoed.
"""

from __future__ import annotations

import asyncio
import base64
import hmac
import io
import math
import os
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

import numpy as np
from fastapi import APIRouter, FastAPI, Request, Response
from fastapi.responses import JSONResponse
from PIL import Image
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Receive, Scope, Send

from mmpipe.config import ServeConfig
from mmpipe.data import write_mp4
from mmpipe.serve.metrics import ServeMetrics
from mmpipe.serve.protocol import WORKER_RESTARTED, GenerationRequest, Job, JobStatus, QueueFull
from mmpipe.serve.requests import (
    ApiError,
    ImageBody,
    VideoBody,
    build_image_requests,
    build_video_request,
    parse_body,
)

_POLL_S = 0.02  # how often a synchronous request looks at its jobs (and at its client)
# ``openai-poll-after-ms`` on a retrieve: how long the openai client's poll helpers wait before the next
# one. A queued job gets _POLL_QUEUED_MS; a running one half its estimated remaining time (from its own
# progress rate), within [_POLL_MIN_MS, _POLL_MAX_MS], so a client following the hint retrieves a few
# times a request and sees the completion within about _POLL_MIN_MS, instead of polling at a fixed rate
# whose CPU the workers on the same host pay for.
_POLL_QUEUED_MS = 250
_POLL_MIN_MS = 10
_POLL_MAX_MS = 1000
_TIMEOUT_GRACE_S = 5.0  # the engine fails a job at its timeout; the handler gives up this much later
API_KEY_ENV = "MMPIPE_API_KEY"  # the key when serve.api_key is unset
_OPEN_PATHS = frozenset({"/health", "/metrics"})  # answered without a key: load balancers and scrapers send none


class ServingEngine(Protocol):
    """What the front end needs of :class:`mmpipe.serve.engine.Engine`."""

    model_id: str
    cfg: ServeConfig
    metrics: ServeMetrics
    healthy: bool  # False while the worker groups restart, and for good once restarts are used up
    restarting: bool  # the worker groups are restarting (healthy again soon)
    fatal: str | None  # why it is not healthy
    output: str  # "video", or "image" for an image family (Flux, Qwen-Image): no /v1/videos
    image_input: str | None  # "required" / "optional": the model takes input_reference; None: it does not

    def submit(self, request: GenerationRequest) -> Job: ...

    def get(self, job_id: str) -> Job | None: ...

    def cancel(self, job_id: str) -> bool: ...


def create_app(engine: ServingEngine, *, api_key: str | None = None) -> FastAPI:
    """The FastAPI application serving ``engine`` (which the caller starts and closes); with
    ``api_key``, requests other than ``/health`` and ``/metrics`` must carry it as a bearer token."""
    app = FastAPI(title="mmpipe serve", docs_url=None, redoc_url=None, openapi_url=None)
    if api_key is not None:
        app.add_middleware(RequireApiKey, api_key=api_key)
    app.state.engine = engine
    app.state.created = int(time.time())
    app.state.deleted = set()  # ids of videos a client deleted: 404 from then on
    app.add_exception_handler(ApiError, _api_error)  # type: ignore[arg-type]
    app.add_exception_handler(StarletteHTTPException, _http_error)  # type: ignore[arg-type]
    app.include_router(router)
    return app


def resolve_api_key(configured: str | None, env: Mapping[str, str] = os.environ) -> str | None:
    """The key clients must send: ``serve.api_key``, else ``$MMPIPE_API_KEY`` (empty: unset), else
    None (no authentication). Read once, when the server starts."""
    if configured is not None:
        if not configured.strip():
            raise ValueError("serve: api_key is empty: give a key, or leave it unset (null) for no authentication")
        return configured
    return env.get(API_KEY_ENV) or None


class RequireApiKey:
    """ASGI middleware: 401 in OpenAI's shape unless the request carries ``Authorization: Bearer
    <key>``; ``/health`` and ``/metrics`` stay open. A plain ASGI middleware, not Starlette's
    ``BaseHTTPMiddleware``, so that handlers still see their client disconnect."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self._key = api_key.encode()  # bytes: compare_digest refuses non-ASCII str, a header may carry any byte

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in _OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        message = self._refusal(dict(scope["headers"]).get(b"authorization"))
        if message is None:
            await self.app(scope, receive, send)
            return
        error = ApiError(401, message, code="invalid_api_key")
        response = JSONResponse(error.body(), status_code=401, headers={"WWW-Authenticate": "Bearer"})
        await response(scope, receive, send)

    def _refusal(self, header: bytes | None) -> str | None:
        """Why a request with this Authorization header is refused, or None when it carries the key."""
        if header is None:
            return "no API key given: send it as 'Authorization: Bearer <key>'"
        scheme, _, token = header.strip().partition(b" ")
        if scheme.lower() != b"bearer":
            return "the Authorization header is not 'Bearer <key>'"
        if not hmac.compare_digest(token.strip(), self._key):
            return "incorrect API key"  # never echo what was sent, nor the key
        return None


router = APIRouter()


@router.post("/v1/videos")
async def create_video(request: Request) -> JSONResponse:
    """Validate, queue and describe a video job."""
    engine = _engine(request)
    body = parse_body(VideoBody, await _read_body(request))
    if engine.output == "image":
        raise ApiError(
            400, f"model {engine.model_id!r} generates images: use POST /v1/images/generations", param="model"
        )
    if body.input_reference is not None and engine.image_input is None:
        raise ApiError(400, f"model {engine.model_id!r} takes no input image", param="input_reference")
    if body.input_reference is None and engine.image_input == "required":
        raise ApiError(
            400, f"model {engine.model_id!r} is image-to-video: input_reference is required", param="input_reference"
        )
    job = _submit(engine, build_video_request(body, engine.cfg, engine.model_id))
    return JSONResponse(video_object(job, engine))


@router.get("/v1/videos/{video_id}")
async def retrieve_video(video_id: str, request: Request) -> JSONResponse:
    """The job's status, progress and (when it failed) error."""
    engine = _engine(request)
    job = _find(request, video_id)
    return JSONResponse(video_object(job, engine), headers={"openai-poll-after-ms": str(poll_after_ms(job))})


@router.get("/v1/videos/{video_id}/content")
async def video_content(video_id: str, request: Request, variant: str = "video") -> Response:
    """The finished video as MP4, or its first frame as PNG (``variant=thumbnail``)."""
    job = _find(request, video_id)
    if variant not in ("video", "thumbnail"):
        raise ApiError(400, f"variant={variant!r}: expected 'video' or 'thumbnail'", param="variant")
    if job.status is not JobStatus.COMPLETED:
        detail = f": {job.error}" if job.error else ""
        raise ApiError(409, f"video {video_id} is {job.status.value}{detail}", code="video_not_ready")
    assert job.frames is not None  # a completed job has its frames
    if variant == "thumbnail":
        return Response(await asyncio.to_thread(encode_png, job.frames[0]), media_type="image/png")
    mp4 = await asyncio.to_thread(encode_mp4, job.frames, _engine(request).cfg.fps)
    return Response(mp4, media_type="video/mp4")


@router.delete("/v1/videos/{video_id}")
async def delete_video(video_id: str, request: Request) -> JSONResponse:
    """Cancel the job (a no-op once it finished) and forget it."""
    _find(request, video_id)
    _engine(request).cancel(video_id)
    request.app.state.deleted.add(video_id)
    return JSONResponse({"id": video_id, "object": "video.deleted", "deleted": True})


@router.post("/v1/images/generations", response_model=None)
async def create_images(request: Request) -> Response:
    """Render ``n`` images and answer when all are done (a client that leaves cancels them)."""
    engine = _engine(request)
    body = parse_body(ImageBody, await _read_body(request))
    requests = build_image_requests(body, engine.cfg, engine.model_id)
    raw_png = "image/png" in request.headers.get("accept", "")
    if raw_png and body.n != 1:
        raise ApiError(400, "Accept: image/png returns one image; use n=1 or b64_json", param="n")
    jobs = _submit_all(engine, requests)
    try:
        if not await _wait_for(request, jobs, engine.cfg):
            return Response(status_code=499)  # the client has gone: nobody reads this
    finally:
        for job in jobs:
            if not job.wait(0):  # the client left, the wait timed out, or the handler was cancelled
                engine.cancel(job.id)
    frames = [_completed_frames(job) for job in jobs]
    pngs = await asyncio.to_thread(lambda: [encode_png(f[0]) for f in frames])
    if raw_png:
        return Response(pngs[0], media_type="image/png")
    return JSONResponse(_images_response(pngs, body, requests[0]))


@router.get("/v1/models")
async def list_models(request: Request) -> JSONResponse:
    """The one model this server serves."""
    return JSONResponse({"object": "list", "data": [_model_object(request)]})


@router.get("/v1/models/{model_id}")
async def retrieve_model(model_id: str, request: Request) -> JSONResponse:
    """The served model, or 404."""
    model = _model_object(request)
    if model_id != model["id"]:
        raise ApiError(404, f"model {model_id!r} is not served here", param="model", code="model_not_found")
    return JSONResponse(model)


@router.get("/health")
async def health(request: Request) -> JSONResponse:
    """200 while every worker group is alive, else 503 with the reason (``restarting`` while the
    engine restarts its groups, ``unhealthy`` when it has given up)."""
    engine = _engine(request)
    if engine.healthy:
        return JSONResponse({"status": "ok"})
    status = "restarting" if engine.restarting else "unhealthy"
    return JSONResponse({"status": status, "error": engine.fatal}, status_code=503)


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    """Prometheus text exposition of the engine's metrics."""
    body, content_type = _engine(request).metrics.render()
    return Response(body, headers={"Content-Type": content_type})


def video_object(job: Job, engine: ServingEngine) -> dict[str, Any]:
    """OpenAI's Video object for ``job`` (plus mmpipe's ``frames``, ``seed``, ``steps``, ``guidance``)."""
    r = job.request
    return {
        "id": job.id,
        "object": "video",
        "model": engine.model_id,
        "status": job.status.value,
        "progress": job.progress,
        "created_at": int(job.created_at),
        "completed_at": int(job.completed_at) if job.completed_at else None,
        "expires_at": None,
        "prompt": r.prompt,
        "seconds": f"{r.frames / engine.cfg.fps:g}",
        "size": f"{r.width}x{r.height}",
        "remixed_from_video_id": None,
        "error": _job_error(job),
        "frames": r.frames,
        "seed": r.seed,
        "steps": r.steps,
        "guidance": r.guidance,
    }


def poll_after_ms(job: Job, now: float | None = None) -> int:
    """The ``openai-poll-after-ms`` hint for ``job`` (see ``_POLL_QUEUED_MS``): half the remaining time
    its progress so far predicts (elapsed since it started x (100 - progress) / progress)."""
    if job.status.done:
        return _POLL_MIN_MS
    if job.started_at is None or job.progress <= 0:
        return _POLL_QUEUED_MS
    elapsed = max(0.0, (time.time() if now is None else now) - job.started_at)
    remaining_ms = 1000.0 * elapsed * (100 - job.progress) / job.progress
    return int(min(_POLL_MAX_MS, max(_POLL_MIN_MS, remaining_ms / 2)))


def encode_mp4(frames_THWC: np.ndarray, fps: int) -> bytes:
    """``(T, H, W, 3)`` uint8 frames -> MP4 bytes (H.264, or MPEG-4 where FFmpeg lacks it)."""
    with tempfile.TemporaryDirectory(prefix="mmpipe-serve-") as tmp:
        return write_mp4(frames_THWC, Path(tmp) / "video.mp4", fps=fps).read_bytes()


def encode_png(frame_HWC: np.ndarray) -> bytes:
    """One ``(H, W, 3)`` uint8 frame -> PNG bytes."""
    out = io.BytesIO()
    Image.fromarray(np.ascontiguousarray(frame_HWC)).save(out, format="PNG")
    return out.getvalue()


def _engine(request: Request) -> ServingEngine:
    return request.app.state.engine


def _find(request: Request, video_id: str) -> Job:
    job = _engine(request).get(video_id)
    if job is None or video_id in request.app.state.deleted:
        raise ApiError(404, f"no video with id {video_id!r}", param="video_id", code="not_found")
    return job


async def _read_body(request: Request) -> Any:
    """JSON, or form fields (the ``openai`` client posts create-video as multipart form data)."""
    content_type = request.headers.get("content-type", "")
    if content_type.startswith(("multipart/form-data", "application/x-www-form-urlencoded")):
        form = await request.form()
        fields: dict[str, Any] = {}
        for key, value in form.multi_items():
            if isinstance(value, str):
                fields[key] = value
            elif key == "input_reference":
                fields[key] = _image_png(await value.read())
            else:
                raise ApiError(400, f"{key}: a file upload is only accepted as input_reference", param=key)
        return fields
    try:
        return await request.json()
    except ValueError:
        raise ApiError(400, "the request body is not valid JSON") from None


def _image_png(data: bytes) -> bytes:
    """An uploaded image as RGB PNG bytes, or a 400 naming ``input_reference``."""
    try:
        with Image.open(io.BytesIO(data)) as image:
            image.load()
            out = io.BytesIO()
            image.convert("RGB").save(out, format="PNG")
    except (OSError, ValueError, Image.DecompressionBombError) as err:
        raise ApiError(400, f"input_reference is not a readable image ({err})", param="input_reference") from None
    return out.getvalue()


def _submit(engine: ServingEngine, request: GenerationRequest) -> Job:
    try:
        return engine.submit(request)
    except QueueFull as err:
        retry = str(max(1, math.ceil(err.retry_after)))
        raise ApiError(
            429, str(err), code="queue_full", kind="rate_limit_error", headers={"Retry-After": retry}
        ) from None
    except RuntimeError as err:  # the engine is shutting down, or a worker group died
        raise ApiError(503, str(err), code="unavailable", kind="server_error") from None


def _submit_all(engine: ServingEngine, requests: list[GenerationRequest]) -> list[Job]:
    """Submit every request, or none: a full queue part-way cancels those already in."""
    jobs: list[Job] = []
    try:
        for r in requests:
            jobs.append(_submit(engine, r))
    except ApiError:
        for job in jobs:
            engine.cancel(job.id)
        raise
    return jobs


async def _wait_for(request: Request, jobs: list[Job], cfg: ServeConfig) -> bool:
    """Wait until every job is done; False if the client disconnected first."""
    timeout = max(job.request.timeout_s or cfg.timeout_s for job in jobs)
    deadline = time.monotonic() + timeout + _TIMEOUT_GRACE_S
    while not all(job.wait(0) for job in jobs):
        if await request.is_disconnected():
            return False
        if time.monotonic() > deadline:
            raise ApiError(504, f"timed out after {timeout:g} s", code="timeout", kind="server_error")
        await asyncio.sleep(_POLL_S)
    return True


def _completed_frames(job: Job) -> np.ndarray:
    """The job's frames, or the ApiError its failure is answered with (500: an error in a stage)."""
    if job.status is JobStatus.COMPLETED:
        assert job.frames is not None
        return job.frames
    if job.status is JobStatus.CANCELLED:
        raise ApiError(503, "the request was cancelled by the server", code="cancelled", kind="server_error")
    if job.error_code == WORKER_RESTARTED:  # nothing wrong with the request: retrying it may work
        raise ApiError(503, f"generation failed: {job.error}", code=WORKER_RESTARTED, kind="server_error")
    raise ApiError(500, f"generation failed: {job.error}", code="generation_failed", kind="server_error")


def _job_error(job: Job) -> dict[str, str] | None:
    if job.status is JobStatus.FAILED:
        return {"code": job.error_code or "generation_failed", "message": job.error or "failed"}
    if job.status is JobStatus.CANCELLED:
        return {"code": "cancelled", "message": job.error or "cancelled"}
    return None


def _images_response(pngs: list[bytes], body: ImageBody, first: GenerationRequest) -> dict[str, Any]:
    """OpenAI's ImagesResponse; ``url`` answers are data URLs (the server stores no files)."""
    encoded = [base64.b64encode(png).decode("ascii") for png in pngs]
    if body.response_format == "url":
        data = [{"url": f"data:image/png;base64,{b64}"} for b64 in encoded]
    else:
        data = [{"b64_json": b64} for b64 in encoded]
    return {"created": int(time.time()), "data": data, "output_format": "png", "size": f"{first.width}x{first.height}"}


def _model_object(request: Request) -> dict[str, Any]:
    engine = _engine(request)
    return {"id": engine.model_id, "object": "model", "created": request.app.state.created, "owned_by": "mmpipe"}


async def _api_error(request: Request, err: ApiError) -> JSONResponse:
    if request.method == "POST" and err.status in (400, 422):  # the engine counts 429s ("rejected")
        _engine(request).metrics.request_finished("invalid")
    return JSONResponse(err.body(), status_code=err.status, headers=err.headers)


async def _http_error(request: Request, err: StarletteHTTPException) -> JSONResponse:
    """Unknown routes (404) and methods (405) in OpenAI's error shape."""
    error = ApiError(err.status_code, f"{request.method} {request.url.path}: {err.detail}", code=str(err.status_code))
    return JSONResponse(error.body(), status_code=err.status_code, headers=dict(err.headers or {}))
