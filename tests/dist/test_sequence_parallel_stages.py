"""Whole stages split over 2 and 4 gloo ranks against the unsplit stage: the Wan DiT (non-causal), the
HunyuanVideo DiT (non-causal, joint text-video attention) and the multimodal LLM (causal): loss / outputs and every parameter's gradient, and the gradient of the
replicated text context."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.distributed as dist
from diffusers import HunyuanVideoTransformer3DModel, WanTransformer3DModel
from torch.distributed.device_mesh import DeviceMesh
from transformers import AutoModel, Qwen2Config
from workers import run_workers

from mmpipe.parallel.sequence import SequenceMesh
from mmpipe.parallel.reshard import Region
from mmpipe.stages._source import ModuleSource
from mmpipe.stages.dit import FlowMatchingDiTStage, HunyuanVideoDiTFlowMatchingStage, WanDiTFlowMatchingStage
from mmpipe.stages.multimodal import ImageTextLM, MultimodalLLMStage

B, TEXT_LEN, TEXT_DIM = 2, 6, 16


def _wan_stage() -> WanDiTFlowMatchingStage:
    torch.manual_seed(0)
    module = WanTransformer3DModel(
        patch_size=(1, 2, 2),
        num_attention_heads=4,
        attention_head_dim=8,
        in_channels=16,
        out_channels=16,
        text_dim=TEXT_DIM,
        freq_dim=32,
        ffn_dim=64,
        num_layers=2,
        cross_attn_norm=True,
        qk_norm="rms_norm_across_heads",
        rope_max_seq_len=32,
    )
    return WanDiTFlowMatchingStage("dit", ModuleSource.from_module(module), shift=3.0)


def _hunyuan_stage() -> HunyuanVideoDiTFlowMatchingStage:
    torch.manual_seed(0)
    module = HunyuanVideoTransformer3DModel(
        in_channels=4, out_channels=4, num_attention_heads=4, attention_head_dim=8, num_layers=1,
        num_single_layers=1, num_refiner_layers=1, mlp_ratio=2.0, patch_size=2, patch_size_t=1,
        qk_norm="rms_norm", guidance_embeds=False, text_embed_dim=TEXT_DIM, pooled_projection_dim=TEXT_DIM,
        rope_axes_dim=(2, 2, 4),
    )  # fmt: skip
    return HunyuanVideoDiTFlowMatchingStage("dit", ModuleSource.from_module(module), shift=3.0)


DIT_STAGES: dict[str, tuple[Callable[[], FlowMatchingDiTStage], int]] = {
    "wan": (_wan_stage, 16),
    "hunyuan": (_hunyuan_stage, 4),
}  # builder, latent channels


def _dit_inputs(kind: str, frames: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    context = torch.randn(B, TEXT_LEN, TEXT_DIM, generator=gen)
    context[0, 4:] = 0  # right padding, zeroed as the text stages do (HunyuanVideo masks those keys)
    return {"latents": torch.randn(B, DIT_STAGES[kind][1], frames, 4, 6, generator=gen), "context": context}


def _dit_grads(
    stage: FlowMatchingDiTStage, inputs: dict[str, torch.Tensor], **options: object
) -> dict[str, torch.Tensor]:
    context = inputs["context"].clone().requires_grad_()
    loss = stage.forward(stage.module, {"latents": inputs["latents"], "context": context}, seed=7, **options)["loss"]
    loss.backward()
    grads = {k: p.grad for k, p in stage.module.named_parameters()}
    return {"loss": loss.detach(), "context": context.grad, **grads}


def _dit_worker(rank: int, world: int, kind: str, cases: list[tuple[int, int, int]]) -> list[dict[str, torch.Tensor]]:
    out = []
    for ulysses, ring, frames in cases:
        stage = DIT_STAGES[kind][0]()
        grid = torch.arange(world).view(ring, ulysses)
        mesh = SequenceMesh.from_device_mesh(DeviceMesh("cpu", grid, mesh_dim_names=("ring", "ulysses")), zigzag=False)
        stage.check_sequence_parallel(ulysses, ring)
        stage.parallelize_sequence(stage.module, mesh)
        inputs = _dit_inputs(kind, frames)
        region = Region((0, B), 2, tuple(mesh.layout.ranges(frames, mesh.index)), frames)
        local = {"latents": mesh.layout.shard(inputs["latents"], 2, mesh.index), "context": inputs["context"]}
        grads = _dit_grads(stage, local, shards={"latents": region})
        for g in grads.values():  # each rank holds its tokens' share of every sum; the replica's total is exact
            dist.all_reduce(g)
        out.append(grads)
    return out


# (ulysses, ring, latent frames): 3 and 5 frames split unevenly over 2 and 4 ranks
DIT_CASES = {2: [(2, 1, 3), (1, 2, 3), (2, 1, 4)], 4: [(2, 2, 5), (1, 4, 4)]}


@pytest.mark.parametrize("kind", ["wan", "hunyuan"])
@pytest.mark.parametrize("world", [2, 4])
def test_dit_matches_single_process(world: int, kind: str) -> None:
    cases = DIT_CASES[world]
    results = run_workers(_dit_worker, world, kind, cases)
    for i, (ulysses, ring, frames) in enumerate(cases):
        ref = _dit_grads(DIT_STAGES[kind][0](), _dit_inputs(kind, frames))
        for got in (r[i] for r in results):
            assert got.keys() == ref.keys()
            for k in ref:
                # float32: the split sums each parameter's gradient over tokens in per-rank partial sums
                # plus an all-reduce, and attention's softmax through LSE merges; relative 1e-4 of the
                # largest entry covers that reassociation (observed ~1e-6) while a dropped shard, token
                # or head (errors of order the gradient itself) fails.
                # Gradients that are zero in exact arithmetic (a key bias under softmax) are float32
                # noise (~1e-9) on both sides: the 1e-7 floor, far below every real gradient, covers them.
                scale = float(ref[k].abs().max()) + 1e-3
                err = float((got[k] - ref[k]).abs().max()) / scale
                assert err < 1e-4, f"ulysses={ulysses} ring={ring} frames={frames} {k}: relative error {err:.2e}"


def test_wan_dit_refuses_heads_not_divisible() -> None:
    with pytest.raises(ValueError, match=r"4 attention heads cannot be split over ulysses=3"):
        _wan_stage().check_sequence_parallel(3, 1)


# ---- the multimodal LLM (causal, zig-zag split) ----------------------------------------------------
IMAGE_TOKENS, VISION_WIDTH = 5, 8


def _llm_stage(text_len: int) -> MultimodalLLMStage:
    torch.manual_seed(0)
    config = Qwen2Config(
        hidden_size=32,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_hidden_layers=2,
        intermediate_size=64,
        vocab_size=50,
        max_position_embeddings=64,
    )
    module = ImageTextLM(AutoModel.from_config(config), VISION_WIDTH)
    source = ModuleSource(config, lambda: module)
    return MultimodalLLMStage(
        "llm", source, num_image_tokens=IMAGE_TOKENS, text_len=text_len, vision_width=VISION_WIDTH
    )


def _llm_inputs(text_len: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(2)
    mask = torch.ones(B, text_len, dtype=torch.int64)
    mask[1, text_len - 3 :] = 0  # right padding
    return {
        "image_tokens": torch.randn(B, IMAGE_TOKENS, VISION_WIDTH, generator=gen),
        "input_ids": torch.randint(0, 50, (B, text_len), generator=gen),
        "attention_mask": mask,
        "upstream": torch.randn(B, IMAGE_TOKENS + text_len, 32, generator=gen),
    }


def _llm_run(stage: MultimodalLLMStage, inputs: dict[str, torch.Tensor], pos: torch.Tensor) -> dict[str, torch.Tensor]:
    image = inputs["image_tokens"].clone().requires_grad_()
    out = stage.forward(stage.module, {**inputs, "image_tokens": image})
    (out["hidden"] * inputs["upstream"][:, pos]).sum().backward()
    grads = {k: p.grad for k, p in stage.module.named_parameters()}
    return {"hidden": out["hidden"].detach(), "image_tokens": image.grad, **grads}


def _llm_worker(rank: int, world: int, cases: list[tuple[int, int, int]]) -> list[dict[str, torch.Tensor]]:
    out = []
    for ulysses, ring, text_len in cases:
        stage = _llm_stage(text_len)
        grid = torch.arange(world).view(ring, ulysses)
        mesh = SequenceMesh.from_device_mesh(DeviceMesh("cpu", grid, mesh_dim_names=("ring", "ulysses")), zigzag=True)
        stage.check_sequence_parallel(ulysses, ring)
        stage.parallelize_sequence(stage.module, mesh)
        pos = mesh.layout.positions(IMAGE_TOKENS + text_len, mesh.index)
        got = _llm_run(stage, _llm_inputs(text_len), pos)
        for k, g in got.items():
            if k != "hidden":
                dist.all_reduce(g)
        out.append({**got, "positions": pos})
    return out


# (ulysses, ring, text tokens): 5 image + 8 or 11 text tokens, 13 or 16 in all
LLM_CASES = {2: [(2, 1, 8), (1, 2, 8), (1, 2, 11)], 4: [(2, 2, 8), (2, 2, 11), (1, 4, 11)]}


@pytest.mark.parametrize("world", [2, 4])
def test_llm_matches_single_process(world: int) -> None:
    cases = LLM_CASES[world]
    results = run_workers(_llm_worker, world, cases)
    for i, (ulysses, ring, text_len) in enumerate(cases):
        n = IMAGE_TOKENS + text_len
        ref = _llm_run(_llm_stage(text_len), _llm_inputs(text_len), torch.arange(n))
        seen = torch.zeros(n, dtype=torch.bool)
        for got in (dict(r[i]) for r in results):
            pos = got.pop("positions")
            seen[pos] = True
            assert got.keys() == ref.keys()
            for k in ref:
                want = ref[k][:, pos] if k == "hidden" else ref[k]
                # float32 reassociation only (see the DiT test); padded positions are exactly zero on both sides.
                scale = float(want.abs().max()) + 1e-12
                err = float((got[k] - want).abs().max()) / scale
                assert err < 1e-4, f"ulysses={ulysses} ring={ring} text={text_len} {k}: relative error {err:.2e}"
        assert bool(seen.all())
