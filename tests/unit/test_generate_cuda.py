"""``mmpipe generate device=cuda``'s path on a GPU: the tiny preset pipeline placed with
``place_graph`` (bf16 text encoder and DiT, fp32-kept modules and VAE float32), its
``T2VGraph.generate`` against ``WanPipeline.__call__`` on the very same modules and seed."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from mmpipe.config import ModelConfig
from mmpipe.data import caption_vocabulary
from mmpipe.kernels import registry as kernels
from mmpipe.models.wan import build_tiny_wan_pipeline, from_diffusers, place_graph, place_module
from mmpipe.runtime.trained import apply_kernels

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

CALL = dict(
    prompt="a red circle moving left",
    negative_prompt="blurry static",
    height=32,
    width=48,
    num_frames=9,
    num_inference_steps=4,
    guidance_scale=5.0,
)


def _pipeline() -> object:
    pipe = build_tiny_wan_pipeline(ModelConfig(), [*caption_vocabulary(), "blurry static"], seed=0)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _diffusers(pipe: object) -> np.ndarray:
    return pipe(**CALL, generator=torch.Generator().manual_seed(7), output_type="np").frames  # type: ignore[operator]


def test_generate_on_cuda_matches_wan_pipeline_bitwise() -> None:
    """The stock kernels: the same modules and the same ops in the same order on one GPU, so
    diffusers' frames exactly (cuBLAS and SDPA forwards are run-to-run deterministic)."""
    pipe = _pipeline()
    graph = place_graph(from_diffusers(pipe), "cuda")  # also puts the shared modules in eval mode
    assert graph.denoise.module.dtype == graph.text.module.dtype == torch.bfloat16
    assert graph.decode.module.dtype == torch.float32 and graph.denoise.device().type == "cuda"
    ref = _diffusers(pipe)
    ours = graph.generate(**CALL, seed=7, progress=False)
    assert ours.shape == ref.shape == (1, 9, 32, 48, 3)
    assert np.array_equal(ours, ref)
    assert ref.std() > 0.01  # not a constant image that would match trivially


def test_generate_with_cuda_kernels_stays_within_bf16_error_of_wan_pipeline() -> None:
    """The default on CUDA (``model.kernels`` ``auto``: mmpipe's Triton kernels) against diffusers' own
    processors. The kernels accumulate in float32 but round to bf16 at other points than the stock
    ops, so activations differ by about one bf16 ulp (2^-8 relative); 4 guided steps (guidance 5
    amplifies the cond - uncond difference) and the decode carry that to the pixels. The yardstick is
    bf16's own error: the same pipeline in float32. On CPU (Triton interpreted) the kernels' MSE to
    diffusers was 0.55x that of bf16 diffusers to float32 (PSNR 49.7 vs 47.2 dB); 2x is the bound."""
    fp32 = _pipeline()
    for name in ("text_encoder", "transformer", "vae"):
        place_module(getattr(fp32, name).eval(), "cuda")
    exact = _diffusers(fp32)
    pipe = _pipeline()
    graph = place_graph(from_diffusers(pipe), "cuda")
    ref = _diffusers(pipe)  # before use_kernels changes the shared DiT
    choice = kernels.resolve(kernels.KernelChoice(**dataclasses.asdict(ModelConfig().kernels)), "cuda")
    assert choice == kernels.KernelChoice(attention="triton", norm_modulate="triton", rope="triton")
    apply_kernels(graph, choice)
    ours = graph.generate(**CALL, seed=7, progress=False)
    bf16_mse = float(np.mean((ref.astype(np.float64) - exact) ** 2))
    ours_mse = float(np.mean((ours.astype(np.float64) - ref) ** 2))
    assert 0 < bf16_mse and ours_mse <= 2 * bf16_mse, (ours_mse, bf16_mse)
    assert np.abs(ours - ref).max() <= 0.25  # no region off by a visible amount (CPU: 0.067)
