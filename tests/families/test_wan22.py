"""Wan 2.2 through ``mmpipe.from_diffusers``: two experts (``transformer_2``, ``boundary_ratio``)
and TI2V's per-token timesteps (``expand_timesteps``), against ``WanPipeline.__call__``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from mmpipe.models.loading import from_diffusers
from mmpipe.models.pipeline_graph import PipelineGraph
from mmpipe.models.wan import T2VGraph
from tests.families.conftest import save_tiny_wan22
from tests.families.parity import assert_matches_pipeline

# odd frame count (9 -> 3 latent frames), non-square frames
CALL = dict(prompt="a red circle moving left", negative_prompt="blurry static", height=32, width=48, num_frames=9)


@pytest.mark.parametrize(
    "guidance", [dict(guidance_scale=4.0, guidance_scale_2=3.0), dict(guidance_scale=1.0)], ids=["cfg", "no-cfg"]
)
def test_two_experts_match_the_pipeline(wan22_dir: Path, guidance: dict[str, float]) -> None:
    graph = from_diffusers(wan22_dir)
    assert isinstance(graph, PipelineGraph)
    assert set(graph.denoise.module.keys()) == {"transformer", "transformer_2"}
    assert_matches_pipeline(wan22_dir, CALL | guidance | {"num_inference_steps": 4})


def test_both_experts_run_and_the_boundary_splits_the_steps(wan22_dir: Path) -> None:
    graph: Any = from_diffusers(wan22_dir)
    calls: dict[str, int] = {"transformer": 0, "transformer_2": 0}
    for name, module in graph.denoise.module.items():
        module.register_forward_hook(lambda *_, n=name: calls.__setitem__(n, calls[n] + 1))
    graph.generate(**CALL, num_inference_steps=5, guidance_scale=1.0, seed=0, progress=False)
    # UniPC's flow sigmas with shift 3: the high-noise expert takes the first steps only
    assert calls["transformer"] >= 1 and calls["transformer_2"] >= 1
    assert calls["transformer"] + calls["transformer_2"] == 5


def test_ti2v_expand_timesteps_matches_the_pipeline(tmp_path: Path) -> None:
    path = save_tiny_wan22(tmp_path / "ti2v", expand_timesteps=True)
    assert_matches_pipeline(path, CALL | {"num_inference_steps": 3, "guidance_scale": 5.0})


def test_wan21_stays_the_engine_graph_and_takes_call_arguments(tiny_wan_dir: Path) -> None:
    graph = from_diffusers(tiny_wan_dir)
    assert isinstance(graph, T2VGraph)
    # the pipeline's own keyword (issue 32's report): a per-call text length
    out = graph.generate(
        prompt="a red circle",
        max_sequence_length=16,
        height=32,
        width=32,
        num_frames=5,
        num_inference_steps=2,
        seed=0,
        progress=False,
    )
    assert out.shape == (1, 5, 32, 32, 3)


def test_unknown_and_unimplemented_arguments_are_named(wan22_dir: Path, tiny_wan_dir: Path) -> None:
    for graph in (from_diffusers(wan22_dir), from_diffusers(tiny_wan_dir)):
        with pytest.raises(TypeError, match="WanPipeline.__call__: .*'num_images_per_prompt'"):
            graph.generate(prompt="a red circle", num_images_per_prompt=2)
        with pytest.raises(ValueError, match="prompt_embeds=tensor.* is not supported by mmpipe's graph"):
            graph.generate(prompt_embeds=torch.zeros(1, 16, 32))
    graph = from_diffusers(wan22_dir)
    with pytest.raises(ValueError, match="divisible by 16"):
        graph.generate(prompt="a red circle", height=30, width=32, num_frames=5)


def test_a_generator_is_honoured_like_a_seed(wan22_dir: Path) -> None:
    graph: Any = from_diffusers(wan22_dir)
    kw = CALL | {"num_inference_steps": 2, "guidance_scale": 1.0, "progress": False}
    a = graph.generate(**kw, seed=3)
    b = graph.generate(**kw, generator=torch.Generator().manual_seed(3))
    c = graph.generate(**kw, seed=4)
    assert np.array_equal(a, b) and not np.array_equal(a, c)
