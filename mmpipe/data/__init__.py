"""Datasets and video I/O for text-to-video training."""

from mmpipe.data.folder import FolderVideoDataset
from mmpipe.data.shapes import (
    COLOR_RGB,
    COLORS,
    DIRECTIONS,
    SHAPES,
    MovingShapesDataset,
    VideoSample,
    caption_vocabulary,
    instruct_clip,
    instruction,
)
from mmpipe.data.video_io import (
    count_frames,
    frames_to_uint8,
    read_video,
    video_to_uint8,
    write_gif,
    write_mp4,
    write_png,
)

__all__ = [
    "COLORS",
    "COLOR_RGB",
    "DIRECTIONS",
    "SHAPES",
    "FolderVideoDataset",
    "MovingShapesDataset",
    "VideoSample",
    "caption_vocabulary",
    "count_frames",
    "frames_to_uint8",
    "instruct_clip",
    "instruction",
    "read_video",
    "video_to_uint8",
    "write_gif",
    "write_mp4",
    "write_png",
]
