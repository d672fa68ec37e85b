"""Tests for mmpipe.data: procedural shapes, folder dataset and video I/O."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

from mmpipe.data import (
    COLOR_RGB,
    COLORS,
    DIRECTIONS,
    SHAPES,
    FolderVideoDataset,
    MovingShapesDataset,
    caption_vocabulary,
    frames_to_uint8,
    instruct_clip,
    read_video,
    video_to_uint8,
    write_gif,
    write_mp4,
)

# ---------------------------------------------------------------- shapes


def _shapes(**overrides: int | str) -> MovingShapesDataset:
    kwargs: dict[str, int | str] = {"num_samples": 48, "frames": 9, "height": 48, "width": 64, "seed": 3}
    kwargs.update(overrides)
    return MovingShapesDataset(**kwargs)


def _foreground_THW(video_CTHW: torch.Tensor) -> torch.Tensor:
    """Shape pixels: backgrounds are dark (all channels <= 0.2), shapes are bright."""
    return video_CTHW.amax(dim=0) > 0.0


def _centroid_yx(mask_HW: torch.Tensor) -> tuple[float, float]:
    ys, xs = torch.nonzero(mask_HW, as_tuple=True)
    assert ys.numel() > 0, "no shape pixels found"
    return ys.float().mean().item(), xs.float().mean().item()


def test_shapes_item_shape_dtype_range() -> None:
    item = _shapes()[0]
    video = item["video"]
    assert isinstance(video, torch.Tensor)
    assert video.shape == (3, 9, 48, 64)
    assert video.dtype == torch.float32
    assert video.min() >= -1.0 and video.max() <= 1.0
    assert isinstance(item["caption"], str)


def test_shapes_deterministic_by_seed_and_index() -> None:
    a, b = _shapes(seed=7), _shapes(seed=7)
    assert torch.equal(a[5]["video"], b[5]["video"])
    assert a[5]["caption"] == b[5]["caption"]
    assert torch.equal(a[5]["video"], a[5]["video"])
    assert not torch.equal(a[5]["video"], a[6]["video"])
    assert not torch.equal(a[5]["video"], _shapes(seed=8)[5]["video"])


def test_shapes_ignores_global_rng() -> None:
    ds = _shapes()
    torch.manual_seed(0)
    np.random.seed(0)
    first = ds[2]["video"]
    torch.manual_seed(1)
    np.random.seed(1)
    assert torch.equal(first, ds[2]["video"])


def test_shapes_caption_matches_content() -> None:
    ds = _shapes()
    seen_directions, seen_shapes = set(), set()
    for i in range(len(ds)):
        item = ds[i]
        video, caption = item["video"], item["caption"]
        assert isinstance(video, torch.Tensor) and isinstance(caption, str)
        article, color, shape, moving, direction = caption.split(" ")
        assert (article, moving) == ("a", "moving")
        assert color in COLORS and shape in SHAPES and direction in DIRECTIONS
        seen_directions.add(direction)
        seen_shapes.add(shape)

        mask_THW = _foreground_THW(video)
        # Colour: every shape pixel has exactly the named colour.
        expected = torch.tensor(COLOR_RGB[color]) * 2 - 1
        pixels_N3 = video.permute(1, 2, 3, 0)[mask_THW]
        assert torch.allclose(pixels_N3, expected.expand_as(pixels_N3), atol=1e-5), caption

        # Shape: which corners of the first frame's bounding box are filled.
        ys, xs = torch.nonzero(mask_THW[0], as_tuple=True)
        top, bottom, left, right = ys.min(), ys.max(), xs.min(), xs.max()
        corners = [bool(mask_THW[0, y, x]) for y in (top, bottom) for x in (left, right)]
        expected_corners = {
            "square": [True, True, True, True],
            "circle": [False, False, False, False],
            "triangle": [False, False, True, True],  # apex up
        }
        assert corners == expected_corners[shape], (caption, corners)

        # Motion: the centroid moves noticeably in the named direction only.
        (y0, x0), (y1, x1) = _centroid_yx(mask_THW[0]), _centroid_yx(mask_THW[-1])
        dy, dx = y1 - y0, x1 - x0
        along, across = {"left": (-dx, dy), "right": (dx, dy), "up": (-dy, dx), "down": (dy, dx)}[direction]
        assert along >= 8.0, (caption, dy, dx)
        assert abs(across) <= 1.0, (caption, dy, dx)
        # The whole shape stays in frame: same pixel count in first and last frames (+-30%; sub-pixel sampling).
        n0, n1 = mask_THW[0].sum().item(), mask_THW[-1].sum().item()
        assert abs(n0 - n1) <= 0.3 * n0, (caption, n0, n1)
    assert seen_directions == set(DIRECTIONS)
    assert seen_shapes == set(SHAPES)


def test_caption_vocabulary_covers_captions() -> None:
    vocab = caption_vocabulary()
    assert vocab == sorted(set(vocab))
    ds = _shapes(num_samples=64, frames=2, height=16, width=16)
    words = {word for i in range(len(ds)) for word in str(ds[i]["caption"]).split()}
    assert words <= set(vocab)
    assert {"a", "moving", *COLORS, *SHAPES, *DIRECTIONS} == set(vocab)


def test_instruct_task_starts_mid_frame_whatever_the_direction() -> None:
    """The understand-then-generate task: the caption is only the instruction, the shape moves the
    way it says, and the first frame's position does not give the direction away (the describe
    task's clips start near the edge they move away from, and fail the band below)."""
    ds = _shapes(num_samples=96, task="instruct")  # 48 x 64 frames
    directions = set()
    for i in range(len(ds)):
        item = ds[i]
        make, it, move, direction = str(item["caption"]).split(" ")
        assert (make, it, move) == ("make", "it", "move") and direction in DIRECTIONS
        directions.add(direction)
        mask_THW = _foreground_THW(item["video"])
        (y0, x0), (y1, x1) = _centroid_yx(mask_THW[0]), _centroid_yx(mask_THW[-1])
        along = {"left": x0 - x1, "right": x1 - x0, "up": y0 - y1, "down": y1 - y0}[direction]
        assert along >= 6.0, (i, direction, y0, x0, y1, x1)
        # starts within 1.8 px (y) / 9.8 px (x) of the centre; a triangle's centroid sits below its centre
        assert abs(y0 - 24) <= 5.0 and abs(x0 - 32) <= 10.5, (i, direction, y0, x0)
    assert directions == set(DIRECTIONS)
    describe = _shapes(num_samples=96)
    outside = [i for i in range(96) if abs(_centroid_yx(_foreground_THW(describe[i]["video"])[0])[1] - 32) > 10.5]
    assert len(outside) > 20  # the band is a real constraint


