"""OpenAI-shaped request bodies -> validated :class:`GenerationRequest`s, or an :class:`ApiError`.

Bodies follow OpenAI's create-video (``model``, ``prompt``, ``seconds``, ``size`` "WxH") and
create-image (``n``, ``size``, ``response_format``) requests; mmpipe's own fields (``seed``,
``steps``, ``guidance``, ``frames``, ``negative_prompt``, ``timeout_s``) come as extra body fields.
The ``openai`` client sends create-video as multipart form data, so every value may arrive as a
string: types are checked in pydantic's lax mode ("4" is an int, "abc" and 4.5 are not). Unknown
fields are ignored, as OpenAI's own optional fields are. Type errors are 422, value errors 400;
both name the field in ``param``.
"""

from __future__ import annotations

import dataclasses
import math
import re
import secrets
from typing import Annotated, Any, Literal, TypeVar

from pydantic import BaseModel, BeforeValidator, ConfigDict, ValidationError

from mmpipe.config import ServeConfig
from mmpipe.serve.protocol import GenerationRequest

MAX_IMAGES = 10  # OpenAI's limit on ``n``
_SIZE = re.compile(r"(\d+)x(\d+)")
B = TypeVar("B", bound=BaseModel)


class ApiError(Exception):
    """An error answered as OpenAI's ``{"error": {"message", "type", "param", "code"}}``."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        kind: str = "invalid_request_error",
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        """The JSON body of the error response."""
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


def _not_bool(value: Any) -> Any:
    # pydantic's lax mode reads true as 1; a boolean seed or step count is a client bug.
    if isinstance(value, bool):
        raise ValueError("expected a number, got a boolean")
    return value


Int = Annotated[int, BeforeValidator(_not_bool)]
Float = Annotated[float, BeforeValidator(_not_bool)]


class _Extras(BaseModel):
    """mmpipe's fields, shared by videos and images."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    prompt: str
    negative_prompt: str | None = None
    size: str | None = None
    seed: Int | None = None
    steps: Int | None = None
    guidance: Float | None = None
    timeout_s: Float | None = None


class VideoBody(_Extras):
    """``POST /v1/videos``; ``input_reference`` is the uploaded first frame of image-to-video
    models, read and re-encoded as PNG by the front end."""

    seconds: Float | None = None
    frames: Int | None = None
    input_reference: bytes | None = None


class ImageBody(_Extras):
    """``POST /v1/images/generations``."""

    n: Int = 1
    response_format: Literal["b64_json", "url"] | None = None
    output_format: Literal["png"] | None = None


def parse_body(cls: type[B], data: Any) -> B:
    """``data`` as ``cls``; a missing or mistyped field -> 422 naming it."""
    if not isinstance(data, dict):
        raise ApiError(400, f"the request body must be a JSON object or form, got {type(data).__name__}")
    try:
        return cls.model_validate(data)
    except ValidationError as err:
        first = err.errors()[0]
        param = ".".join(str(p) for p in first["loc"]) or None
        raise ApiError(422, f"{param}: {first['msg']}", param=param, code="invalid_type") from None


def build_video_request(body: VideoBody, cfg: ServeConfig, model_id: str) -> GenerationRequest:
    """A validated video request; its frame count from ``frames``, else ``seconds`` x ``fps``."""
    frames = _frames(body, cfg)
    return dataclasses.replace(_build(body, cfg, model_id, frames), image=body.input_reference)


def build_image_requests(body: ImageBody, cfg: ServeConfig, model_id: str) -> list[GenerationRequest]:
    """``n`` one-frame requests with seeds ``seed .. seed + n - 1``."""
    if not 1 <= body.n <= MAX_IMAGES:
        raise _invalid("n", f"n={body.n}: expected 1..{MAX_IMAGES}")
    first = _build(body, cfg, model_id, frames=1)
    if first.seed + body.n - 1 >= 2**63:
        raise _invalid("seed", f"seed={first.seed}: seed + n - 1 must be < 2**63")
    return [dataclasses.replace(first, seed=first.seed + i) for i in range(body.n)]


