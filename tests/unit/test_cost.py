"""Stage costs counted on the meta device equal the counts on real tensors; full-size configs are free."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
from diffusers import WanTransformer3DModel
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from mmpipe.assemble.graphs import planning_graph
from mmpipe.config import DataConfig, ModelConfig
from mmpipe.models.wan import build_t2v_training_graph
from mmpipe.sched.cost import measure_graph_costs, measure_stage_cost
from mmpipe.stages import WanDiTFlowMatchingStage
from mmpipe.stages._source import ModuleSource


@pytest.fixture(autouse=True)
def _private_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MMPIPE_CACHE", str(tmp_path / "cache"))


def real_counts(stage, inputs: dict, **options) -> tuple[int, int, int]:
    """(forward FLOPs, backward FLOPs, saved-activation bytes) of a real run in bf16."""
    module = stage.module.to(torch.bfloat16)
    params = {id(p) for p in module.parameters()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        base = t._base if t._base is not None else t
        if id(base) not in params:
            seen[id(base)] = base.numel() * base.element_size()
        return t

    # FLOPs: the math attention backend decomposes attention into counted matmuls (the fused CPU
    # kernel has no formula in FlopCounterMode). Saved bytes: the default, fused CPU kernel.
    counter = FlopCounterMode(display=False)
    with counter, torch.set_grad_enabled(not stage.frozen), sdpa_kernel(SDPBackend.MATH):
        out = stage.forward(module, inputs, **options)
        forward = counter.get_total_flops()
        if not stage.frozen:
            out["loss"].backward()
    module.zero_grad(set_to_none=True)
    with torch.set_grad_enabled(not stage.frozen), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        stage.forward(module, inputs, **options)
    return forward, counter.get_total_flops() - forward, sum(seen.values())


@pytest.mark.parametrize("name", ["text", "vae", "dit"])
def test_meta_counts_equal_real_counts(tiny_wan_dir: Path, name: str) -> None:
    graph = build_t2v_training_graph(tiny_wan_dir, text_len=16)
    text = graph.stages["text"]
    tokens = text.tokenize(["a red circle moving left", "a blue square"])
    video = torch.rand(2, 3, 9, 32, 32) * 2 - 1
    with torch.no_grad():
        ctx = text(tokens)["context"]
        latents = graph.stages["vae"]({"video": video})["latents"]
    inputs = {"text": tokens, "vae": {"video": video}, "dit": {"latents": latents, "context": ctx}}[name]
    stage = graph.stages[name]
    cost = measure_stage_cost(stage, {k: (tuple(v.shape), v.dtype) for k, v in inputs.items()}, seed=0)
    fwd, bwd, saved = real_counts(stage, inputs, seed=0)
    # On meta, attention is priced as the fused flash kernel: the forward equals the math
    # decomposition's matmuls, its backward is priced at 2.5x the forward attention (recomputing
    # the probabilities) where the math backward is 2x; everything else is counted identically.
    assert cost.forward_flops == pytest.approx(fwd, rel=0.02)
    assert cost.backward_flops == pytest.approx(bwd + 0.5 * cost.attention_flops if bwd else 0, rel=0.02)
    assert cost.forward_flops > 0 and (cost.backward_flops > 0) == (name == "dit")
    assert cost.params == sum(p.numel() for p in stage.module.parameters())
    # The activation bytes autograd keeps: the same hooks on real tensors see the same tensors
    # (the fused CPU attention saves the same q, k, v, out and log-sum-exp as the flash kernel).
    assert cost.activation_bytes == pytest.approx(saved, rel=0.05)
    assert (cost.activation_bytes > 0) == (name == "dit")


def test_graph_costs_propagate_shapes_and_attribute_blocks(tiny_wan_dir: Path) -> None:
    graph = build_t2v_training_graph(tiny_wan_dir, text_len=16)
    shapes = {
        "input_ids": ((1, 16), torch.int64),
        "attention_mask": ((1, 16), torch.int64),
        "video": ((1, 3, 9, 32, 32), torch.float32),
    }
    costs = measure_graph_costs(graph, shapes)
    dit = costs["dit"]
    cfg = graph.stages["dit"].source.config
    assert dit.blocks == cfg.num_layers
    assert dit.tokens == 3 * 4 * 4 // 4  # latents 3 x 4 x 4 (VAE strides 4, 8, 8) in 1x2x2 patches
    assert dit.heads == cfg.num_attention_heads
    assert 0 < dit.block_activation_bytes <= dit.activation_bytes
    assert 0 < dit.block_input_bytes < dit.block_activation_bytes
    assert 0 < dit.block_flops < dit.forward_flops
    assert costs["vae"].output_bytes == 16 * 3 * 4 * 4 * 4  # float32 latents of one sample
    # Costs are cached on disk: a second call reads them back equal.
    assert measure_graph_costs(graph, shapes) == costs


def test_full_size_wan_dit_costs_seconds_and_no_memory() -> None:
    # Wan2.1-T2V-1.3B's transformer config, 480p x 81 frames (21 x 60 x 104 latents, 32,760 tokens).
    config = dict(
        patch_size=(1, 2, 2),
        num_attention_heads=12,
        attention_head_dim=128,
        in_channels=16,
        out_channels=16,
        text_dim=4096,
        freq_dim=256,
        ffn_dim=8960,
        num_layers=30,
        cross_attn_norm=True,
        qk_norm="rms_norm_across_heads",
        rope_max_seq_len=1024,
        eps=1e-6,
    )
    with torch.device("meta"):
        meta_model = WanTransformer3DModel(**config)
    stage = WanDiTFlowMatchingStage("dit", ModuleSource(meta_model.config, lambda: meta_model), shift=3.0)
    start = time.perf_counter()
    cost = measure_stage_cost(
        stage, {"latents": ((1, 16, 21, 60, 104), torch.float32), "context": ((1, 512, 4096), torch.float32)}, seed=0
    )
    assert time.perf_counter() - start < 60
    assert 1.3e9 < cost.params < 1.5e9
    # analytic: 2 FLOPs per block parameter per video token, plus self-attention's QK^T and AV
    # (4 S^2 d per layer); cross-attention K/V act on 512 text tokens, so this slightly overcounts
    tokens, dim, layers = 21 * 30 * 52, 1536, 30
    analytic = 2 * cost.params * tokens + 4 * tokens**2 * dim * layers
    assert cost.forward_flops == pytest.approx(analytic, rel=0.15)
    # self-attention over the video tokens plus cross-attention to 512 text tokens
    assert cost.attention_flops == pytest.approx(4 * tokens * (tokens + 512) * dim * layers, rel=0.01)
    # Backward: twice the matmuls, 2.5 times the flash attention forward.
    expected_bwd = 2 * (cost.forward_flops - cost.attention_flops) + 2.5 * cost.attention_flops
    assert cost.backward_flops == pytest.approx(expected_bwd, rel=0.05)
    # Keeping every activation of a 32k-token sample takes hundreds of GB: what the planner must manage.
    assert cost.activation_bytes > 100e9
    assert cost.block_input_bytes == pytest.approx(layers * tokens * dim * 2, rel=0.05)


@pytest.mark.parametrize(
    ("preset", "expected"),
    [
        # (stage, parameters in billions) of the released architectures
        ("wan14b_t2v", {"text": 5.68, "dit": 14.29}),
        ("wan22_a14b_t2v", {"text": 5.68, "dit": 14.29, "dit_2": 14.29}),  # two 14B experts
        ("hunyuan_t2v", {"text": 7.07, "dit": 12.83}),
        ("ltx_2b_t2v", {"text": 4.76, "dit": 1.92}),  # T5-v1.1-XXL encoder, the LTX-Video 2B DiT
        ("cogvideox_5b_t2v", {"text": 4.76, "dit": 5.57}),  # T5-v1.1-XXL encoder, the CogVideoX-5B DiT
        # Wan2.1-I2V-14B-720P: CLIP ViT-H/14; the DiT is the T2V DiT's 14.29B plus each of its 40 blocks'
        # image keys / values (2 x 5120^2) and the image embedder, 16.39B as its published config builds
        ("wan21_i2v_14b", {"text": 5.68, "clip": 0.63, "dit": 16.39}),
        ("u2g_full", {"vision": 0.43, "llm": 7.07, "dit": 14.29}),
    ],
)
def test_full_size_presets_cost_on_meta(preset: str, expected: dict[str, float]) -> None:
    from mmpipe.config import compose_config, from_dict

    model = from_dict(ModelConfig, compose_config("plan", [f"model={preset}"])["model"])
    graph, shapes = planning_graph(model, DataConfig())
    costs = measure_graph_costs(graph, shapes)
    for stage, billions in expected.items():
        assert costs[stage].params / 1e9 == pytest.approx(billions, rel=0.01)
    dit = costs["dit"]
    # LTX's VAE compresses 32x32x8: 768x512 x 121 frames is 16 x 16 x 24 latent tokens (patch 1);
    # CogVideoX's 8x8x4: 720x480 x 49 frames is 13 x 60 x 90 latents, 13 x 30 x 45 tokens (patch 2)
    small = {"ltx_2b_t2v": 6_144, "cogvideox_5b_t2v": 17_550}
    assert dit.tokens == small[preset] if preset in small else dit.tokens >= 75_600
    assert dit.backward_flops > dit.forward_flops > (1e13 if preset in small else 1e15)
    if preset == "cogvideox_5b_t2v":  # one full-attention sequence: 226 text tokens, then the video's
        seq, width, layers = 226 + 17_550, 48 * 64, 42
        assert dit.attention_flops == pytest.approx(4 * seq**2 * width * layers, rel=0.01)
    if preset == "wan21_i2v_14b":  # 16 x 16 patches of the 224-pixel first frame and the class token
        assert costs["clip"].tokens == 257
        # self-attention over the video, cross-attention to 512 text and 257 image tokens
        tokens, width, layers = 21 * 45 * 80, 40 * 128, 40
        assert dit.attention_flops == pytest.approx(4 * tokens * (tokens + 512 + 257) * width * layers, rel=0.01)
    assert all(c.forward_flops > 0 for c in costs.values())
    with pytest.raises(ValueError, match="architecture-only preset"):
        graph.stages["dit"].module  # noqa: B018  (no weights exist)


def test_cogvideox_preset_refuses_a_foreign_vae_and_text_len() -> None:
    from mmpipe.config import compose_config, from_dict
    from mmpipe.models.arch import build_arch_graph

    raw = compose_config("plan", ["model=cogvideox_5b_t2v"])["model"]
    wan_vae = {**raw, "arch": {**raw["arch"], "vae": {"class": "wan"}}}
    with pytest.raises(ValueError, match="model.arch.vae.class='wan', model.arch.dit.class='cogvideox'"):
        build_arch_graph(from_dict(ModelConfig, wan_vae))
    with pytest.raises(ValueError, match="max_text_seq_length=226; set model.text_len=226"):
        build_arch_graph(from_dict(ModelConfig, {**raw, "text_len": 512}))


@pytest.mark.parametrize(
    ("preset", "expected", "image_tokens", "layers"),
    [
        # T5-v1.1-XXL 4.76B + CLIP-L's text tower 0.12B; the 11.9B FLUX.1 DiT (19 double + 38 single blocks)
        ("flux1_dev", {"text": 4.885, "vae": 0.084, "dit": 11.90}, 64 * 64, 19 + 38),
        # Qwen2.5-VL-7B as the pipeline calls it (vision tower and LM head included); the 20.4B DiT
        ("qwen_image", {"text": 8.29, "vae": 0.127, "dit": 20.43}, 83 * 83, 60),
    ],
)
def test_image_presets_cost_one_request_on_meta(
    preset: str, expected: dict[str, float], image_tokens: int, layers: int
) -> None:
    from mmpipe.config import compose_config, from_dict

    model = from_dict(ModelConfig, compose_config("plan", [f"model={preset}"])["model"])
    graph, shapes = planning_graph(model, DataConfig())
    costs = measure_graph_costs(graph, shapes)
    for stage, billions in expected.items():
        assert costs[stage].params / 1e9 == pytest.approx(billions, rel=0.01)
    dit = costs["dit"]
    # the VAE's 8x and the 2x2 packing: 1024 / 16 = 64 and 1328 / 16 = 83 tokens a side
    assert dit.tokens == image_tokens and dit.heads == 24
    # one joint sequence (the 512 text tokens and the image's) in every block, 24 x 128 wide
    assert dit.attention_flops == pytest.approx(4 * (image_tokens + 512) ** 2 * 3072 * layers, rel=0.01)
    # a request's stages: frozen, forward only; the engine refuses to split their sequence
    assert all(c.backward_flops == 0 and c.forward_flops > 0 for c in costs.values())
    assert not graph.stages["dit"].capabilities.sequence_parallel
    with pytest.raises(ValueError, match="architecture-only preset"):
        graph.stages["dit"].module  # noqa: B018  (no weights exist)


def test_image_and_i2v_presets_refuse_a_mismatched_arch() -> None:
    from mmpipe.config import compose_config, from_dict
    from mmpipe.models.arch import build_arch_graph

    def model(preset: str, **changes: object) -> ModelConfig:
        raw = compose_config("plan", [f"model={preset}"])["model"]
        return from_dict(ModelConfig, {**raw, **changes})

    flux = compose_config("plan", ["model=flux1_dev"])["model"]
    with pytest.raises(ValueError, match="model.kind='t2v' with model.arch.dit.class='flux'"):
        build_arch_graph(model("wan14b_t2v", arch={**flux["arch"], "vae": {"class": "flux"}}))
    wan = compose_config("plan", ["model=wan14b_t2v"])["model"]
    with pytest.raises(ValueError, match="model.kind='t2i' with model.arch.dit.class='wan'"):
        build_arch_graph(model("flux1_dev", arch=wan["arch"]))
    with pytest.raises(ValueError, match="model.arch.vae.class='wan', model.arch.dit.class='flux'"):
        build_arch_graph(model("flux1_dev", arch={**flux["arch"], "vae": wan["arch"]["vae"]}))
    with pytest.raises(ValueError, match="needs model.arch.text_2"):
        build_arch_graph(model("flux1_dev", arch={**flux["arch"], "text_2": None}))
    with pytest.raises(ValueError, match="set model.text_len=512"):
        build_arch_graph(model("wan21_i2v_14b", text_len=256))
    with pytest.raises(ValueError, match="model.arch.image .* makes a Wan 2.1 I2V preset"):
        build_arch_graph(model("wan22_a14b_t2v", arch={**wan["arch"], "image": {"model_type": "clip_vision_model"}}))
    with pytest.raises(ValueError, match="model.video.frames must be 1"):
        model("flux1_dev", video={"frames": 5, "height": 1024, "width": 1024})
    with pytest.raises(ValueError, match="model.kind=t2i .* model.path null"):
        model("flux1_dev", arch=None)
