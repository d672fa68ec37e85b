"""Whole stages split over 2 and 4 gloo ranks against the unsplit stage: the Wan DiT (non-causal) and
the multimodal LLM (causal): loss / outputs and every parameter's gradient, and the gradient of the
replicated text context."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from diffusers import WanTransformer3DModel
from torch.distributed.device_mesh import DeviceMesh
from workers import run_workers

from mmpipe.parallel.sequence import SequenceMesh
from mmpipe.runtime.reshard import Region
from mmpipe.stages._source import ModuleSource
from mmpipe.stages.dit import WanDiTFlowMatchingStage

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


def _wan_inputs(frames: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return {
        "latents": torch.randn(B, 16, frames, 4, 6, generator=gen),
        "context": torch.randn(B, TEXT_LEN, TEXT_DIM, generator=gen),
    }


def _wan_grads(stage: WanDiTFlowMatchingStage, inputs: dict[str, torch.Tensor], **options: object) -> dict[str, torch.Tensor]:
    context = inputs["context"].clone().requires_grad_()
    loss = stage.forward(stage.module, {"latents": inputs["latents"], "context": context}, seed=7, **options)["loss"]
    loss.backward()
    grads = {k: p.grad for k, p in stage.module.named_parameters()}
    return {"loss": loss.detach(), "context": context.grad, **grads}


def _wan_worker(rank: int, world: int, ulysses: int, ring: int, frames: int) -> dict[str, torch.Tensor]:
    stage = _wan_stage()
    mesh = SequenceMesh.from_device_mesh(
        DeviceMesh("cpu", torch.arange(world).view(ring, ulysses), mesh_dim_names=("ring", "ulysses")), zigzag=False
    )
    stage.check_sequence_parallel(ulysses, ring)
    stage.parallelize_sequence(stage.module, mesh)
    inputs = _wan_inputs(frames)
    ranges = tuple(mesh.layout.ranges(frames, mesh.index))
    region = Region((0, B), 2, ranges, frames)
    local = {"latents": mesh.layout.shard(inputs["latents"], 2, mesh.index), "context": inputs["context"]}
    grads = _wan_grads(stage, local, shards={"latents": region})
    for g in grads.values():  # each rank holds its tokens' share of every sum; the replica's total is exact
        dist.all_reduce(g)
    return grads


@pytest.mark.parametrize(
    ("world", "ulysses", "ring", "frames"),
    [(2, 2, 1, 3), (2, 1, 2, 3), (2, 2, 1, 4), (4, 2, 2, 5), (4, 1, 4, 4)],
    ids=["ulysses2-uneven", "ring2-uneven", "ulysses2-even", "2x2-uneven", "ring4-even"],
)
def test_wan_dit_matches_single_process(world: int, ulysses: int, ring: int, frames: int) -> None:
    ref = _wan_grads(_wan_stage(), _wan_inputs(frames))
    for got in run_workers(_wan_worker, world, ulysses, ring, frames):
        assert got.keys() == ref.keys()
        for k in ref:
            # float32: the split sums each parameter's gradient over tokens in per-rank partial sums
            # plus an all-reduce, and attention's softmax through LSE merges; relative 1e-4 of the
            # largest entry covers that reassociation (observed ~1e-6) while a dropped shard, token
            # or head (errors of order the gradient itself) fails.
            scale = float(ref[k].abs().max()) + 1e-12
            err = float((got[k] - ref[k]).abs().max()) / scale
            assert err < 1e-4, f"{k}: relative error {err:.2e}"


def test_wan_dit_refuses_heads_not_divisible() -> None:
    with pytest.raises(ValueError, match=r"4 attention heads cannot be split over ulysses=3"):
        _wan_stage().check_sequence_parallel(3, 1)
