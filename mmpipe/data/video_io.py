"""Reading and writing short RGB videos (PyAV for mp4, Pillow for GIF).

Frame arrays are ``uint8`` of shape ``(T, H, W, 3)`` (RGB). Model-side videos
are float tensors of shape ``(3, T, H, W)`` in ``[-1, 1]``.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from fractions import Fraction
from pathlib import Path

import av
import numpy as np
import torch
from PIL import Image

__all__ = [
    "count_frames",
    "frames_to_uint8",
    "read_video",
    "video_to_uint8",
    "write_gif",
    "write_png",
    "write_mp4",
]

_H264_CRF = "18"
_MPEG4_BIT_RATE_PER_PIXEL = 8  # bits per pixel per frame, before fps scaling


def _check_positive_int(name: str, value: object) -> int:
    """Return ``value`` if it is a positive int, else raise ValueError."""
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return value


def _check_max_frames(max_frames: int | None) -> int | None:
    """Validate an optional frame limit."""
    if max_frames is None:
        return None
    return _check_positive_int("max_frames", max_frames)


def _check_uint8_frames(frames_THWC: np.ndarray) -> None:
    """Raise ValueError unless ``frames_THWC`` is a non-empty uint8 (T, H, W, 3) array."""
    if not isinstance(frames_THWC, np.ndarray):
        raise ValueError(f"frames must be a numpy array, got {type(frames_THWC).__name__}")
    if frames_THWC.dtype != np.uint8:
        raise ValueError(f"frames must have dtype uint8, got {frames_THWC.dtype}")
    if frames_THWC.ndim != 4 or frames_THWC.shape[-1] != 3:
        raise ValueError(f"frames must have shape (T, H, W, 3), got {frames_THWC.shape}")
    if min(frames_THWC.shape[:3]) == 0:
        raise ValueError(f"frames must be non-empty, got shape {frames_THWC.shape}")


def _require_file(path: Path) -> None:
    """Raise FileNotFoundError naming ``path`` if it is not an existing file."""
    if not path.is_file():
        raise FileNotFoundError(f"video file not found: {path}")


def _decode(path: Path, limit: int | None) -> Iterator[av.VideoFrame]:
    """The first video stream's frames (at most ``limit``); FFmpeg errors become ``ValueError``."""
    try:
        with av.open(str(path)) as container:
            if not container.streams.video:
                raise ValueError(f"no video stream in {path}")
            stream = container.streams.video[0]
            stream.thread_type = "AUTO"
            for i, frame in enumerate(container.decode(stream)):
                if limit is not None and i >= limit:
                    break
                yield frame
    except av.FFmpegError as err:
        raise ValueError(f"cannot decode video {path}: {err}") from err


def read_video(path: str | Path, max_frames: int | None = None) -> np.ndarray:
    """Decode the first video stream of ``path`` into RGB frames.

    Args:
        path: Any container/codec FFmpeg can decode (mp4, gif, webm, ...).
        max_frames: Stop after this many frames; ``None`` decodes everything.

    Returns:
        ``uint8`` array of shape ``(T, H, W, 3)``, ``T >= 1``.

    Raises:
        FileNotFoundError: ``path`` does not exist.
        ValueError: The file cannot be decoded or holds no video frames.
    """
    path = Path(path)
    limit = _check_max_frames(max_frames)
    _require_file(path)
    frames = [frame.to_ndarray(format="rgb24") for frame in _decode(path, limit)]
    if not frames:
        raise ValueError(f"no frames decoded from video {path}")
    try:
        return np.stack(frames)
    except ValueError as err:
        raise ValueError(f"frame size changes within video {path}") from err


def count_frames(path: str | Path, max_frames: int | None = None) -> int:
    """Count the decodable frames of ``path``, stopping early at ``max_frames``.

    Frames are actually decoded (container metadata is not trusted), but not
    converted to RGB.

    Raises:
        FileNotFoundError: ``path`` does not exist.
        ValueError: The file cannot be decoded or has no video stream.
    """
    path = Path(path)
    limit = _check_max_frames(max_frames)
    _require_file(path)
    return sum(1 for _ in _decode(path, limit))


@functools.cache
def _mp4_codec_name() -> str:
    """Return ``"libx264"`` if this FFmpeg build can encode it, else ``"mpeg4"``."""
    try:
        av.codec.Codec("libx264", "w")
    except av.FFmpegError:
        return "mpeg4"
    return "libx264"


def _pad_to_even(frames_THWC: np.ndarray) -> np.ndarray:
    """Edge-pad height and width at the bottom/right up to even sizes (yuv420p needs it)."""
    _, height, width, _ = frames_THWC.shape
    pad_h, pad_w = height % 2, width % 2
    if not (pad_h or pad_w):
        return frames_THWC
    return np.pad(frames_THWC, ((0, 0), (0, pad_h), (0, pad_w), (0, 0)), mode="edge")


