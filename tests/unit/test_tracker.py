"""Tests for mmpipe.data.tracker: reading colour, shape and direction off moving-shapes clips."""

from __future__ import annotations

import numpy as np
import pytest

from mmpipe.data.shapes import DIRECTIONS, MovingShapesDataset
from mmpipe.data.tracker import Verdict, _largest_component, track

_BACKGROUND = (0.12, 0.05, 0.15)


def _circle_clip(
    rgb: tuple[float, float, float], xs: list[float], *, y: float = 32.0, radius: float = 9.0
) -> np.ndarray:
    """Hand-drawn (T, 64, 64, 3) float clip: a filled circle centred at (y, xs[t])."""
    yy_HW, xx_HW = np.mgrid[0:64, 0:64] + 0.5
    frames_THWC = np.empty((len(xs), 64, 64, 3), dtype=np.float32)
    for t, x in enumerate(xs):
        inside_HW = (yy_HW - y) ** 2 + (xx_HW - x) ** 2 <= radius**2
        frames_THWC[t] = np.where(inside_HW[..., None], rgb, _BACKGROUND)
    return frames_THWC


def _square_clip(rgb: tuple[float, float, float], frames: int) -> np.ndarray:
    """Hand-drawn static clip: the same 18-pixel square in every frame."""
    frames_THWC = np.empty((frames, 64, 64, 3), dtype=np.float32)
    frames_THWC[:] = _BACKGROUND
    frames_THWC[:, 20:38, 25:43] = rgb
    return frames_THWC


def _labels(verdict: Verdict) -> tuple[str | None, str | None, str | None]:
    return verdict.color, verdict.shape, verdict.direction


@pytest.fixture(scope="module")
def shapes_clips() -> list[tuple[np.ndarray, tuple[str, str, str]]]:
    """The first 96 clips of the reference dataset as (T, H, W, 3) in [0, 1], with caption labels."""
    dataset = MovingShapesDataset(num_samples=96, frames=17, height=64, width=64, seed=123)
    clips = []
    for i in range(len(dataset)):
        sample = dataset[i]
        frames_THWC = ((sample["video"].permute(1, 2, 3, 0).numpy() + 1.0) / 2.0).astype(np.float32)
        _, color, shape, _, direction = sample["caption"].split()
        clips.append((frames_THWC, (color, shape, direction)))
    return clips


def _degrade(frames_THWC: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """Model a decoded generation: 3x3 box blur per frame, then Gaussian noise (sigma 0.05), clipped."""
    t, h, w, _ = frames_THWC.shape
    padded = np.pad(frames_THWC, ((0, 0), (1, 1), (1, 1), (0, 0)), mode="edge")
    blurred = sum(padded[:, i : i + h, j : j + w] for i in range(3) for j in range(3)) / 9.0
    return np.clip(blurred + rng.normal(0.0, 0.05, size=blurred.shape), 0.0, 1.0).astype(np.float32)


def _accuracy(verdicts: list[Verdict], truths: list[tuple[str, str, str]]) -> dict[str, float]:
    hits = {"color": 0, "shape": 0, "direction": 0}
    for verdict, truth in zip(verdicts, truths, strict=True):
        for key, ok in verdict.matches(*truth).items():
            hits[key] += ok
    return {key: n / len(truths) for key, n in hits.items()}


def test_hand_drawn_red_circle_moving_left() -> None:
    verdict = track(_circle_clip((0.9, 0.1, 0.1), list(np.linspace(46.0, 18.0, 17))))
    assert _labels(verdict) == ("red", "circle", "left")
    assert verdict.matches("red", "circle", "left") == {"color": True, "shape": True, "direction": True}
    assert str(verdict) == "red circle moving left"
    dy, dx = verdict.displacement
    assert dx == pytest.approx(-28.0, abs=1.0) and abs(dy) < 1.0
    assert verdict.fill_ratio == pytest.approx(np.pi / 4, abs=0.05)


def test_small_distractor_does_not_hijack_the_verdict() -> None:
    frames_THWC = _circle_clip((0.9, 0.1, 0.1), list(np.linspace(46.0, 18.0, 17)))
    frames_THWC[:, 4:9, 4:9] = 1.0  # a static white speck, found first in raster order
    assert _labels(track(frames_THWC)) == ("red", "circle", "left")


def test_components_do_not_wrap_around_rows() -> None:
    mask_HW = np.zeros((8, 8), dtype=bool)
    mask_HW[2, 5:] = True  # touches the right edge
    mask_HW[3, :4] = True  # touches the left edge one row below: not a neighbour
    assert sorted(_largest_component(mask_HW).tolist()) == [24, 25, 26, 27]


def test_static_clip_is_static() -> None:
    verdict = track(_square_clip((0.1, 0.8, 0.2), 17))
    assert verdict.direction == "static" and verdict.direction not in DIRECTIONS
    assert _labels(verdict) == ("green", "square", "static")


def test_wrong_colour_is_not_red() -> None:
    verdict = track(_circle_clip((0.2, 0.4, 1.0), list(np.linspace(46.0, 18.0, 17))))
    assert verdict.color != "red"
    assert verdict.matches("red", "circle", "left") == {"color": False, "shape": True, "direction": True}


def test_empty_clip_has_no_foreground() -> None:
    empty_THWC = np.broadcast_to(np.asarray(_BACKGROUND, dtype=np.float32), (17, 64, 64, 3))
    noisy_THWC = np.clip(empty_THWC + np.random.default_rng(0).normal(0.0, 0.05, empty_THWC.shape), 0.0, 1.0)
    for frames_THWC in (empty_THWC, noisy_THWC):
        verdict = track(frames_THWC)
        assert _labels(verdict) == (None, None, None)
        assert str(verdict) == "no foreground"


def test_single_frame_has_no_direction() -> None:
    verdict = track(_square_clip((1.0, 1.0, 1.0), 1))
    assert _labels(verdict) == ("white", "square", None)


def test_rejects_bad_shape() -> None:
    with pytest.raises(ValueError, match="T, H, W, 3"):
        track(np.zeros((17, 3, 64, 64), dtype=np.float32))


def test_clean_dataset_clips_all_exact(shapes_clips: list[tuple[np.ndarray, tuple[str, str, str]]]) -> None:
    wrong = []
    for i, (frames_THWC, truth) in enumerate(shapes_clips):
        verdict = track(frames_THWC)
        if _labels(verdict) != truth:
            wrong.append((i, truth, str(verdict), round(verdict.fill_ratio, 3), round(verdict.vertical_offset, 3)))
    assert wrong == []


def test_blurred_noisy_dataset_clips_mostly_right(shapes_clips: list[tuple[np.ndarray, tuple[str, str, str]]]) -> None:
    rng = np.random.default_rng(2024)
    verdicts = [track(_degrade(frames_THWC, rng)) for frames_THWC, _ in shapes_clips]
    accuracy = _accuracy(verdicts, [truth for _, truth in shapes_clips])
    assert min(accuracy.values()) >= 0.95, accuracy


def test_uint8_matches_float(shapes_clips: list[tuple[np.ndarray, tuple[str, str, str]]]) -> None:
    hand_drawn = _circle_clip((0.65, 0.2, 0.9), list(np.linspace(20.0, 44.0, 9)))
    for frames_THWC in [hand_drawn] + [clip for clip, _ in shapes_clips[:24]]:
        frames_uint8 = np.round(frames_THWC * 255.0).astype(np.uint8)
        assert _labels(track(frames_uint8)) == _labels(track(frames_THWC))
