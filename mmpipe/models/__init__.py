"""Model-family glue, one module a family: tiny random-weight writers, architecture-only graphs and
``from_diffusers`` adapters.

- :mod:`~mmpipe.models.wan`: Wan 2.1 text-to-video (``model.kind=t2v``): ``from_diffusers``, the
  inference and training graphs, the tiny and full-size random-weight pipelines;
- :mod:`~mmpipe.models.ltx`, :mod:`~mmpipe.models.hunyuan`, :mod:`~mmpipe.models.cogvideox`,
  :mod:`~mmpipe.models.wan_i2v`: LTX-Video, HunyuanVideo, CogVideoX and Wan 2.1 image-to-video; with
  ``model.path`` a directory of theirs, ``model.kind=t2v`` trains them (the training graph is chosen
  by ``model_index.json``'s ``_class_name``, :data:`TRAINING_PIPELINES`);
- :mod:`~mmpipe.models.u2g`: understand-then-generate (``model.kind=u2g``);
- :mod:`~mmpipe.models.arch`: architecture-only graphs of full-size presets (Wan T2V / I2V,
  HunyuanVideo, LTX-Video, CogVideoX, u2g; FLUX.1 and Qwen-Image requests, ``model.kind=t2i``).

A new family is a new module here plus an entry in :data:`FAMILIES`.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple

from mmpipe.config import ModelConfig
from mmpipe.graph import Graph
from mmpipe.models.cogvideox import build_cogvideox_training_graph
from mmpipe.models.hunyuan import build_hunyuan_training_graph
from mmpipe.models.ltx import build_ltx_training_graph
from mmpipe.models.pipeline_graph import read_model_index
from mmpipe.models.u2g import U2G_TRAIN_STAGES, build_u2g_training_graph, save_tiny_u2g_pipeline
from mmpipe.models.wan import (
    WAN_COMPONENTS,
    build_t2v_training_graph,
    check_pipeline_dir,
    save_tiny_wan_pipeline,
    t2v_training_stages,
)


class TrainingPipeline(NamedTuple):
    """A diffusers pipeline class ``mmpipe train model.path=DIR`` trains: its graph and components."""

    training_graph: Callable[..., Graph]  # (pipeline_dir, *, text_len) -> Graph
    components: tuple[str, ...]  # what the graph reads from the directory
    # the graph's stage names for a directory (None: Wan's, t2v_training_stages)
    stages: Callable[[Path], tuple[str, ...]] | None = None
    # refuses the layouts of the class the graph does not cover: (root, model_index, where) -> None
    check: Callable[[Path, Mapping[str, Any], str], None] | None = None


def _build_wan_i2v_training_graph(pipeline_dir: str | Path, *, text_len: int) -> Graph:
    # Imported here, as the check below: diffusers' WanImageToVideoPipeline module logs a warning at
    # import without torchvision, and importing mmpipe.models (every CLI start) must print nothing.
    from mmpipe.models.wan_i2v import build_wan_i2v_training_graph

    return build_wan_i2v_training_graph(pipeline_dir, text_len=text_len)


def _check_wan_i2v_training_dir(root: Path, meta: Mapping[str, Any], where: str) -> None:
    from mmpipe.models.wan_i2v import check_i2v_training_dir  # imported here: see above

    check_i2v_training_dir(root, meta, where)


def _wan_i2v_training_stages(root: Path) -> tuple[str, ...]:
    from mmpipe.models.wan_i2v import wan_i2v_training_stages  # imported here: see above

    return wan_i2v_training_stages(root)


#: The pipeline classes a ``model.kind=t2v`` run trains from ``model.path``, by ``_class_name``.
TRAINING_PIPELINES = {
    "WanPipeline": TrainingPipeline(build_t2v_training_graph, WAN_COMPONENTS),
    "LTXPipeline": TrainingPipeline(build_ltx_training_graph, WAN_COMPONENTS),
    "HunyuanVideoPipeline": TrainingPipeline(
        build_hunyuan_training_graph, (*WAN_COMPONENTS, "text_encoder_2", "tokenizer_2")
    ),
    "CogVideoXPipeline": TrainingPipeline(build_cogvideox_training_graph, WAN_COMPONENTS),
    "WanImageToVideoPipeline": TrainingPipeline(
        _build_wan_i2v_training_graph,
        WAN_COMPONENTS,  # and the image_encoder and image_processor of a transformer with an image_dim (the check)
        _wan_i2v_training_stages,
        _check_wan_i2v_training_dir,
    ),
}


def check_training_pipeline_dir(path: str | Path, *, key: str = "model.path") -> Path:
    """``path`` as a pipeline directory training supports (:data:`TRAINING_PIPELINES`), checked
    without loading weights; a ``ValueError`` naming ``key`` and the supported classes (or the
    layout of a supported class training does not cover) otherwise."""
    root = Path(path)
    where = f"{key}={str(root)!r}"
    meta = read_model_index(root, where)
    entry = TRAINING_PIPELINES.get(str(meta.get("_class_name")))
    if entry is not None and entry.check is not None:
        entry.check(root, meta, where)
    return check_pipeline_dir(root, key=key, supported={name: p.components for name, p in TRAINING_PIPELINES.items()})


def pipeline_training_stages(model: ModelConfig) -> tuple[str, ...]:
    """The stage names of a ``model.kind=t2v`` training graph: those of ``model.path``'s pipeline
    class where it names them (:data:`TRAINING_PIPELINES`), Wan's otherwise."""
    index = Path(model.path) / "model_index.json" if model.path is not None else None
    name = json.loads(index.read_text()).get("_class_name") if index is not None and index.is_file() else None
    entry = TRAINING_PIPELINES.get(str(name))
    if entry is None or entry.stages is None or index is None:
        return t2v_training_stages(model)
    return entry.stages(index.parent)


