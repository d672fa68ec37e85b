"""Qwen-Image through ``mmpipe.from_diffusers``: the templated Qwen2.5-VL prompt, its padding mask,
true classifier-free guidance with the pipeline's norm rescaling and the sigma shift, against
``QwenImagePipeline.__call__``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from mmpipe.models.loading import from_diffusers
from mmpipe.models.pipeline_graph import PipelineGraph
from mmpipe.models.qwenimage import (
    QWEN_SPECIAL_TOKENS,
    QwenImageFamily,
    build_qwen_tokenizer,
    build_tiny_qwenimage_pipeline,
    prompt_template,
    save_tiny_qwenimage_pipeline,
)
from tests.families.parity import assert_matches_pipeline

# non-square (the tiny VAE downsamples by 4: multiples of 8 pixels)
CALL = dict(prompt="a red circle moving left", height=32, width=48, num_inference_steps=2)
NEGATIVE = dict(negative_prompt="blurry static", true_cfg_scale=4.0)


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_qwenimage_pipeline(tmp_path_factory.mktemp("qwenimage"), seed=0)


@pytest.mark.parametrize(
    "guidance", [NEGATIVE, dict(negative_prompt="blurry static", true_cfg_scale=1.0)], ids=["true-cfg", "no-cfg"]
)
def test_matches_the_pipeline(qwen_dir: Path, guidance: dict[str, Any]) -> None:
    graph = from_diffusers(qwen_dir)
    assert isinstance(graph, PipelineGraph) and isinstance(graph.family, QwenImageFamily)
    assert_matches_pipeline(qwen_dir, CALL | guidance, attr="images")


def test_padded_prompts_and_several_images_match_the_pipeline(qwen_dir: Path) -> None:
    # prompts of different lengths: encode_prompt returns a padding mask (not None)
    prompts = dict(prompt=["a red circle", "a blue square moving slowly to the left"], negative_prompt=["x", "blurry"])
    call = CALL | prompts | dict(true_cfg_scale=3.0, num_images_per_prompt=2, num_inference_steps=3)
    out = assert_matches_pipeline(qwen_dir, call, attr="images")
    assert out.shape == (4, 32, 48, 3)


def test_sizes_are_rounded_as_the_pipeline_rounds_them(qwen_dir: Path) -> None:
    # 36 x 52 rounds down to 32 x 48 (multiples of 2 * vae_scale_factor)
    out = assert_matches_pipeline(qwen_dir, CALL | NEGATIVE | dict(height=36, width=52), attr="images")
    assert out.shape == (1, 32, 48, 3)


def test_a_guidance_distilled_transformer_needs_guidance_scale(qwen_dir: Path) -> None:
    # diffusers 0.42's QwenImageTransformer2DModel cannot run with guidance_embeds=True (its timestep
    # embedding takes no guidance), so only the pipeline's check is tested here
    graph: Any = from_diffusers(qwen_dir)
    graph.pipe.transformer.register_to_config(guidance_embeds=True)
    with pytest.raises(ValueError, match="guidance_scale is required for guidance-distilled model"):
        graph.generate(**CALL)


def test_the_template_prefix_is_the_tokens_the_pipeline_drops(qwen_dir: Path) -> None:
    tokenizer: Any = from_diffusers(qwen_dir).pipe.tokenizer  # as saved and loaded
    assert type(tokenizer).__name__ == "Qwen2Tokenizer"
    template, drop = prompt_template()
    prefix = tokenizer(template.split("{}")[0])["input_ids"]
    assert len(prefix) == drop
    specials = tokenizer.convert_tokens_to_ids(list(QWEN_SPECIAL_TOKENS))
    assert prefix[0] == specials[1] and specials[2] in prefix  # <|im_start|>, <|im_end|>: one token each
    assert build_qwen_tokenizer().get_vocab() == tokenizer.get_vocab()  # deterministic


def test_unknown_and_unimplemented_arguments_are_named(qwen_dir: Path) -> None:
    graph: Any = from_diffusers(qwen_dir)
    with pytest.raises(TypeError, match="QwenImagePipeline.__call__: .*'num_frames'"):
        graph.generate(prompt="a red circle", num_frames=9)
    with pytest.raises(ValueError, match="prompt_embeds_mask=tensor.* is not supported by mmpipe's graph"):
        graph.generate(prompt="a red circle", prompt_embeds_mask=torch.ones(1, 4))
    with pytest.raises(ValueError, match="max_sequence_length` cannot be greater than 1024"):
        graph.generate(prompt="a red circle", max_sequence_length=1025)


def test_tiny_weights_are_a_function_of_the_seed() -> None:
    a, b, c = (build_tiny_qwenimage_pipeline(seed=s).text_encoder.state_dict() for s in (0, 0, 1))
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not all(torch.equal(a[k], c[k]) for k in a)
