"""CogVideoX through ``mmpipe.from_diffusers`` against ``CogVideoXPipeline.__call__``: DDIM and the
DPM solver (its per-step noise from the call's generator), sin-cos and rotary positions, dynamic
guidance, and CogVideoX 1.5's padding latent frames."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from diffusers import DiffusionPipeline

from mmpipe.models.cogvideox import CogVideoXFamily, save_tiny_cogvideox_pipeline
from mmpipe.models.loading import from_diffusers
from mmpipe.models.pipeline_graph import PipelineGraph
from tests.families.parity import assert_matches_pipeline

# odd frame count (9 -> 3 latent frames), non-square frames
CALL = dict(
    prompt="a red circle moving left",
    negative_prompt="blurry static",
    height=16,
    width=32,
    num_frames=9,
    num_inference_steps=3,
)


@pytest.fixture(scope="module")
def cogvideox_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """One tiny pipeline a variant: 2b (DDIM, sin-cos), 5b (DPM, rotary), 1.5 (DPM, rotary, patch_size_t=2)."""
    root = tmp_path_factory.mktemp("cogvideox")
    return {v: save_tiny_cogvideox_pipeline(root / v, variant=v) for v in ("2b", "5b", "1.5")}


@pytest.mark.parametrize(
    ("variant", "guidance"),
    [
        ("2b", dict(guidance_scale=6.0)),
        ("2b", dict(guidance_scale=1.0)),
        ("5b", dict(guidance_scale=6.0, use_dynamic_cfg=True)),
        ("5b", dict(guidance_scale=1.0)),
        ("1.5", dict(guidance_scale=6.0)),
    ],
    ids=["2b-ddim-cfg", "2b-ddim-no-cfg", "5b-dpm-dynamic-cfg", "5b-dpm-no-cfg", "1.5-dpm-cfg"],
)
def test_matches_the_pipeline(cogvideox_dirs: dict[str, Path], variant: str, guidance: dict[str, Any]) -> None:
    # cfg: the pipeline batches both branches in one transformer call, the graph calls it per branch
    # (float32 CPU: ~1e-6 apart); without guidance they are bitwise equal
    graph: Any = from_diffusers(cogvideox_dirs[variant])
    assert isinstance(graph, PipelineGraph) and isinstance(graph.family, CogVideoXFamily)
    out = assert_matches_pipeline(cogvideox_dirs[variant], CALL | guidance)
    assert out.shape == (1, 9, 16, 32, 3)


def test_the_schedulers_are_the_checkpoints(cogvideox_dirs: dict[str, Path]) -> None:
    names = {v: DiffusionPipeline.load_config(p)["scheduler"][1] for v, p in cogvideox_dirs.items()}
    assert names == {"2b": "CogVideoXDDIMScheduler", "5b": "CogVideoXDPMScheduler", "1.5": "CogVideoXDPMScheduler"}


def test_cogvideox15_pads_latent_frames_and_the_decode_drops_them(cogvideox_dirs: dict[str, Path]) -> None:
    path = cogvideox_dirs["1.5"]
    pipe: Any = DiffusionPipeline.from_pretrained(path)
    pipe.set_progress_bar_config(disable=True)
    call = CALL | {"guidance_scale": 6.0, "output_type": "latent"}
    ref = pipe(**call, generator=torch.Generator().manual_seed(3)).frames
    out = from_diffusers(path).generate(**call, seed=3, progress=False)
    # 9 frames -> 3 latent frames, padded in front to 4 (patch_size_t=2), as the pipeline returns them
    assert out.shape == ref.shape == (1, 4, 4, 2, 4)
    assert float((out - ref).abs().max()) <= 1e-5


def test_defaults_come_from_the_transformer_and_one_video_a_prompt(cogvideox_dirs: dict[str, Path]) -> None:
    # no sizes: the transformer's sample sizes (16 x 32, 9 frames); num_videos_per_prompt is
    # overridden to 1 by CogVideoXPipeline.__call__, and by the graph
    call = {"prompt": "a red circle", "num_inference_steps": 2, "num_videos_per_prompt": 2}
    out = assert_matches_pipeline(cogvideox_dirs["2b"], call)
    assert out.shape == (1, 9, 16, 32, 3)


def test_a_generator_is_honoured_like_a_seed(cogvideox_dirs: dict[str, Path]) -> None:
    graph: Any = from_diffusers(cogvideox_dirs["5b"])
    kw = CALL | {"num_inference_steps": 2, "guidance_scale": 1.0, "progress": False}
    a = graph.generate(**kw, seed=3)
    b = graph.generate(**kw, generator=torch.Generator().manual_seed(3))
    c = graph.generate(**kw, seed=4)
    assert np.array_equal(a, b) and not np.array_equal(a, c)


def test_unknown_unimplemented_and_bad_arguments_are_named(cogvideox_dirs: dict[str, Path]) -> None:
    graph: Any = from_diffusers(cogvideox_dirs["2b"])
    with pytest.raises(TypeError, match="CogVideoXPipeline.__call__: .*'image'"):
        graph.generate(prompt="a red circle", image=None)
    with pytest.raises(ValueError, match="prompt_embeds=tensor.* is not supported by mmpipe's graph"):
        graph.generate(prompt_embeds=torch.zeros(1, 226, 32))
    with pytest.raises(ValueError, match="divisible by 8"):  # the pipeline's check_inputs
        graph.generate(prompt="a red circle", height=20, width=32)
