"""``mmpipe.from_diffusers``: a diffusers pipeline directory or object as the graph of its family.

Wan 2.1 text-to-video gives :class:`~mmpipe.models.wan.T2VGraph` (the graph training and serving
pipeline by stage); every other supported pipeline a
:class:`~mmpipe.models.pipeline_graph.PipelineGraph` through its family
(:data:`~mmpipe.models.pipeline_graph.FAMILY_MODULES`).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from diffusers import DiffusionPipeline

from mmpipe.errors import loading_errors
from mmpipe.graph import Graph
from mmpipe.models import wan
from mmpipe.models.pipeline_graph import PipelineGraph, check_family_dir, family_for


def from_diffusers(
    path_or_pipeline: str | Path | DiffusionPipeline,
    *,
    max_sequence_length: int | None = None,
    device: str | torch.device | None = None,
) -> Graph:
    """A diffusers pipeline (a local directory or an object) as an mmpipe inference graph.

    The family is recognised from ``model_index.json``'s ``_class_name`` (or the object's class);
    the graph's stages wrap the pipeline's own modules (no copy). Wan 2.1 text-to-video returns
    :class:`~mmpipe.models.wan.T2VGraph` (the graph training and serving pipeline by stage); every
    other family a :class:`PipelineGraph`. Prompts are padded to ``max_sequence_length`` (``None``:
    the pipeline's default) unless a ``generate`` call gives its own. With a
    ``device``, the modules are placed there (bf16 on CUDA but for the VAE, which stays float32).
    """
    if isinstance(path_or_pipeline, DiffusionPipeline):
        pipe: Any = path_or_pipeline
        family_for(pipe)
    else:
        root = check_family_dir(path_or_pipeline)
        meta = json.loads((root / "model_index.json").read_text())
        if wan.is_wan21_t2v(meta):
            return wan.from_diffusers(root, max_sequence_length=max_sequence_length or 512, device=device)
        dtypes = component_dtypes(meta, device) if device is not None else {}
        with loading_errors(f"{meta['_class_name']} from {str(root)!r}"):
            pipe = DiffusionPipeline.from_pretrained(root, **({"dtype": dtypes} if dtypes else {}))
    if wan.is_wan21_t2v(pipe.config) and type(pipe).__name__ == "WanPipeline":
        return wan.from_diffusers(pipe, max_sequence_length=max_sequence_length or 512, device=device)
    defaults = {"max_sequence_length": max_sequence_length} if max_sequence_length is not None else {}
    graph = PipelineGraph(family_for(pipe)(pipe), defaults)
    if device is not None:
        pipe.to(device)
    return graph


def component_dtypes(meta: Mapping[str, Any], device: str | torch.device | None) -> dict[str, torch.dtype]:
    """Load dtypes on ``device``: on CUDA bf16 for every component but the VAE (float32, as the
    video model cards load it); on CPU none (float32 as saved)."""
    if device is None or torch.device(device).type != "cuda":
        return {}
    return {"default": torch.bfloat16, "vae": torch.float32}
