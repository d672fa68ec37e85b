"""FLUX.1 through ``mmpipe.from_diffusers``: true classifier-free guidance, the guidance embedding of
guidance-distilled transformers and the sigma shift, against ``FluxPipeline.__call__``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from mmpipe.models.flux import FluxFamily, build_tiny_flux_pipeline, save_tiny_flux_pipeline
from mmpipe.models.loading import from_diffusers
from mmpipe.models.pipeline_graph import PipelineGraph
from tests.families.parity import assert_matches_pipeline

# non-square (the tiny VAE downsamples by 2: multiples of 4 pixels), a short T5 padding
CALL = dict(prompt="a red circle moving left", height=32, width=48, num_inference_steps=2, max_sequence_length=16)
NEGATIVE = dict(negative_prompt="blurry static", true_cfg_scale=4.0)


@pytest.fixture(scope="module")
def flux_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_flux_pipeline(tmp_path_factory.mktemp("flux"), seed=0)


@pytest.fixture(scope="module")
def flux_dev_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Guidance-distilled (``guidance_embeds=True``), as FLUX.1-dev."""
    return save_tiny_flux_pipeline(tmp_path_factory.mktemp("flux_dev"), seed=1, guidance_embeds=True)


@pytest.mark.parametrize(
    "guidance",
    [NEGATIVE, dict(negative_prompt="blurry static", true_cfg_scale=1.0), dict(true_cfg_scale=4.0)],
    ids=["true-cfg", "scale-1", "no-negative"],
)
def test_matches_the_pipeline(flux_dir: Path, guidance: dict[str, Any]) -> None:
    graph = from_diffusers(flux_dir)
    assert isinstance(graph, PipelineGraph) and isinstance(graph.family, FluxFamily)
    assert set(graph.text.module.keys()) == {"text_encoder", "text_encoder_2"}
    pipe: Any = graph.pipe  # the locally built tokenizers, as saved and loaded
    assert (type(pipe.tokenizer).__name__, type(pipe.tokenizer_2).__name__) == ("CLIPTokenizer", "T5Tokenizer")
    assert pipe.tokenizer_max_length == 77
    assert_matches_pipeline(flux_dir, CALL | guidance, attr="images")


def test_batches_of_prompts_and_images_match_the_pipeline(flux_dir: Path) -> None:
    prompts = dict(prompt=["a red circle", "a blue square moving left"], prompt_2=["red", "blue"])
    negatives = dict(negative_prompt=["blurry", "static"], true_cfg_scale=3.0)
    out = assert_matches_pipeline(flux_dir, CALL | prompts | negatives | {"num_images_per_prompt": 2}, attr="images")
    assert out.shape == (4, 32, 48, 3)


def test_guidance_distilled_matches_the_pipeline_at_rounded_sizes(flux_dev_dir: Path) -> None:
    # 34 x 50 rounds down to 32 x 48, as the pipeline rounds it
    call = CALL | NEGATIVE | dict(height=34, width=50, guidance_scale=3.5, num_inference_steps=3)
    out = assert_matches_pipeline(flux_dev_dir, call, attr="images")
    assert out.shape == (1, 32, 48, 3)
    graph: Any = from_diffusers(flux_dev_dir)
    kw = CALL | dict(seed=0, output_type="np", progress=False)
    assert abs(graph.generate(**kw, guidance_scale=1.0) - graph.generate(**kw, guidance_scale=8.0)).max() > 1e-3


def test_true_cfg_runs_two_branches_each_step(flux_dir: Path) -> None:
    graph: Any = from_diffusers(flux_dir)
    calls = [0]
    graph.denoise.module["transformer"].register_forward_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    graph.generate(**CALL, **NEGATIVE, seed=0, progress=False)
    assert calls[0] == 2 * CALL["num_inference_steps"]
    graph.generate(**CALL, true_cfg_scale=4.0, seed=0, progress=False)  # no negative prompt: one branch
    assert calls[0] == 3 * CALL["num_inference_steps"]


def test_unknown_and_unimplemented_arguments_are_named(flux_dir: Path) -> None:
    graph: Any = from_diffusers(flux_dir)
    with pytest.raises(TypeError, match="FluxPipeline.__call__: .*'num_frames'"):
        graph.generate(prompt="a red circle", num_frames=9)
    with pytest.raises(ValueError, match="pooled_prompt_embeds=tensor.* is not supported by mmpipe's graph"):
        graph.generate(prompt="a red circle", pooled_prompt_embeds=torch.zeros(1, 32))
    with pytest.raises(ValueError, match="max_sequence_length` cannot be greater than 512"):
        graph.generate(prompt="a red circle", max_sequence_length=513)


def test_tiny_weights_are_a_function_of_the_seed() -> None:
    a, b, c = (build_tiny_flux_pipeline(seed=s).transformer.state_dict() for s in (0, 0, 1))
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not all(torch.equal(a[k], c[k]) for k in a)
