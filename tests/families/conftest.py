"""Tiny Wan 2.2 pipelines (random weights, the real classes, saved with ``save_pretrained``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from mmpipe.config import ModelConfig
from mmpipe.models.wan import build_tiny_wan_pipeline

TEXTS = ["a red circle moving left", "blurry static"]


def save_tiny_wan22(path: Path, **wan22: Any) -> Path:
    """Wan 2.1's tiny pipeline with Wan 2.2's features: ``two_experts=True`` adds a second DiT
    (other weights) as ``transformer_2``; other keywords (``boundary_ratio``, ``expand_timesteps``)
    go to the pipeline's config."""
    pipe: Any = build_tiny_wan_pipeline(ModelConfig(), TEXTS, seed=0)
    if wan22.pop("two_experts", False):
        second: Any = build_tiny_wan_pipeline(ModelConfig(), TEXTS, seed=1).transformer
        pipe.register_modules(transformer_2=second)
    pipe.register_to_config(**wan22)
    pipe.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def wan22_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Two experts with boundary 0.6."""
    return save_tiny_wan22(tmp_path_factory.mktemp("wan22"), two_experts=True, boundary_ratio=0.6)
