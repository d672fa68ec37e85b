"""HunyuanVideo through ``mmpipe.from_diffusers`` against ``HunyuanVideoPipeline.__call__`` on a tiny
random pipeline: embedded guidance, true CFG with a negative prompt, the prompt template's crop."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from diffusers import DiffusionPipeline
from diffusers.pipelines.hunyuan_video.pipeline_hunyuan_video import DEFAULT_PROMPT_TEMPLATE

from mmpipe.models.hunyuan import HunyuanVideoFamily, build_tiny_hunyuan_pipeline, save_tiny_hunyuan_pipeline
from mmpipe.models.loading import from_diffusers
from mmpipe.models.pipeline_graph import PipelineGraph
from tests.families.parity import assert_matches_pipeline

# odd frame count (9 -> 3 latent frames), non-square frames; a short text length keeps the DiT fast
CALL = dict(
    prompt="a red circle moving left",
    negative_prompt="blurry static",
    height=32,
    width=48,
    num_frames=9,
    num_inference_steps=2,
    max_sequence_length=32,
)


@pytest.fixture(scope="module")
def hunyuan_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_hunyuan_pipeline(tmp_path_factory.mktemp("hunyuan"), seed=0)


@pytest.mark.parametrize("true_cfg_scale", [4.0, 1.0], ids=["true-cfg", "no-cfg"])
def test_matches_the_pipeline(hunyuan_dir: Path, true_cfg_scale: float) -> None:
    graph = from_diffusers(hunyuan_dir)
    assert isinstance(graph, PipelineGraph) and isinstance(graph.family, HunyuanVideoFamily)
    assert set(graph.text.module.keys()) == {"text_encoder", "text_encoder_2"}
    out = assert_matches_pipeline(hunyuan_dir, CALL | {"true_cfg_scale": true_cfg_scale, "guidance_scale": 5.0})
    assert out.shape == (1, 9, 32, 48, 3)


def test_true_cfg_runs_the_negative_branch_only_with_a_negative_prompt(hunyuan_dir: Path) -> None:
    graph: Any = from_diffusers(hunyuan_dir)
    calls = []
    graph.denoise.module["transformer"].register_forward_hook(lambda *_: calls.append(1))
    kw = CALL | {"num_inference_steps": 1, "true_cfg_scale": 4.0, "seed": 0, "progress": False}
    graph.generate(**kw, output_type="latent")
    assert len(calls) == 2
    graph.generate(**(kw | {"negative_prompt": None}), output_type="latent")  # as the pipeline: no negative, no CFG
    assert len(calls) == 3


def test_template_crop_start_is_computed_as_the_pipeline_does(hunyuan_dir: Path) -> None:
    pipe: Any = DiffusionPipeline.from_pretrained(hunyuan_dir)
    # the tiny tokenizer cuts the default template's system part where the released one does
    template_ids = pipe.tokenizer(DEFAULT_PROMPT_TEMPLATE["template"], padding="max_length").input_ids
    assert len(template_ids) - 2 == DEFAULT_PROMPT_TEMPLATE["crop_start"]
    template = {"template": "<|start_header_id|>user<|end_header_id|>\n\n{}<|eot_id|>"}  # no crop_start
    assert_matches_pipeline(hunyuan_dir, CALL | {"prompt_template": template, "num_inference_steps": 1})


def test_tiny_weights_are_a_function_of_the_seed(hunyuan_dir: Path) -> None:
    loaded: Any = DiffusionPipeline.from_pretrained(hunyuan_dir)
    again: Any = build_tiny_hunyuan_pipeline(seed=0)
    other: Any = build_tiny_hunyuan_pipeline(seed=1)
    for name in ("text_encoder", "text_encoder_2", "transformer", "vae"):
        saved = getattr(loaded, name).state_dict()
        assert all(torch.equal(v, getattr(again, name).state_dict()[k]) for k, v in saved.items()), name
    weights = loaded.transformer.state_dict()
    assert any(not torch.equal(v, other.transformer.state_dict()[k]) for k, v in weights.items())


def test_arguments_the_pipeline_does_not_take_are_named(hunyuan_dir: Path) -> None:
    graph = from_diffusers(hunyuan_dir)
    with pytest.raises(TypeError, match="HunyuanVideoPipeline.__call__: .*'guidance_rescale'"):
        graph.generate(prompt="a red circle", guidance_rescale=0.7)
    with pytest.raises(ValueError, match="pooled_prompt_embeds=tensor.* is not supported by mmpipe's graph"):
        graph.generate(prompt="a red circle", pooled_prompt_embeds=torch.zeros(1, 8))
    with pytest.raises(ValueError, match="divisible by 16"):
        graph.generate(prompt="a red circle", height=40, width=48, num_frames=9)
