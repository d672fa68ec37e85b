"""Procedural "moving shapes" text-to-video dataset.

Each sample is one filled shape of a named colour on a plain dark background,
moving in a straight line at constant speed. The shape never leaves the frame
(no wrapping, no bouncing), so the caption "a <colour> <shape> moving
<direction>" is true for every frame of the clip.

The ``instruct`` task (understand-then-generate: the model sees the clip's first
frame and an instruction) captions a clip "make it move <direction>" and starts
the shape in the middle of the frame, where its position does not depend on the
direction: only the instruction says which way it goes, only the image what it is.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import TypedDict

import numpy as np
import torch
from torch.utils.data import Dataset

__all__ = [
    "COLORS",
    "COLOR_RGB",
    "DIRECTIONS",
    "SHAPES",
    "TASKS",
    "MovingShapesDataset",
    "VideoSample",
    "caption_vocabulary",
    "instruct_clip",
    "instruction",
]

COLOR_RGB: dict[str, tuple[float, float, float]] = {
    "red": (0.9, 0.1, 0.1),
    "green": (0.1, 0.8, 0.2),
    "blue": (0.2, 0.4, 1.0),
    "yellow": (0.95, 0.9, 0.1),
    "white": (1.0, 1.0, 1.0),
    "purple": (0.65, 0.2, 0.9),
    "pink": (1.0, 0.45, 0.75),
    "cyan": (0.1, 0.9, 0.9),
}
COLORS: tuple[str, ...] = tuple(COLOR_RGB)
SHAPES: tuple[str, ...] = ("circle", "square", "triangle")
DIRECTIONS: tuple[str, ...] = ("left", "right", "up", "down")

_CAPTION_WORDS: tuple[str, ...] = ("a", "moving")
_INSTRUCTION_WORDS: tuple[str, ...] = ("make", "it", "move")
TASKS: tuple[str, ...] = ("describe", "instruct")
_BACKGROUND_MAX = 0.2  # every background channel is in [0, _BACKGROUND_MAX]
_SIZE_RANGE = (1 / 4, 1 / 3)  # shape size as a fraction of min(height, width)
_TRAVEL_RANGE = (0.5, 0.9)  # distance travelled as a fraction of the free room
# (dy, dx) per unit of travel, in image coordinates (y grows downwards).
_DIRECTION_VECTORS: dict[str, tuple[int, int]] = {
    "left": (0, -1),
    "right": (0, 1),
    "up": (-1, 0),
    "down": (1, 0),
}


class VideoSample(TypedDict):
    """One text-to-video sample: ``video`` is float32 (3, T, H, W) in [-1, 1]."""

    video: torch.Tensor
    caption: str


def caption_vocabulary(task: str = "describe") -> list[str]:
    """Return every word that can appear in a caption of ``task``, sorted and unique."""
    if task == "instruct":
        return sorted({*_INSTRUCTION_WORDS, *DIRECTIONS})
    return sorted({*_CAPTION_WORDS, *COLORS, *SHAPES, *DIRECTIONS})


def instruction(direction: str) -> str:
    """The ``instruct`` task's caption: what the model is told to do with the shape it sees."""
    return f"make it move {direction}"


@dataclass(frozen=True)
class _ClipSpec:
    """Everything needed to render one clip; centres are in pixel units."""

    color: str
    shape: str
    direction: str
    background_rgb: tuple[float, float, float]
    size: float
    start_yx: tuple[float, float]
    step_yx: tuple[float, float]

    def caption(self, task: str) -> str:
        if task == "instruct":
            return instruction(self.direction)
        return f"a {self.color} {self.shape} moving {self.direction}"


def _check_positive_int(name: str, value: object) -> int:
    """Return ``value`` if it is a positive int, else raise ValueError."""
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return value


def _pick(rng: np.random.Generator, options: tuple[str, ...]) -> str:
    """Choose one option uniformly."""
    return options[int(rng.integers(len(options)))]


