"""Shared fixtures: tiny random-weight pipelines saved with ``save_pretrained`` (nothing downloaded)."""

from __future__ import annotations

import os
from pathlib import Path

# The kernel tests run Triton's interpreter on CPU tensors on every machine: `import mmpipe` turns it
# on only where there is no GPU, and on a GPU machine those tests would otherwise refuse their CPU
# tensors. Set before the first `import triton`; an explicit TRITON_INTERPRET (gpu_checks.sh: 0) wins.
os.environ.setdefault("TRITON_INTERPRET", "1")
# Kernel outputs start NaN-filled in every test, compiled ones too (off in users' runs, where the
# fill would cost a full write of each output): an element a kernel fails to write fails the test.
os.environ.setdefault("MMPIPE_KERNEL_POISON", "1")

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