def _build(body: _Extras, cfg: ServeConfig, model_id: str, frames: int) -> GenerationRequest:
    _check_model(body.model, model_id)
    _check_prompt("prompt", body.prompt, cfg, required=True)
    negative = body.negative_prompt or ""
    _check_prompt("negative_prompt", negative, cfg, required=False)
    width, height = _size(body.size, cfg)
    steps = cfg.steps if body.steps is None else body.steps
    if not 1 <= steps <= cfg.max_steps:
        raise _invalid("steps", f"steps={steps}: expected 1..{cfg.max_steps} (serve.max_steps)")
    guidance = cfg.guidance if body.guidance is None else body.guidance
    if not (math.isfinite(guidance) and guidance >= 0):
        raise _invalid("guidance", f"guidance={guidance}: expected a finite number >= 0")
    return GenerationRequest(
        prompt=body.prompt,
        negative_prompt=negative,
        height=height,
        width=width,
        frames=frames,
        steps=steps,
        guidance=guidance,
        seed=_seed(body.seed),
        timeout_s=_timeout(body.timeout_s, cfg),
    )


def _invalid(param: str, message: str, code: str = "invalid_value") -> ApiError:
    return ApiError(400, message, param=param, code=code)


def _check_model(model: str | None, model_id: str) -> None:
    if model is not None and model != model_id:
        raise _invalid("model", f"model={model!r} is not served here; models: [{model_id!r}]", "model_not_found")


def _check_prompt(param: str, text: str, cfg: ServeConfig, *, required: bool) -> None:
    if required and not text.strip():
        raise _invalid(param, f"{param} must be a non-empty string")
    if len(text) > cfg.max_prompt_chars:
        raise _invalid(
            param, f"{param} has {len(text)} characters; at most {cfg.max_prompt_chars} (serve.max_prompt_chars)"
        )


def _size(size: str | None, cfg: ServeConfig) -> tuple[int, int]:
    """``"WxH"`` -> (width, height); None or ``"auto"``: the server's default."""
    if size is None or size == "auto":
        return cfg.width, cfg.height
    match = _SIZE.fullmatch(size)
    if match is None:
        raise _invalid("size", f"size={size!r}: expected 'WIDTHxHEIGHT', e.g. '{cfg.width}x{cfg.height}'")
    width, height = int(match[1]), int(match[2])
    if width == 0 or height == 0 or width % 16 or height % 16:
        raise _invalid("size", f"size={size!r}: width and height must be positive multiples of 16")
    if width > cfg.max_width or height > cfg.max_height:
        raise _invalid("size", f"size={size!r}: at most {cfg.max_width}x{cfg.max_height} (serve.max_width/height)")
    return width, height


def _frames(body: VideoBody, cfg: ServeConfig) -> int:
    """``frames`` as given (4k+1), else ``seconds`` at ``cfg.fps`` rounded to the nearest 4k+1."""
    if body.frames is not None:
        if body.frames < 1 or body.frames % 4 != 1 or body.frames > cfg.max_frames:
            raise _invalid(
                "frames", f"frames={body.frames}: expected 4k+1 frames, at most {cfg.max_frames} (serve.max_frames)"
            )
        return body.frames
    if body.seconds is None:
        return cfg.frames
    if not (math.isfinite(body.seconds) and body.seconds > 0):
        raise _invalid("seconds", f"seconds={body.seconds}: expected a positive number")
    # The VAE's temporal stride is 4: a clip has 4k+1 frames.
    frames = 4 * max(0, round((body.seconds * cfg.fps - 1) / 4)) + 1
    if frames > cfg.max_frames:
        raise _invalid(
            "seconds",
            f"seconds={body.seconds:g} is {frames} frames at {cfg.fps} fps; at most {cfg.max_frames} (serve.max_frames)",
        )
    return frames


def _seed(seed: int | None) -> int:
    if seed is None:
        return secrets.randbelow(2**31)  # like diffusers without a generator: a fresh seed
    if not 0 <= seed < 2**63:
        raise _invalid("seed", f"seed={seed}: expected 0 <= seed < 2**63")
    return seed


def _timeout(timeout_s: float | None, cfg: ServeConfig) -> float | None:
    if timeout_s is None:
        return None
    if not 0 < timeout_s <= cfg.timeout_s:
        raise _invalid(
            "timeout_s", f"timeout_s={timeout_s}: expected 0 < timeout_s <= {cfg.timeout_s} (serve.timeout_s)"
        )
    return timeout_s