def test_instruct_clip_shares_its_still_across_directions_and_tracks() -> None:
    """The eval's stills: one per colour and shape and seed, whatever the direction; and each of the
    96 grid clips scores as what it is (the eval's ground truth is trackable)."""
    from mmpipe.data.tracker import track

    size = {"frames": 17, "height": 64, "width": 64}
    for seed, (color, shape) in enumerate((c, s) for c in COLORS for s in SHAPES):
        clips = [instruct_clip(color, shape, d, seed=seed, **size) for d in DIRECTIONS]
        assert all(torch.equal(c["video"][:, 0], clips[0]["video"][:, 0]) for c in clips)
        assert not torch.equal(clips[0]["video"][:, -1], clips[1]["video"][:, -1])
        for direction, clip in zip(DIRECTIONS, clips, strict=True):
            assert clip["caption"] == f"make it move {direction}"
            frames = frames_to_uint8(clip["video"].permute(1, 2, 3, 0).add(1).div(2).numpy())
            verdict = track(frames)
            assert all(verdict.matches(color, shape, direction).values()), (color, shape, direction, verdict)
    with pytest.raises(ValueError, match="'orange'"):
        instruct_clip("orange", "circle", "left", seed=0, **size)
    with pytest.raises(ValueError, match="task must be one of"):
        _shapes(task="explain")  # type: ignore[arg-type]
    assert caption_vocabulary("instruct") == sorted({"make", "it", "move", *DIRECTIONS})


