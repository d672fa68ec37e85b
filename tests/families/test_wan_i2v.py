"""Wan image-to-video through ``mmpipe.from_diffusers`` against ``WanImageToVideoPipeline.__call__``:
Wan 2.1 I2V (CLIP embeddings, the VAE-encoded first frame concatenated), FLF2V (a last frame too),
Wan 2.2's two experts and TI2V's ``expand_timesteps``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from diffusers import DiffusionPipeline
from PIL import Image, ImageDraw

from mmpipe.models.loading import from_diffusers
from mmpipe.models.pipeline_graph import PipelineGraph
from mmpipe.models.wan_i2v import WanI2VFamily, save_tiny_wan_i2v_pipeline
from tests.families.parity import assert_matches_pipeline


def circle(color: str, size: tuple[int, int] = (48, 32)) -> Image.Image:
    """A filled circle on a dark background (``size``: width, height)."""
    image = Image.new("RGB", size, (20, 20, 40))
    ImageDraw.Draw(image).ellipse((8, 6, 28, 26), fill=color)
    return image


# odd frame count (9 -> 3 latent frames), non-square frames
CALL = dict(
    image=circle("red"),
    prompt="a red circle moving left",
    negative_prompt="blurry static",
    height=32,
    width=48,
    num_frames=9,
    num_inference_steps=3,
)


@pytest.fixture(scope="module")
def i2v_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """One tiny pipeline a variant (see ``mmpipe.models.wan_i2v.TinyVariant``)."""
    root = tmp_path_factory.mktemp("wan_i2v")
    return {v: save_tiny_wan_i2v_pipeline(root / v, variant=v) for v in ("wan21", "flf2v", "wan22", "ti2v")}


@pytest.mark.parametrize(
    ("variant", "extra"),
    [
        ("wan21", dict(guidance_scale=5.0)),
        ("wan21", dict(guidance_scale=1.0)),
        ("flf2v", dict(guidance_scale=5.0, last_image=circle("blue"))),
        ("wan22", dict(guidance_scale=5.0, guidance_scale_2=3.0)),
        ("ti2v", dict(guidance_scale=5.0)),
    ],
    ids=["wan21-cfg", "wan21-no-cfg", "flf2v-cfg", "wan22-two-experts-cfg", "ti2v-cfg"],
)
def test_matches_the_pipeline(i2v_dirs: dict[str, Path], variant: str, extra: dict[str, Any]) -> None:
    graph: Any = from_diffusers(i2v_dirs[variant])
    assert isinstance(graph, PipelineGraph) and isinstance(graph.family, WanI2VFamily)
    out = assert_matches_pipeline(i2v_dirs[variant], CALL | extra)
    assert out.shape == (1, 9, 32, 48, 3)


def test_the_image_conditions_the_video(i2v_dirs: dict[str, Path]) -> None:
    graph: Any = from_diffusers(i2v_dirs["wan21"])
    kw = CALL | {"num_inference_steps": 2, "guidance_scale": 1.0, "seed": 0, "progress": False}
    red, green = graph.generate(**kw), graph.generate(**kw | {"image": circle("green")})
    assert abs(red - green).max() > 0.01


def test_clip_embeddings_are_a_port_only_where_the_transformer_takes_them(i2v_dirs: dict[str, Path]) -> None:
    graphs: dict[str, Any] = {v: from_diffusers(p) for v, p in i2v_dirs.items()}
    ports = {v: set(graph.text.outputs) for v, graph in graphs.items()}
    both = {"image_embeds", "negative_image_embeds"}
    assert both <= ports["wan21"] and both <= ports["flf2v"]
    assert not both & ports["wan22"] and not both & ports["ti2v"]


def test_both_experts_run(i2v_dirs: dict[str, Path]) -> None:
    graph: Any = from_diffusers(i2v_dirs["wan22"])
    calls = {"transformer": 0, "transformer_2": 0}
    for name, module in graph.denoise.module.items():
        module.register_forward_hook(lambda *_, n=name: calls.__setitem__(n, calls[n] + 1))
    graph.generate(**CALL, guidance_scale=1.0, seed=0, progress=False)
    # boundary_ratio 0.9: the high-noise expert takes the first step only
    assert calls == {"transformer": 1, "transformer_2": 2}


def test_ti2v_latents_end_with_the_image_as_first_frame(i2v_dirs: dict[str, Path]) -> None:
    # __call__ writes the image's latents into the first frame after its loop, output_type="latent" too
    path = i2v_dirs["ti2v"]
    pipe: Any = DiffusionPipeline.from_pretrained(path)
    pipe.set_progress_bar_config(disable=True)
    call = CALL | {"guidance_scale": 5.0, "output_type": "latent"}
    ref = pipe(**call, generator=torch.Generator().manual_seed(3)).frames
    out = from_diffusers(path).generate(**call, seed=3, progress=False)
    assert out.shape == ref.shape == (1, 16, 3, 4, 6)
    assert float((out - ref).abs().max()) <= 1e-5


def test_a_missing_image_and_unknown_or_unimplemented_arguments_are_named(i2v_dirs: dict[str, Path]) -> None:
    graph: Any = from_diffusers(i2v_dirs["wan21"])
    kw = {k: v for k, v in CALL.items() if k != "image"}
    with pytest.raises(TypeError, match="WanImageToVideoPipeline.__call__: missing a required argument: 'image'"):
        graph.generate(**kw)
    with pytest.raises(TypeError, match="WanImageToVideoPipeline.__call__: .*'use_dynamic_cfg'"):
        graph.generate(**CALL, use_dynamic_cfg=True)
    with pytest.raises(ValueError, match="image_embeds=tensor.* is not supported by mmpipe's graph"):
        graph.generate(**CALL, image_embeds=torch.zeros(1, 17, 16))
    with pytest.raises(ValueError, match="divisible by 16"):  # the pipeline's check_inputs
        graph.generate(**CALL | {"height": 40})
