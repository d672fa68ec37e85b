"""Text-to-video dataset backed by a folder of video files and a JSONL captions file."""

from __future__ import annotations

import json
import math
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.data import Dataset

from mmpipe.data.shapes import VideoSample
from mmpipe.data.video_io import count_frames, read_video

__all__ = ["FolderVideoDataset"]

_MAX_NAMES_IN_WARNING = 3


@dataclass(frozen=True)
class _Entry:
    """One captions-file line: a video path relative to the root and its caption."""

    video: str
    caption: str


def _check_positive_int(name: str, value: object) -> int:
    """Return ``value`` if it is a positive int, else raise ValueError."""
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return value


def _parse_line(line: str, path: Path, lineno: int) -> _Entry:
    """Parse one JSON line into an entry; ValueError naming file and line on bad input."""
    where = f"{path}, line {lineno}"
    try:
        record = json.loads(line)
    except json.JSONDecodeError as err:
        raise ValueError(f"{where}: invalid JSON ({err.msg})") from err
    if not isinstance(record, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(record).__name__}")
    for key in ("video", "caption"):
        if key not in record:
            raise ValueError(f"{where}: missing key {key!r}")
        if not isinstance(record[key], str):
            raise ValueError(f"{where}: {key!r} must be a string, got {record[key]!r}")
    if not record["video"]:
        raise ValueError(f"{where}: 'video' must be a non-empty path")
    return _Entry(video=record["video"], caption=record["caption"])


def _read_captions(path: Path) -> list[_Entry]:
    """Read all non-blank lines of a JSONL captions file."""
    with path.open(encoding="utf-8") as handle:
        return [_parse_line(line, path, lineno) for lineno, line in enumerate(handle, start=1) if line.strip()]


def _probe(path: Path, frames: int) -> str | None:
    """Return why ``path`` is unusable ("missing", "unreadable", "too short") or None."""
    if not path.is_file():
        return "missing"
    try:
        available = count_frames(path, max_frames=frames)
    except (ValueError, OSError):
        return "unreadable"
    return "too short" if available < frames else None


def _skip_summary(skipped: dict[str, list[str]], total: int, root: Path, frames: int) -> str:
    """One-line description of skipped videos, grouped by reason."""
    parts = []
    for reason, names in skipped.items():
        if not names:
            continue
        shown = ", ".join(names[:_MAX_NAMES_IN_WARNING])
        if len(names) > _MAX_NAMES_IN_WARNING:
            shown += f", +{len(names) - _MAX_NAMES_IN_WARNING} more"
        label = f"< {frames} frames: {shown}" if reason == "too short" else shown
        parts.append(f"{len(names)} {reason} ({label})")
    count = sum(len(names) for names in skipped.values())
    return f"skipped {count} of {total} videos in {root}: " + ", ".join(parts)


def _resize_cover_crop(frames_THWC: np.ndarray, height: int, width: int) -> torch.Tensor:
    """Bilinear-resize so the frame covers (height, width), then center-crop.

    Returns float32 in [0, 1] with shape (T, 3, height, width).
    """
    frames_T3HW = torch.from_numpy(frames_THWC).permute(0, 3, 1, 2).float().div_(255.0)
    src_h, src_w = frames_T3HW.shape[-2:]
    scale = max(height / src_h, width / src_w)
    new_h = max(height, math.ceil(src_h * scale - 1e-6))
    new_w = max(width, math.ceil(src_w * scale - 1e-6))
    if (new_h, new_w) != (src_h, src_w):
        frames_T3HW = F.interpolate(
            frames_T3HW, size=(new_h, new_w), mode="bilinear", align_corners=False, antialias=True
        ).clamp_(0.0, 1.0)
    top, left = (new_h - height) // 2, (new_w - width) // 2
    return frames_T3HW[:, :, top : top + height, left : left + width]


class FolderVideoDataset(Dataset[VideoSample]):
    """Videos under ``root`` listed with captions in a JSONL file.

    Each line of ``root / captions_file`` is ``{"video": "rel/path.mp4",
    "caption": "text"}``; blank lines are ignored. Every listed video is probed
    at construction (its first ``frames`` frames are decoded); missing,
    unreadable and too-short videos are skipped with a single warning.

    Each item is ``{"video": float32 tensor (3, frames, height, width) in
    [-1, 1], "caption": str}`` made from the first ``frames`` frames, resized
    (bilinear, aspect-preserving, covering) and center-cropped.
    """

    def __init__(
        self,
        *,
        root: str | Path,
        frames: int,
        height: int,
        width: int,
        captions_file: str = "captions.jsonl",
    ):
        """Read the captions file and probe every listed video."""
        self.frames = _check_positive_int("frames", frames)
        self.height = _check_positive_int("height", height)
        self.width = _check_positive_int("width", width)
        self.root = Path(root)
        if not self.root.is_dir():
            raise ValueError(f"dataset root is not an existing directory: {self.root}")
        captions_path = self.root / captions_file
        if not captions_path.is_file():
            raise ValueError(f"captions file not found: {captions_path}")
        self.entries = self._usable_entries(_read_captions(captions_path))

    def _usable_entries(self, entries: list[_Entry]) -> list[_Entry]:
        """Probe each distinct video once; warn about and drop unusable ones."""
        videos = dict.fromkeys(entry.video for entry in entries)
        reasons = {video: _probe(self.root / video, self.frames) for video in videos}
        skipped: dict[str, list[str]] = {"missing": [], "unreadable": [], "too short": []}
        for video, reason in reasons.items():
            if reason is not None:
                skipped[reason].append(video)
        if any(skipped.values()):
            message = _skip_summary(skipped, len(reasons), self.root, self.frames)
            warnings.warn(message, stacklevel=3)
        usable = [entry for entry in entries if reasons[entry.video] is None]
        if not usable:
            raise ValueError(f"no usable videos in {self.root}")
        return usable

    def __len__(self) -> int:
        """Number of usable (video, caption) pairs."""
        return len(self.entries)

    def __getitem__(self, i: int) -> VideoSample:
        """Decode, resize and crop sample ``i``; ValueError naming the file if decoding fails."""
        entry = self.entries[i]
        path = self.root / entry.video
        try:
            frames_THWC = read_video(path, max_frames=self.frames)
        except (ValueError, OSError) as err:
            raise ValueError(f"cannot decode video {path}: {err}") from err
        if frames_THWC.shape[0] < self.frames:
            raise ValueError(f"video {path} now has {frames_THWC.shape[0]} frames, need {self.frames}")
        frames_T3HW = _resize_cover_crop(frames_THWC, self.height, self.width)
        video_CTHW = frames_T3HW.permute(1, 0, 2, 3).contiguous().mul_(2.0).sub_(1.0)
        return VideoSample(video=video_CTHW, caption=entry.caption)
