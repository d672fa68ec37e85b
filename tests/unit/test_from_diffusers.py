"""``mmpipe.from_diffusers`` against ``WanPipeline.__call__`` on tiny random components."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from diffusers import WanPipeline

import mmpipe
from mmpipe.config import ModelConfig
from mmpipe.models.wan import build_t2v_training_graph, build_tiny_wan_pipeline

CALL = dict(
    prompt="a red circle moving left",
    negative_prompt="blurry static",
    height=32,
    width=48,
    num_frames=9,
    num_inference_steps=4,
)


@pytest.mark.parametrize("guidance_scale", [5.0, 1.0], ids=["cfg", "no-cfg"])
def test_generate_matches_wan_pipeline(tiny_wan_dir: Path, guidance_scale: float) -> None:
    pipe = WanPipeline.from_pretrained(tiny_wan_dir)
    pipe.set_progress_bar_config(disable=True)
    ref = pipe(**CALL, guidance_scale=guidance_scale, generator=torch.Generator().manual_seed(7), output_type="np")
    graph = mmpipe.from_diffusers(tiny_wan_dir)
    out = graph.generate(**CALL, guidance_scale=guidance_scale, seed=7, output_type="np", progress=False)
    assert out.shape == ref.frames.shape == (1, 9, 32, 48, 3)
    # Same modules, same ops in the same order: float32 results agree far inside the 1e-5 budget.
    assert np.abs(out - ref.frames).max() <= 1e-5
    assert out.std() > 0.01  # not a constant image that would match trivially


def test_from_pipeline_object_shares_its_modules(tiny_wan_dir: Path) -> None:
    pipe = WanPipeline.from_pretrained(tiny_wan_dir)
    graph = mmpipe.from_diffusers(pipe)
    assert graph.denoise.module is pipe.transformer
    assert graph.text.module is pipe.text_encoder
    assert graph.decode.module is pipe.vae
    a = graph.generate(**CALL, seed=1, progress=False)
    b = graph.generate(**CALL, seed=1, progress=False)
    c = graph.generate(**CALL, seed=2, progress=False)
    assert np.array_equal(a, b) and not np.array_equal(a, c)  # seeded, and the scheduler is not left stateful


def test_bad_inputs_are_rejected(tiny_wan_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="not a local diffusers pipeline directory"):
        mmpipe.from_diffusers(tmp_path)
    from diffusers import DDPMPipeline, DDPMScheduler, UNet2DModel

    unet = UNet2DModel(
        sample_size=8,
        block_out_channels=(8, 8),
        down_block_types=("DownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "UpBlock2D"),
        norm_num_groups=4,
        layers_per_block=1,
    )
    with pytest.raises(ValueError, match="DDPMPipeline is not supported; supported pipelines: \\[.*'FluxPipeline'"):
        mmpipe.from_diffusers(DDPMPipeline(unet=unet, scheduler=DDPMScheduler()))
    graph = mmpipe.from_diffusers(tiny_wan_dir)
    with pytest.raises(ValueError, match="divisible by 16, got height=30"):
        graph.generate("a red circle", height=30, width=32, num_frames=5)
    with pytest.raises(ValueError, match="negative_prompt has 2 entries but prompt has 1"):
        graph.generate(["a red circle"], ["x", "y"], height=32, width=32, num_frames=5)


def test_causal_lm_text_encoder_zeroes_padding_and_trains_the_dit(tmp_path: Path) -> None:
    cfg = ModelConfig(text_encoder="qwen2", text_len=8)
    build_tiny_wan_pipeline(cfg, ["a red circle moving left"], seed=0).save_pretrained(tmp_path)
    graph = build_t2v_training_graph(tmp_path, text_len=8)
    text = graph.stages["text"]
    assert type(text).__name__ == "CausalLMTextEncoderStage"
    tokens = text.tokenize(["a red circle"])
    ctx = text(tokens)["context"]
    n = int(tokens["attention_mask"].sum())
    assert n == 4  # three words and </s>
    assert ctx.shape == (1, 8, 32) and ctx[0, n:].abs().max() == 0 and ctx[0, :n].abs().min() > 0
    inputs = {**tokens, "video": torch.rand(1, 3, 5, 32, 32) * 2 - 1}
    loss = graph.run(inputs, {"dit": {"seed": 0}})["dit"]["loss"]
    loss.backward()
    grads = [p.grad for p in graph.stages["dit"].module.parameters()]
    assert all(g is not None for g in grads) and sum(float(g.abs().sum()) for g in grads) > 0
    assert all(p.grad is None for p in text.module.parameters())  # frozen encoder gets no gradient


def test_generate_with_the_triton_kernels_matches_the_stock_denoiser(tiny_wan_dir: Path) -> None:
    """``mmpipe generate`` applies the run's ``model.kernels`` to the denoiser: with every kernel
    (interpreted on CPU) the video equals the stock one up to float32 reassociation."""
    from mmpipe.kernels.registry import KernelChoice
    from mmpipe.runtime.trained import apply_kernels

    call = CALL | {"num_inference_steps": 2}
    stock = mmpipe.from_diffusers(tiny_wan_dir).generate(**call, seed=3, output_type="np", progress=False)
    graph = mmpipe.from_diffusers(tiny_wan_dir)
    apply_kernels(graph, KernelChoice(attention="triton", norm_modulate="triton", rope="triton"))
    fused = graph.generate(**call, seed=3, output_type="np", progress=False)
    # two denoising steps and the VAE decode in float32: the kernels' own accumulation order
    # (~1e-7 relative per op) stays far inside 1e-4 on pixels in [0, 1]
    assert np.abs(fused - stock).max() <= 1e-4
    assert stock.std() > 0.01
