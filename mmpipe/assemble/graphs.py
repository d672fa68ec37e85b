"""Config -> the training graph a run or a plan is made of, and its per-sample input shapes.

A full-size preset is an architecture-only graph (:mod:`mmpipe.models.arch`); a tiny preset is
built for real (random weights in a temporary directory), so plans of it are the plans
``mmpipe train`` runs.
"""

from __future__ import annotations

import contextlib
import tempfile
from collections.abc import Iterator
from pathlib import Path

import torch

from mmpipe.config import DataConfig, ModelConfig, RunConfig
from mmpipe.data import caption_vocabulary
from mmpipe.data.datasets import build_datasets, shapes_task, vocabulary
from mmpipe.graph import Graph
from mmpipe.models import build_training_graph, save_tiny_pipeline
from mmpipe.models.arch import build_arch_graph
from mmpipe.rundir import pipeline_dir

ShapeDtype = tuple[tuple[int, ...], torch.dtype]


_TEMP_DIRS: list[tempfile.TemporaryDirectory[str]] = []


def planning_graph(model: ModelConfig, data: DataConfig) -> tuple[Graph, dict[str, ShapeDtype]]:
    """The training graph of ``model`` (an image family's: one request's, :mod:`mmpipe.models.arch`)
    and its per-sample (batch 1) graph-input shapes."""
    if model.arch is not None:
        graph = build_arch_graph(model)
    else:
        graph = _tiny_graph(model, data)
    video = model.video or data
    return graph, sample_inputs(graph, model.text_len, video.frames, video.height, video.width)


def sample_inputs(graph: Graph, text_len: int, frames: int, height: int, width: int) -> dict[str, ShapeDtype]:
    """Shapes of one sample of every required graph input."""
    shapes: dict[str, ShapeDtype] = {}
    for name, spec in graph.input_specs.items():
        if not spec.required:
            continue
        fixed = spec.shape is not None and all(isinstance(d, int) for d in spec.shape[1:])
        if name in ("input_ids", "attention_mask"):  # the spec's length where it fixes one (a prompt template's)
            length = spec.shape[-1] if spec.shape is not None and isinstance(spec.shape[-1], int) else text_len
            shapes[name] = ((1, length), torch.int64)
        elif name == "video":
            shapes[name] = ((1, 3, frames, height, width), torch.float32)
        elif name == "image":  # an image family's (model.kind=t2i: model.video has one frame)
            shapes[name] = ((1, 3, height, width), torch.float32)
        elif name == "pixel_values":
            size = spec.shape[-1] if spec.shape else None
            if not isinstance(size, int):
                raise ValueError(f"graph input {name!r} needs a fixed image size, got {spec.shape}")
            shapes[name] = ((1, 3, size, size), torch.float32)
        elif fixed and spec.shape is not None and spec.dtype is not None:  # e.g. CLIP's clip_input_ids
            shapes[name] = ((1, *(int(d) for d in spec.shape[1:])), spec.dtype)
        else:
            raise ValueError(f"graph input {name!r} has no per-sample shape rule")
    return shapes


def _tiny_graph(model: ModelConfig, data: DataConfig) -> Graph:
    """The tiny preset's training graph, built for real (random weights) in a temporary directory."""
    if model.path is not None:
        return build_training_graph(model, Path(model.path))
    tmp_dir = tempfile.TemporaryDirectory(prefix="mmpipe-plan-")
    _TEMP_DIRS.append(tmp_dir)  # the stages load lazily from it; removed when the process exits
    tmp = Path(tmp_dir.name)
    save_tiny_pipeline(model, caption_vocabulary(shapes_task(model.kind)), tmp / "pipeline", seed=0)
    return build_training_graph(model, tmp / "pipeline")


@contextlib.contextmanager
def staged_pipeline(cfg: RunConfig, run_dir: Path) -> Iterator[Path]:
    """The pipeline directory to check the config against: ``model.path``, the run's own (resumed),
    or the tiny preset saved into a temporary folder that is removed unless it was moved."""
    existing = pipeline_dir(cfg.model, run_dir)
    if cfg.model.path is not None or (existing / "model_index.json").is_file():
        yield existing
        return
    train_set, _ = build_datasets(cfg.data, cfg.model.kind)
    with tempfile.TemporaryDirectory(prefix="mmpipe-pipeline-") as tmp:
        yield save_tiny_pipeline(cfg.model, vocabulary(train_set), Path(tmp) / "pipeline", seed=cfg.train.seed)
