"""Shared fixtures: tiny random-weight pipelines saved with ``save_pretrained`` (nothing downloaded)."""

from __future__ import annotations

from pathlib import Path

import pytest

from mmpipe.config import ModelConfig
from mmpipe.data import caption_vocabulary
from mmpipe.presets import save_tiny_wan_pipeline


@pytest.fixture(scope="session")
def tiny_wan_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny WanPipeline directory (UMT5 text encoder) in the standard diffusers layout."""
    path = tmp_path_factory.mktemp("tiny_wan")
    texts = [*caption_vocabulary(), "blurry static"]
    return save_tiny_wan_pipeline(ModelConfig(), texts, path, seed=0)