def _sample_spec(rng: np.random.Generator, frames: int, height: int, width: int) -> _ClipSpec:
    """Draw colour, shape, direction, size and a trajectory that stays in frame."""
    color, shape, direction = _pick(rng, COLORS), _pick(rng, SHAPES), _pick(rng, DIRECTIONS)
    background = rng.uniform(0.0, _BACKGROUND_MAX, size=3)
    size = max(1.0, float(rng.uniform(*_SIZE_RANGE)) * min(height, width))
    dy, dx = _DIRECTION_VECTORS[direction]
    extent_yx = (float(height), float(width))
    room = extent_yx[0 if dy else 1] - size
    travel = float(rng.uniform(*_TRAVEL_RANGE)) * room if frames > 1 else 0.0
    start: list[float] = []
    for extent, d in zip(extent_yx, (dy, dx), strict=True):
        low, high = size / 2, extent - size / 2
        span = high - low - (travel if d else 0.0)
        offset = float(rng.uniform(0.0, max(span, 0.0)))
        start.append(low + offset + (travel if d < 0 else 0.0))
    return _moving(color, shape, direction, background, size, start, travel, frames)


def _moving(
    color: str,
    shape: str,
    direction: str,
    background: np.ndarray,
    size: float,
    start: list[float],
    travel: float,
    frames: int,
) -> _ClipSpec:
    """The clip of a shape starting at ``start`` (y, x) and covering ``travel`` pixels towards
    ``direction`` at constant speed over ``frames`` frames."""
    dy, dx = _DIRECTION_VECTORS[direction]
    step = travel / max(frames - 1, 1)
    return _ClipSpec(
        color=color,
        shape=shape,
        direction=direction,
        background_rgb=(float(background[0]), float(background[1]), float(background[2])),
        size=size,
        start_yx=(start[0], start[1]),
        step_yx=(dy * step, dx * step),
    )


def _sample_instruct_spec(
    rng: np.random.Generator,
    frames: int,
    height: int,
    width: int,
    *,
    color: str | None = None,
    shape: str | None = None,
    direction: str | None = None,
) -> _ClipSpec:
    """The ``instruct`` task's clip: as :func:`_sample_spec`, but the shape starts in the middle of
    the frame, far enough from every edge to travel its distance in any direction, so its first
    frame (the position included) is the same whichever way it then moves. ``color`` / ``shape`` /
    ``direction`` replace the drawn ones (drawn anyway, so the rest of the clip stays the same)."""
    drawn = _pick(rng, COLORS), _pick(rng, SHAPES), _pick(rng, DIRECTIONS)
    color, shape, direction = color or drawn[0], shape or drawn[1], direction or drawn[2]
    background = rng.uniform(0.0, _BACKGROUND_MAX, size=3)
    size = max(1.0, float(rng.uniform(*_SIZE_RANGE)) * min(height, width))
    half_room = (min(height, width) - size) / 2
    travel = float(rng.uniform(*_TRAVEL_RANGE)) * half_room if frames > 1 else 0.0
    margin = _TRAVEL_RANGE[1] * half_room  # the longest travel any clip of this size has
    start = [
        float(rng.uniform(size / 2 + margin, max(extent - size / 2 - margin, size / 2 + margin)))
        for extent in (height, width)
    ]
    return _moving(color, shape, direction, background, size, start, travel, frames)


def _to_video(frames_THWC: np.ndarray) -> torch.Tensor:
    """Rendered frames -> float32 (3, T, H, W) in [-1, 1]."""
    return torch.from_numpy(frames_THWC).permute(3, 0, 1, 2).contiguous().mul_(2.0).sub_(1.0)


def instruct_clip(
    color: str, shape: str, direction: str, *, seed: int, frames: int, height: int, width: int
) -> VideoSample:
    """An ``instruct``-task clip of ``color`` ``shape`` moving ``direction``; everything else (size,
    background, start, distance) drawn from ``seed``, the same for every direction, so the four
    directions of one seed share their first frame."""
    for value, options in ((color, COLORS), (shape, SHAPES), (direction, DIRECTIONS)):
        if value not in options:
            raise ValueError(f"{value!r} is not one of {options}")
    spec = _sample_instruct_spec(
        np.random.default_rng([seed]), frames, height, width, color=color, shape=shape, direction=direction
    )
    return VideoSample(video=_to_video(_render(spec, frames, height, width)), caption=spec.caption("instruct"))