def write_mp4(frames_THWC: np.ndarray, path: str | Path, fps: int = 8, *, codec: str | None = None) -> Path:
    """Encode RGB frames as an H.264 (or MPEG-4 part 2 fallback) yuv420p mp4.

    Odd heights/widths are edge-padded by one pixel at the bottom/right, so a
    33x17 clip is stored (and read back) as 34x18.

    Args:
        frames_THWC: ``uint8`` array of shape ``(T, H, W, 3)``.
        path: Output file; parent directories are created.
        fps: Frames per second.
        codec: Encoder name; default ``libx264`` when available, else ``mpeg4``.

    Returns:
        ``path`` as a ``Path``.
    """
    _check_uint8_frames(frames_THWC)
    _check_positive_int("fps", fps)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    padded_THWC = _pad_to_even(frames_THWC)
    _, height, width, _ = padded_THWC.shape
    codec_name = codec or _mp4_codec_name()
    with av.open(str(path), mode="w", format="mp4") as container:
        stream = container.add_stream(codec_name, rate=fps)
        if not isinstance(stream, av.VideoStream):
            raise ValueError(f"codec {codec_name!r} is not a video encoder")
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        stream.time_base = Fraction(1, fps)
        if codec_name == "libx264":
            stream.options = {"crf": _H264_CRF}
        else:
            stream.bit_rate = max(1_000_000, _MPEG4_BIT_RATE_PER_PIXEL * height * width * fps)
        for index, frame_HWC in enumerate(padded_THWC):
            frame = av.VideoFrame.from_ndarray(np.ascontiguousarray(frame_HWC), format="rgb24")
            frame.pts = index
            container.mux(stream.encode(frame))
        container.mux(stream.encode(None))
    return path


def write_png(image_HWC: np.ndarray, path: str | Path) -> Path:
    """Write one ``uint8`` RGB image ``(H, W, 3)`` as a PNG; parent directories are created."""
    _check_uint8_frames(image_HWC[None])
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(np.ascontiguousarray(image_HWC)).save(path)
    return path


def write_gif(frames_THWC: np.ndarray, path: str | Path, fps: int = 8) -> Path:
    """Write RGB frames as an endlessly looping GIF with Pillow.

    Note: Pillow merges consecutive identical frames into one (longer) frame,
    so a GIF of a static clip reads back with fewer frames than were written.

    Args:
        frames_THWC: ``uint8`` array of shape ``(T, H, W, 3)``.
        path: Output file; parent directories are created.
        fps: Frames per second (GIF delays have 10 ms resolution).

    Returns:
        ``path`` as a ``Path``.
    """
    _check_uint8_frames(frames_THWC)
    _check_positive_int("fps", fps)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    images = [Image.fromarray(np.ascontiguousarray(frame_HWC)) for frame_HWC in frames_THWC]
    images[0].save(
        path,
        format="GIF",
        save_all=True,
        append_images=images[1:],
        duration=max(10, round(1000 / fps)),
        loop=0,
    )
    return path


def video_to_uint8(video_CTHW: torch.Tensor) -> np.ndarray:
    """Convert a float video tensor in ``[-1, 1]`` to ``uint8`` frames.

    Values outside ``[-1, 1]`` are clamped.

    Args:
        video_CTHW: Floating tensor of shape ``(3, T, H, W)``, any device.

    Returns:
        ``uint8`` array of shape ``(T, H, W, 3)``.
    """
    if not isinstance(video_CTHW, torch.Tensor):
        raise ValueError(f"video must be a torch.Tensor, got {type(video_CTHW).__name__}")
    if not video_CTHW.is_floating_point():
        raise ValueError(f"video must be a floating tensor, got dtype {video_CTHW.dtype}")
    if video_CTHW.ndim != 4 or video_CTHW.shape[0] != 3:
        raise ValueError(f"video must have shape (3, T, H, W), got {tuple(video_CTHW.shape)}")
    video_CTHW = video_CTHW.detach().float().cpu()
    if not bool(torch.isfinite(video_CTHW).all()):
        raise ValueError("video contains NaN or infinite values")
    scaled_CTHW = ((video_CTHW + 1.0) * 127.5).round().clamp(0, 255).to(torch.uint8)
    return scaled_CTHW.permute(1, 2, 3, 0).contiguous().numpy()


def frames_to_uint8(frames_THWC: np.ndarray) -> np.ndarray:
    """Convert float frames in ``[0, 1]`` of shape ``(T, H, W, 3)`` to ``uint8``.

    Values outside ``[0, 1]`` are clipped.
    """
    if not isinstance(frames_THWC, np.ndarray):
        raise ValueError(f"frames must be a numpy array, got {type(frames_THWC).__name__}")
    if not np.issubdtype(frames_THWC.dtype, np.floating):
        raise ValueError(f"frames must have a floating dtype, got {frames_THWC.dtype}")
    if frames_THWC.ndim != 4 or frames_THWC.shape[-1] != 3:
        raise ValueError(f"frames must have shape (T, H, W, 3), got {frames_THWC.shape}")
    if not np.isfinite(frames_THWC).all():
        raise ValueError("frames contain NaN or infinite values")
    return np.clip(np.rint(frames_THWC * 255.0), 0, 255).astype(np.uint8)