@pytest.mark.parametrize("name,value", [("num_samples", 0), ("frames", -1), ("height", 0), ("width", 2.5)])
def test_shapes_rejects_bad_sizes(name: str, value: object) -> None:
    kwargs: dict[str, object] = {"num_samples": 2, "frames": 2, "height": 8, "width": 8}
    kwargs[name] = value
    with pytest.raises(ValueError, match=name):
        MovingShapesDataset(**kwargs)  # type: ignore[arg-type]


def test_shapes_index_out_of_range() -> None:
    ds = _shapes(num_samples=3)
    assert torch.equal(ds[-1]["video"], ds[2]["video"])
    with pytest.raises(IndexError):
        ds[3]


# ---------------------------------------------------------------- video io


def _flat_frames(num_frames: int, height: int, width: int) -> np.ndarray:
    """Flat-colour frames, a different colour per frame."""
    frames = np.empty((num_frames, height, width, 3), dtype=np.uint8)
    for t in range(num_frames):
        frames[t] = (40 + 20 * t, 200 - 15 * t, 120)
    return frames


@pytest.mark.parametrize("height,width", [(32, 32), (33, 17)])
def test_mp4_roundtrip(tmp_path: Path, height: int, width: int) -> None:
    frames = _flat_frames(6, height, width)
    path = write_mp4(frames, tmp_path / "clip.mp4", fps=8)
    assert path == tmp_path / "clip.mp4"
    decoded = read_video(path)
    # Odd sizes are edge-padded up to even ones.
    assert decoded.shape == (6, height + height % 2, width + width % 2, 3)
    assert decoded.dtype == np.uint8
    diff = np.abs(decoded[:, :height, :width].astype(int) - frames.astype(int))
    assert diff.max() <= 6
    assert read_video(path, max_frames=4).shape[0] == 4


def test_gif_roundtrip(tmp_path: Path) -> None:
    frames = _flat_frames(5, 33, 17)
    path = write_gif(frames, tmp_path / "clip.gif", fps=8)
    decoded = read_video(path)
    assert decoded.shape == frames.shape
    assert np.abs(decoded.astype(int) - frames.astype(int)).max() <= 2


def test_writers_reject_bad_frames(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="uint8"):
        write_mp4(np.zeros((2, 8, 8, 3), np.float32), tmp_path / "a.mp4")
    with pytest.raises(ValueError, match="shape"):
        write_gif(np.zeros((2, 8, 8), np.uint8), tmp_path / "a.gif")


def test_uint8_conversions() -> None:
    video_CTHW = torch.tensor([-1.0, 0.0, 1.0, 2.0]).view(1, 4, 1, 1).expand(3, 4, 2, 5)
    frames = video_to_uint8(video_CTHW)
    assert frames.shape == (4, 2, 5, 3) and frames.dtype == np.uint8
    assert frames[:, 0, 0, 0].tolist() == [0, 128, 255, 255]
    floats = np.linspace(-0.5, 1.5, 4 * 2 * 5 * 3).reshape(4, 2, 5, 3)
    converted = frames_to_uint8(floats)
    assert converted.dtype == np.uint8
    assert converted.min() == 0 and converted.max() == 255
    with pytest.raises(ValueError, match="shape"):
        video_to_uint8(torch.zeros(4, 2, 2, 2))
    with pytest.raises(ValueError, match="floating"):
        frames_to_uint8(np.zeros((1, 2, 2, 3), np.uint8))


# ---------------------------------------------------------------- folder dataset


def _write_captions(root: Path, records: list[dict[str, str]]) -> None:
    lines = [json.dumps(record) for record in records]
    (root / "captions.jsonl").write_text("\n".join(lines) + "\n\n", encoding="utf-8")


def _bands(num_frames: int) -> np.ndarray:
    """32x96 frames: red | green | blue bands of widths 24 | 48 | 24, brightening over time."""
    frames = np.zeros((num_frames, 32, 96, 3), dtype=np.uint8)
    for t in range(num_frames):
        level = 150 + 10 * t
        frames[t, :, :24, 0] = level
        frames[t, :, 24:72, 1] = level
        frames[t, :, 72:, 2] = level
    return frames


