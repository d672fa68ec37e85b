"""What every family's parity test checks: ``from_diffusers(dir).generate(**call, seed=s)`` against
``pipe(**call, generator=torch.Generator().manual_seed(s))`` on the same saved directory."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch
from diffusers import DiffusionPipeline

from mmpipe.models.loading import from_diffusers

TOLERANCE = 1e-5  # issue 32: the graph returns the pipeline's array within 1e-5


def assert_matches_pipeline(path: Path, call: dict[str, Any], *, seed: int = 7, attr: str = "frames") -> np.ndarray:
    """Run the pipeline and the graph on ``path`` with ``call``; assert they agree; return the graph's output."""
    pipe: Any = DiffusionPipeline.from_pretrained(path)
    pipe.set_progress_bar_config(disable=True)
    ref = getattr(pipe(**call, generator=torch.Generator().manual_seed(seed), output_type="np"), attr)
    graph: Any = from_diffusers(path)
    out = graph.generate(**call, seed=seed, output_type="np", progress=False)
    assert out.shape == ref.shape, (out.shape, ref.shape)
    err = float(np.abs(out - ref).max())
    assert err <= TOLERANCE, f"max |graph - pipeline| = {err}"
    assert out.std() > 0.01  # not a constant output that would match trivially
    return out
