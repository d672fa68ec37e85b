"""Deterministic tracker that reads colour, shape and direction off a moving-shapes clip.

Used to score generated videos of :mod:`mmpipe.data.shapes`. Per frame:

1. background = per-channel median of the border pixels (the shape covers far less
   than half of the border, so the median is the plain background colour);
2. foreground = pixels whose max-channel distance from the background exceeds a
   threshold, then only the largest 4-connected component is kept (drops noise
   specks and stray blobs). The threshold is picked in two passes: a low fixed one
   finds the shape, then it is raised to half the shape's contrast so a blurred
   edge is cut at its midpoint (the true edge) whatever the contrast;
3. frames whose component covers under 1 % of the image are ignored.

Segmentation runs on a 3x3 box-blurred copy of the frame (cuts noise by 3x; a
straight edge keeps its midpoint). Over the usable frames:

- colour: nearest :data:`COLOR_RGB` entry, by Euclidean distance in RGB, to the
  median RGB of the unblurred foreground pixels of above-median contrast (the
  core: blurred rims would pull a small shape's colour towards the background);
- shape: an apex-up triangle has its centroid well below its bounding-box centre
  (1/6 of the box height, ideally); otherwise circle or square by the nearest
  reference fill ratio (area / bounding-box area: pi/4 vs 1, as measured here);
- direction: dominant axis and sign of the least-squares centroid displacement,
  or "static" when it is under 1/10 of min(H, W).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import numpy as np

from mmpipe.data.shapes import COLOR_RGB, DIRECTIONS

__all__ = ["Verdict", "track"]

# Every background channel is in [0, 0.2] and every palette colour has a channel
# >= 0.9, so on clean renders the max-channel contrast is >= 0.7. 0.15 is 3 sigma of
# per-pixel noise of sigma 0.05 (9 sigma after the 3x3 blur) yet far below any real
# contrast; it only locates the shape, the final cut is at half the measured contrast.
_MIN_THRESHOLD = 0.15
_CONTRAST_SPLIT = 0.5
_MIN_AREA_FRACTION = 0.01  # shapes cover >= ~1.6 % of the image; smaller is not a shape
_STATIC_FRACTION = 0.1  # travel is >= ~1/3 of min(H, W); below 1/10 of it is "static"
# (centroid row - bbox centre row) / bbox height. Apex-up triangle: ideal 1/6, measured
# 0.10..0.15 at 64x64 (the blur rounds the apex) and >= 0.06 even at 32x32; circles
# and squares stay within +-0.04, so 0.05 splits them.
_TRIANGLE_OFFSET = 0.05
# Mean area / bbox area after the blur (ideal pi/4 and 1; the blur cuts the square's
# corner pixels), measured on MovingShapesDataset clips at 64x64 and 128x128.
_FILL_REFERENCE: dict[str, float] = {"circle": 0.79, "square": 0.99}


@dataclass(frozen=True)
class Verdict:
    """What the tracker read off a clip, plus the diagnostics it was read from."""

    color: str | None
    shape: str | None
    direction: str | None  # one of DIRECTIONS, "static", or None (no motion measurable)
    foreground_fraction: float  # mean over all frames of the kept component's area / image area
    fill_ratio: float  # mean over usable frames of area / bounding-box area
    displacement: tuple[float, float]  # (dy, dx) in pixels, first to last usable frame, least squares
    rgb: tuple[float, float, float]  # median foreground colour in [0, 1]
    vertical_offset: float  # mean (centroid row - bbox centre row) / bbox height; ~0.13 for triangles

    def matches(self, color: str, shape: str, direction: str) -> dict[str, bool]:
        """Per-attribute agreement with a caption's colour, shape and direction."""
        return {"color": self.color == color, "shape": self.shape == shape, "direction": self.direction == direction}

    def __str__(self) -> str:
        if self.color is None:
            return "no foreground"
        motion = f"moving {self.direction}" if self.direction in DIRECTIONS else (self.direction or "motion unknown")
        return f"{self.color} {self.shape} {motion}"


def _largest_component(mask_HW: np.ndarray) -> np.ndarray:
    """Flat indices of the largest 4-connected component (ties: lowest raster index)."""
    h, w = mask_HW.shape
    seeds = np.flatnonzero(mask_HW).tolist()
    remaining = set(seeds)
    best: list[int] = []
    for seed in seeds:
        if seed not in remaining:
            continue
        remaining.discard(seed)
        component, queue = [seed], deque([seed])
        while queue:
            p = queue.popleft()
            y, x = divmod(p, w)
            for q, ok in ((p - w, y > 0), (p + w, y < h - 1), (p - 1, x > 0), (p + 1, x < w - 1)):
                if ok and q in remaining:
                    remaining.discard(q)
                    component.append(q)
                    queue.append(q)
        if len(component) > len(best):
            best = component
    return np.asarray(best, dtype=np.int64)


