"""Keep-everything against mmpipe's auto activation policy, side by side, under one memory cap.

A Wan-architecture DiT stage (random weights, ``--layers`` blocks of ``--heads`` x 32 dims) trains
on latents of growing length (latent frames of 32 x 32: 256 tokens a frame). A length
*fits* a cap when a real training step's resident saved activations (counted by saved-tensor hooks,
``mmpipe.memory.policy.count_saved_bytes``) plus 16 bytes a parameter (weights, gradients, Adam
moments) stay under it. Keep-everything runs as is; auto asks the budget planner
(``mmpipe.memory.budget.choose_policies``, costs from the meta device) for the cheapest per-block
policy under the cap, runs it (recompute and/or the file tier) and checks it the same way.

Printed: the longest length that fits each way and their ratio, and the step-time overhead of the
policy auto needs at its longest length, applied at the longest length keep fits (both run there):
``t(policy) / t(keep) - 1``, medians of ``--reps`` steps after a warm-up one (a run's steps share
their rank's file tier, whose spill file reaches its size in the first step); and the same ratio at
auto's longest length, where keep-everything runs without the cap (``overhead_at_max_len_auto``). The cap defaults to what keep-everything
needs at ``--cap-frames`` latent frames. The last stdout line is one JSON object.

    python benchmarks/memory.py              # CPU, file tier, about a minute
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from diffusers import WanTransformer3DModel

from mmpipe.memory.budget import FILE_TIER_BYTES_PER_S, BlockPricing, choose_policies
from mmpipe.memory.policy import BlockPolicy, FileTier, apply_block_policies, count_saved_bytes
from mmpipe.sched.cost import measure_stage_cost
from mmpipe.stages._source import ModuleSource
from mmpipe.stages.dit import WanDiTFlowMatchingStage

GRID = 32  # latent height and width: 16 x 16 = 256 tokens a frame after 2 x 2 patches


def build_stage(layers: int, heads: int) -> WanDiTFlowMatchingStage:
    torch.manual_seed(0)
    module = WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=heads, attention_head_dim=32, in_channels=16, out_channels=16,
        text_dim=64, freq_dim=64, ffn_dim=4 * heads * 32, num_layers=layers, cross_attn_norm=True,
        qk_norm="rms_norm_across_heads", rope_max_seq_len=1024,
    )  # fmt: skip
    return WanDiTFlowMatchingStage("dit", ModuleSource.from_module(module), shift=3.0)


def inputs(frames: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return {
        "latents": torch.randn(1, 16, frames, GRID, GRID, generator=gen),
        "context": torch.randn(1, 16, 64, generator=gen),
    }


_TIERS: dict[Path, FileTier] = {}


def step(layers: int, heads: int, frames: int, policies: list[BlockPolicy] | None, spill: Path) -> tuple[int, float]:
    """(resident saved bytes, seconds) of one forward + backward with ``policies`` (None: keep). Steps
    share one file tier per spill directory, as a run's steps share their rank's."""
    stage = build_stage(layers, heads)
    if policies is not None:
        tier = _TIERS.setdefault(spill, FileTier(spill))
        apply_block_policies(list(stage.module.blocks), policies, tier=tier)  # type: ignore[union-attr]
    start = time.perf_counter()
    with count_saved_bytes() as held:
        loss = stage.forward(stage.module, inputs(frames), seed=0)["loss"]
    loss.backward()
    return held[0], time.perf_counter() - start


def fixed_bytes(layers: int, heads: int) -> int:
    return 16 * sum(p.numel() for p in build_stage(layers, heads).module.parameters())


def auto_choice(layers: int, heads: int, frames: int, cap: int) -> Any:
    stage = build_stage(layers, heads)
    shapes = {k: (tuple(v.shape), v.dtype) for k, v in inputs(frames).items()}
    cost = measure_stage_cost(stage, shapes, dtype=torch.float32, seed=0)
    pricing = BlockPricing.from_cost(cost, flops_per_s=5e10, offload_bytes_per_s=FILE_TIER_BYTES_PER_S)
    return choose_policies(pricing, budget_bytes=cap, inflight=1, fixed_bytes=fixed_bytes(layers, heads))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--cap-frames", type=int, default=2, help="the cap: what keep needs at this many frames")
    parser.add_argument("--max-frames", type=int, default=16)
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    spill = Path(tempfile.mkdtemp(prefix="mmpipe-bench-spill-"))
    fixed = fixed_bytes(args.layers, args.heads)
    cap = step(args.layers, args.heads, args.cap_frames, None, spill)[0] + fixed
    max_keep = max_auto = 0
    chosen: dict[int, Any] = {}
    for frames in range(1, args.max_frames + 1):
        keep_held, _ = step(args.layers, args.heads, frames, None, spill)
        if keep_held + fixed <= cap:
            max_keep = frames
        try:
            choice = auto_choice(args.layers, args.heads, frames, cap)
        except ValueError:
            break  # longer sequences need more than the cap even with every block recomputed / offloaded
        held, _ = step(args.layers, args.heads, frames, choice.policies(), spill)
        print(f"frames {frames:3d} ({frames * 256} tokens): keep {(keep_held + fixed) / 2**20:7.1f} MiB, auto "
              f"{(held + fixed) / 2**20:7.1f} MiB with {choice.recompute} recomputed / {choice.offload} offloaded "
              f"(cap {cap / 2**20:.1f} MiB)", flush=True)  # fmt: skip
        if held + fixed <= cap:
            max_auto, chosen[frames] = frames, choice
    assert max_keep >= 1 and max_auto >= max_keep
    policy = chosen[max_auto].policies()

    def median_s(frames: int, policies: list[BlockPolicy] | None) -> float:
        step(args.layers, args.heads, frames, policies, spill)  # warm-up: the spill file grows to size once
        return statistics.median(step(args.layers, args.heads, frames, policies, spill)[1] for _ in range(args.reps))

    keep_t, auto_t = median_s(max_keep, None), median_s(max_keep, policy)
    # and at auto's longest length against keep-everything run there without the cap
    long_keep_t, long_auto_t = median_s(max_auto, None), median_s(max_auto, policy)
    tokens = 256  # a latent frame's tokens: (GRID / 2) ** 2
    result = {
        "device": "cpu",
        "cap_mib": round(cap / 2**20, 1),
        "max_len_keep": max_keep * tokens,
        "max_len_auto": max_auto * tokens,
        "max_len_ratio": round(max_auto / max_keep, 3),
        "auto_policy": {
            "recompute": chosen[max_auto].recompute,
            "offload": chosen[max_auto].offload,
            "blocks": args.layers,
        },
        "overhead_at_len": max_keep * tokens,
        "keep_step_s": round(keep_t, 4),
        "auto_step_s": round(auto_t, 4),
        "overhead": round(auto_t / keep_t - 1, 4),
        "overhead_at_max_len_auto": round(long_auto_t / long_keep_t - 1, 4),  # keep there ignores the cap
    }
    for tier in _TIERS.values():
        tier.close()
    shutil.rmtree(spill, ignore_errors=True)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