def _shape_mask(shape: str, dy_THW: np.ndarray, dx_THW: np.ndarray, size: float) -> np.ndarray:
    """Boolean mask of a shape of side/diameter ``size`` given offsets from its centre."""
    half = size / 2
    if shape == "circle":
        return dy_THW**2 + dx_THW**2 <= half**2
    if shape == "square":
        return (np.abs(dy_THW) <= half) & (np.abs(dx_THW) <= half)
    if shape == "triangle":  # apex up, base at the bottom, base width == height
        inside_rows = np.abs(dy_THW) <= half
        return inside_rows & (np.abs(dx_THW) <= (dy_THW + half) / 2)
    raise ValueError(f"unknown shape {shape!r}")


def _render(spec: _ClipSpec, frames: int, height: int, width: int) -> np.ndarray:
    """Render a clip as float32 RGB in [0, 1] with shape (T, H, W, 3)."""
    t_T = np.arange(frames, dtype=np.float32)
    cy_T11 = (spec.start_yx[0] + spec.step_yx[0] * t_T)[:, None, None]
    cx_T11 = (spec.start_yx[1] + spec.step_yx[1] * t_T)[:, None, None]
    y_1H1 = (np.arange(height, dtype=np.float32) + 0.5)[None, :, None]
    x_11W = (np.arange(width, dtype=np.float32) + 0.5)[None, None, :]
    mask_THW = _shape_mask(spec.shape, y_1H1 - cy_T11, x_11W - cx_T11, spec.size)
    fg_3 = np.asarray(COLOR_RGB[spec.color], dtype=np.float32)
    bg_3 = np.asarray(spec.background_rgb, dtype=np.float32)
    return np.where(mask_THW[..., None], fg_3, bg_3).astype(np.float32, copy=False)


class MovingShapesDataset(Dataset[VideoSample]):
    """Deterministic procedural text-to-video dataset of moving shapes.

    Sample ``i`` is a pure function of ``(seed, i)``: it is drawn from a numpy
    Generator seeded with ``[seed, i]``; global RNG state is never touched.

    Each item is ``{"video": float32 tensor (3, frames, height, width) in
    [-1, 1], "caption": "a <colour> <shape> moving <direction>"}`` (``task="instruct"``:
    "make it move <direction>", the shape starting mid-frame; see the module's docstring).
    """

    def __init__(
        self, *, num_samples: int, frames: int, height: int, width: int, seed: int = 0, task: str = "describe"
    ):
        """Validate sizes; ``seed`` must be a non-negative int; ``task`` one of :data:`TASKS`."""
        self.num_samples = _check_positive_int("num_samples", num_samples)
        self.frames = _check_positive_int("frames", frames)
        self.height = _check_positive_int("height", height)
        self.width = _check_positive_int("width", width)
        if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
            raise ValueError(f"seed must be a non-negative int, got {seed!r}")
        self.seed = seed
        if task not in TASKS:
            raise ValueError(f"task must be one of {TASKS}, got {task!r}")
        self.task = task

    def __len__(self) -> int:
        """Number of samples."""
        return self.num_samples

    def _index(self, i: int) -> int:
        """Normalise a possibly negative index; IndexError when out of range."""
        index = operator.index(i)
        if index < 0:
            index += self.num_samples
        if not 0 <= index < self.num_samples:
            raise IndexError(f"index {i} out of range for {self.num_samples} samples")
        return index

    def __getitem__(self, i: int) -> VideoSample:
        """Render sample ``i``."""
        rng = np.random.default_rng([self.seed, self._index(i)])
        sample = _sample_instruct_spec if self.task == "instruct" else _sample_spec
        spec = sample(rng, self.frames, self.height, self.width)
        return VideoSample(
            video=_to_video(_render(spec, self.frames, self.height, self.width)), caption=spec.caption(self.task)
        )