def build_pipeline_training_graph(pipeline_dir: str | Path, *, text_len: int) -> Graph:
    """The training graph of a text-to-video pipeline directory, by its ``model_index.json``'s
    ``_class_name`` (Wan's, :func:`~mmpipe.models.wan.build_t2v_training_graph`, when it names none)."""
    index = Path(pipeline_dir) / "model_index.json"
    name = json.loads(index.read_text()).get("_class_name") if index.is_file() else None
    builder = TRAINING_PIPELINES[name].training_graph if name in TRAINING_PIPELINES else build_t2v_training_graph
    return builder(pipeline_dir, text_len=text_len)


class Family(NamedTuple):
    """What the engine needs of a model family's training side (``model.kind``)."""

    train_stages: Callable[[ModelConfig], tuple[str, ...]]
    training_graph: Callable[..., Graph]  # (pipeline_dir, *, text_len) -> Graph
    save_tiny: Callable[..., Path]  # (spec, texts, path, *, seed) -> Path


FAMILIES = {
    "t2v": Family(pipeline_training_stages, build_pipeline_training_graph, save_tiny_wan_pipeline),
    "u2g": Family(lambda _: U2G_TRAIN_STAGES, build_u2g_training_graph, save_tiny_u2g_pipeline),
}


def family(model: ModelConfig) -> Family:
    """The family of ``model.kind``."""
    if model.kind not in FAMILIES:
        raise ValueError(f"model.kind={model.kind!r}: choose from {sorted(FAMILIES)}")
    return FAMILIES[model.kind]


def training_stages(model: ModelConfig) -> tuple[str, ...]:
    """The stage names of the model's training graph (placements must name exactly these)."""
    return family(model).train_stages(model)


def build_training_graph(model: ModelConfig, pipe_dir: Path) -> Graph:
    """The training graph of ``model.kind`` over a pipeline directory."""
    return family(model).training_graph(pipe_dir, text_len=model.text_len)


def save_tiny_pipeline(model: ModelConfig, texts: Sequence[str], path: Path, *, seed: int) -> Path:
    """The tiny random-weight pipeline of ``model.kind``, saved to ``path`` (whose words ``texts`` hold)."""
    return family(model).save_tiny(model, texts, path, seed=seed)