def _box3(frame_HWC: np.ndarray) -> np.ndarray:
    """3x3 box blur with edge padding."""
    h, w, _ = frame_HWC.shape
    padded = np.pad(frame_HWC, ((1, 1), (1, 1), (0, 0)), mode="edge")
    return sum((padded[i : i + h, j : j + w] for i in range(3) for j in range(3)), np.zeros_like(frame_HWC)) / 9.0


def _foreground(frame_HWC: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Flat indices of the shape's pixels in one [0, 1] frame, and of its high-contrast core."""
    frame_HWC = _box3(frame_HWC)
    border_NC = np.concatenate([frame_HWC[0], frame_HWC[-1], frame_HWC[1:-1, 0], frame_HWC[1:-1, -1]])
    dist_HW = np.abs(frame_HWC - np.median(border_NC, axis=0)).max(axis=-1)
    found_N = _largest_component(dist_HW > _MIN_THRESHOLD)
    if found_N.size == 0:
        return found_N, found_N
    # Half the median contrast is <= the max, so the second pass is never empty.
    threshold = max(_MIN_THRESHOLD, _CONTRAST_SPLIT * float(np.median(dist_HW.flat[found_N])))
    shape_N = _largest_component(dist_HW > threshold)
    contrast_N = dist_HW.flat[shape_N]
    return shape_N, shape_N[contrast_N >= np.median(contrast_N)]


def track(frames_THWC: np.ndarray) -> Verdict:
    """Read colour, shape and direction off a (T, H, W, 3) clip, uint8 or float in [0, 1]."""
    frames_THWC = np.asarray(frames_THWC)
    if frames_THWC.ndim != 4 or frames_THWC.shape[-1] != 3:
        raise ValueError(f"expected (T, H, W, 3) frames, got shape {frames_THWC.shape}")
    if frames_THWC.dtype == np.uint8:
        frames_THWC = frames_THWC.astype(np.float32) / np.float32(255.0)
    frames_THWC = np.clip(frames_THWC, 0.0, 1.0, dtype=np.float32)
    t_total, h, w, _ = frames_THWC.shape
    areas: list[int] = []
    fills: list[float] = []
    offsets: list[float] = []
    times: list[float] = []
    centres: list[tuple[float, float]] = []
    pixels: list[np.ndarray] = []
    for t in range(t_total):
        flat_N, core_N = _foreground(frames_THWC[t])
        areas.append(flat_N.size)
        if flat_N.size < _MIN_AREA_FRACTION * h * w:
            continue
        ys_N, xs_N = np.divmod(flat_N, w)
        rows, cols = int(ys_N.max() - ys_N.min()) + 1, int(xs_N.max() - xs_N.min()) + 1
        fills.append(flat_N.size / (rows * cols))
        offsets.append((float(ys_N.mean()) - (int(ys_N.min()) + int(ys_N.max())) / 2) / rows)
        times.append(float(t))
        centres.append((float(ys_N.mean()) + 0.5, float(xs_N.mean()) + 0.5))
        pixels.append(frames_THWC[t].reshape(-1, 3)[core_N])
    foreground_fraction = float(np.mean(areas)) / (h * w) if areas else 0.0
    if not times:
        return Verdict(None, None, None, foreground_fraction, 0.0, (0.0, 0.0), (0.0, 0.0, 0.0), 0.0)
    rgb_3 = np.median(np.concatenate(pixels), axis=0)
    color = min(COLOR_RGB, key=lambda name: float(np.linalg.norm(rgb_3 - np.asarray(COLOR_RGB[name]))))
    fill_ratio, offset = float(np.mean(fills)), float(np.mean(offsets))
    shape = min(_FILL_REFERENCE, key=lambda name: abs(_FILL_REFERENCE[name] - fill_ratio))
    if offset > _TRIANGLE_OFFSET:
        shape = "triangle"
    direction: str | None = None  # one usable frame: motion cannot be measured
    dy = dx = 0.0
    if len(times) >= 2:
        t_N = np.asarray(times) - np.mean(times)
        yx_N2 = np.asarray(centres)
        slope_2 = t_N @ (yx_N2 - yx_N2.mean(axis=0)) / float(t_N @ t_N)
        span = times[-1] - times[0]
        dy, dx = float(slope_2[0]) * span, float(slope_2[1]) * span
        if max(abs(dy), abs(dx)) < _STATIC_FRACTION * min(h, w):
            direction = "static"
        elif abs(dy) > abs(dx):
            direction = "up" if dy < 0 else "down"
        else:
            direction = "left" if dx < 0 else "right"
    rgb = (float(rgb_3[0]), float(rgb_3[1]), float(rgb_3[2]))
    return Verdict(color, shape, direction, foreground_fraction, fill_ratio, (dy, dx), rgb, offset)
