"""LTX-Video through ``mmpipe.from_diffusers`` against ``LTXPipeline.__call__`` on a tiny random
pipeline: packed latents, guidance with ``guidance_rescale``, the timestep-conditioned decode."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from diffusers import DiffusionPipeline

from mmpipe.models.loading import from_diffusers
from mmpipe.models.ltx import LTXFamily, save_tiny_ltx_pipeline
from mmpipe.models.pipeline_graph import PipelineGraph
from tests.families.parity import assert_matches_pipeline

# odd frame count (9 -> 3 latent frames); 32 x 64, the smallest non-square size (multiples of 32)
CALL = dict(
    prompt="a red circle moving left",
    negative_prompt="blurry static",
    height=32,
    width=64,
    num_frames=9,
    num_inference_steps=3,
    max_sequence_length=16,
)
# the decode's noise and timestep (LTX-Video 0.9.1's recommended values)
DECODE = dict(decode_timestep=0.05, decode_noise_scale=0.025)


@pytest.fixture(scope="module")
def ltx_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A VAE with timestep conditioning (LTX-Video 0.9.1 and later)."""
    return save_tiny_ltx_pipeline(tmp_path_factory.mktemp("ltx"), seed=0)


@pytest.mark.parametrize(
    "more",
    [
        DECODE | {"guidance_scale": 3.0},
        DECODE | {"guidance_scale": 3.0, "guidance_rescale": 0.7},
        {"guidance_scale": 1.0},  # the default decode: timestep 0, no noise
    ],
    ids=["cfg", "cfg-rescale", "no-cfg"],
)
def test_matches_the_pipeline(ltx_dir: Path, more: dict[str, float]) -> None:
    graph = from_diffusers(ltx_dir)
    assert isinstance(graph, PipelineGraph) and isinstance(graph.family, LTXFamily)
    out = assert_matches_pipeline(ltx_dir, CALL | more)
    assert out.shape == (1, 9, 32, 64, 3)


def test_the_decode_noise_is_the_call_generators_next_draw(ltx_dir: Path) -> None:
    graph: Any = from_diffusers(ltx_dir)
    kw = CALL | DECODE | {"num_inference_steps": 1, "guidance_scale": 1.0, "output_type": "np"}
    ours, theirs = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
    a = graph.generate(**kw, generator=ours, progress=False)
    pipe: Any = DiffusionPipeline.from_pretrained(ltx_dir)
    pipe.set_progress_bar_config(disable=True)
    pipe(**kw, generator=theirs)
    assert torch.equal(ours.get_state(), theirs.get_state())  # as many draws as the pipeline's
    assert np.array_equal(a, graph.generate(**kw, seed=3, progress=False))
    quiet = graph.generate(**(kw | {"decode_noise_scale": 0.0}), seed=3, progress=False)  # same latents
    assert np.abs(a - quiet).max() > 1e-4


def test_a_vae_without_timestep_conditioning_matches_the_pipeline(tmp_path: Path) -> None:
    path = save_tiny_ltx_pipeline(tmp_path / "ltx090", seed=1, timestep_conditioning=False)
    assert_matches_pipeline(path, CALL | DECODE | {"guidance_scale": 3.0, "num_inference_steps": 2})


def test_arguments_the_pipeline_does_not_take_are_named(ltx_dir: Path) -> None:
    graph = from_diffusers(ltx_dir)
    with pytest.raises(TypeError, match="LTXPipeline.__call__: .*'true_cfg_scale'"):
        graph.generate(prompt="a red circle", true_cfg_scale=4.0)
    with pytest.raises(ValueError, match="latents=tensor.* is not supported by mmpipe's graph"):
        graph.generate(prompt="a red circle", latents=torch.zeros(1, 8))
    with pytest.raises(ValueError, match="divisible by 32"):
        graph.generate(prompt="a red circle", height=48, width=64, num_frames=9)
