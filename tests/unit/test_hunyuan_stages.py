"""HunyuanVideo adapters on tiny random diffusers modules: the DiT flow-matching step and the VAE encoder."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from diffusers import AutoencoderKLHunyuanVideo, HunyuanVideoTransformer3DModel

from mmpipe.stages import HunyuanVAEEncodeStage, HunyuanVideoDiTFlowMatchingStage

TEXT_DIM = 16


def tiny_transformer(**overrides: Any) -> HunyuanVideoTransformer3DModel:
    torch.manual_seed(0)
    cfg: dict[str, Any] = dict(
        in_channels=4,
        out_channels=4,
        num_attention_heads=2,
        attention_head_dim=8,
        num_layers=1,
        num_single_layers=1,
        num_refiner_layers=1,
        mlp_ratio=2.0,
        patch_size=2,
        patch_size_t=1,
        qk_norm="rms_norm",
        guidance_embeds=False,
        text_embed_dim=TEXT_DIM,
        pooled_projection_dim=TEXT_DIM,
        rope_axes_dim=(2, 2, 4),  # sums to attention_head_dim
    )
    cfg.update(overrides)
    return HunyuanVideoTransformer3DModel(**cfg)


def batch(b: int = 2) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    latents = torch.randn(b, 4, 2, 4, 4, generator=gen)
    context = torch.randn(b, 6, TEXT_DIM, generator=gen)
    context[0, 4:] = 0  # right padding, zeroed the way the text stages do
    return {"latents": latents, "context": context}


@pytest.fixture(scope="module")
def dit() -> HunyuanVideoDiTFlowMatchingStage:
    return HunyuanVideoDiTFlowMatchingStage.from_module("dit", tiny_transformer(), shift=3.0)


def test_dit_loss_is_finite_and_trains_every_parameter(dit: HunyuanVideoDiTFlowMatchingStage) -> None:
    module = dit.module
    module.zero_grad()
    loss = dit.forward(module, batch(), seed=3)["loss"]
    assert loss.shape == () and loss.dtype == torch.float32 and torch.isfinite(loss)
    loss.backward()
    params = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
    assert params
    for n, p in params:
        assert p.grad is not None, n
        assert torch.isfinite(p.grad).all(), n
    module.zero_grad()


def test_dit_loss_is_a_function_of_the_seed_and_rows_slice_the_draw(dit: HunyuanVideoDiTFlowMatchingStage) -> None:
    module, inputs = dit.module, batch()
    with torch.no_grad():
        a = dit.forward(module, inputs, seed=5)["loss"]
        b = dit.forward(module, inputs, seed=5)["loss"]
        c = dit.forward(module, inputs, seed=6)["loss"]
        rows = [
            dit.forward(module, {k: v[i : i + 1] for k, v in inputs.items()}, seed=5, rows=(i, i + 1, 2))["loss"]
            for i in range(2)
        ]
    assert torch.equal(a, b) and not torch.equal(a, c)
    assert abs(a.item() - (rows[0].item() + rows[1].item()) / 2) <= 1e-6


def test_dit_all_padding_context_gives_a_finite_loss(dit: HunyuanVideoDiTFlowMatchingStage) -> None:
    inputs = batch()
    inputs["context"][1] = 0  # e.g. a prompt zeroed for classifier-free-guidance dropout
    with torch.no_grad():
        loss = dit.forward(dit.module, inputs, seed=0)["loss"]
    assert torch.isfinite(loss)


def test_dit_guidance_embeds_get_the_default_guidance() -> None:
    stage = HunyuanVideoDiTFlowMatchingStage.from_module("dit", tiny_transformer(guidance_embeds=True))
    assert stage.guidance == 6.0
    with torch.no_grad():
        loss = stage.forward(stage.module, batch(), seed=0)["loss"]
    assert torch.isfinite(loss)
    with pytest.raises(ValueError, match="guidance_embeds=False"):
        HunyuanVideoDiTFlowMatchingStage.from_module("dit", tiny_transformer(), guidance=6.0)


def test_dit_ports_and_mismatched_pooled_dim() -> None:
    stage = HunyuanVideoDiTFlowMatchingStage.from_module("dit", tiny_transformer())
    assert stage.inputs["latents"].shape == ("B", 4, "t", "h", "w")
    assert stage.inputs["context"].shape == ("B", "L", TEXT_DIM)
    assert stage.outputs["loss"].shape == ()
    with pytest.raises(ValueError, match=r"pooled_projection_dim \(8\) must equal text_embed_dim \(16\)"):
        HunyuanVideoDiTFlowMatchingStage.from_module("dit", tiny_transformer(pooled_projection_dim=8))


def test_vae_encode_is_the_scaled_mode() -> None:
    torch.manual_seed(0)
    vae: Any = AutoencoderKLHunyuanVideo(
        latent_channels=4, block_out_channels=(8, 8, 8, 8), layers_per_block=1, norm_num_groups=4
    )
    stage = HunyuanVAEEncodeStage.from_module("vae", vae)  # building it puts vae in eval mode
    assert stage.frozen and stage.outputs["latents"].shape == ("B", 4, "t", "h", "w")
    video = torch.rand(1, 3, 5, 16, 16, generator=torch.Generator().manual_seed(2)) * 2 - 1
    out = stage({"video": video})["latents"]
    assert out.shape == (1, 4, 2, 2, 2) and out.dtype == torch.float32
    with torch.no_grad():
        ref = vae.encode(video).latent_dist.mode() * vae.config.scaling_factor
    assert torch.equal(out, ref)