def test_folder_dataset_shape_range_and_crop(tmp_path: Path) -> None:
    write_mp4(_bands(6), tmp_path / "vids" / "bands.mp4")
    _write_captions(tmp_path, [{"video": "vids/bands.mp4", "caption": "three bands"}])
    ds = FolderVideoDataset(root=tmp_path, frames=5, height=32, width=96)
    assert len(ds) == 1
    item = ds[0]
    video = item["video"]
    assert isinstance(video, torch.Tensor)
    assert item["caption"] == "three bands"
    assert video.shape == (3, 5, 32, 96) and video.dtype == torch.float32
    assert video.min() >= -1.0 and video.max() <= 1.0
    # Frames are in order: brightness increases over time.
    means_T = video[1, :, :, 40:56].mean(dim=(1, 2))
    assert bool((means_T[1:] > means_T[:-1]).all())

    # Scale by 1/2 to 16x48 (covering 16x16), then crop the centre: only green remains.
    small = FolderVideoDataset(root=tmp_path, frames=5, height=16, width=16)[0]["video"]
    assert isinstance(small, torch.Tensor)
    assert small.shape == (3, 5, 16, 16)
    for column in (0, 15):
        red, green, blue = small[:, 0, :, column].mean(dim=1).tolist()
        assert green > 0.0 and red < -0.6 and blue < -0.6, (column, red, green, blue)


def test_folder_dataset_skips_bad_videos_with_one_warning(tmp_path: Path) -> None:
    write_mp4(_flat_frames(9, 16, 16), tmp_path / "good.mp4")
    write_mp4(_flat_frames(4, 16, 16), tmp_path / "short.mp4")
    (tmp_path / "garbage.mp4").write_bytes(np.random.default_rng(0).bytes(2048))
    _write_captions(
        tmp_path,
        [
            {"video": "good.mp4", "caption": "good"},
            {"video": "short.mp4", "caption": "short"},
            {"video": "garbage.mp4", "caption": "garbage"},
        ],
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ds = FolderVideoDataset(root=tmp_path, frames=9, height=16, width=16)
    assert len(caught) == 1
    message = str(caught[0].message)
    assert "skipped 2 of 3 videos" in message
    assert "1 unreadable (garbage.mp4)" in message
    assert "1 too short (< 9 frames: short.mp4)" in message
    assert len(ds) == 1 and ds[0]["caption"] == "good"


def test_folder_dataset_no_usable_video(tmp_path: Path) -> None:
    write_mp4(_flat_frames(2, 16, 16), tmp_path / "short.mp4")
    _write_captions(tmp_path, [{"video": "short.mp4", "caption": "short"}])
    with pytest.warns(UserWarning, match="too short"):
        with pytest.raises(ValueError, match="no usable videos"):
            FolderVideoDataset(root=tmp_path, frames=9, height=16, width=16)


@pytest.mark.parametrize(
    "bad_line",
    ['{"video": "a.mp4", "caption": ', '{"video": "a.mp4"}', '{"video": 3, "caption": "x"}'],
)
def test_folder_dataset_malformed_line(tmp_path: Path, bad_line: str) -> None:
    good = json.dumps({"video": "a.mp4", "caption": "fine"})
    (tmp_path / "captions.jsonl").write_text(f"{good}\n\n{bad_line}\n", encoding="utf-8")
    with pytest.raises(ValueError, match=r"captions\.jsonl, line 3"):
        FolderVideoDataset(root=tmp_path, frames=2, height=8, width=8)


def test_folder_dataset_missing_paths(tmp_path: Path) -> None:
    missing = tmp_path / "nope"
    with pytest.raises(ValueError, match="nope"):
        FolderVideoDataset(root=missing, frames=2, height=8, width=8)
    with pytest.raises(ValueError, match="captions.jsonl"):
        FolderVideoDataset(root=tmp_path, frames=2, height=8, width=8)


def test_folder_dataset_file_changed_after_init(tmp_path: Path) -> None:
    write_mp4(_flat_frames(3, 16, 16), tmp_path / "a.mp4")
    _write_captions(tmp_path, [{"video": "a.mp4", "caption": "a"}])
    ds = FolderVideoDataset(root=tmp_path, frames=3, height=8, width=8)
    (tmp_path / "a.mp4").write_bytes(b"not a video")
    with pytest.raises(ValueError, match="a.mp4"):
        ds[0]
