"""Keep-everything against mmpipe's auto activation policy, side by side, under one memory cap.

A Wan-architecture DiT stage (random weights, ``--layers`` blocks of ``--heads`` x ``--head-dim``)
trains on latents of growing length (latent frames of 32 x 32: 256 tokens a frame). A length
*fits* a cap when a real training step's resident saved activations (counted by saved-tensor hooks,
``mmpipe.memory.policy.count_saved_bytes``) plus 16 bytes a parameter (weights, gradients, Adam
moments) stay under it. Keep-everything runs as is; auto asks the budget planner
(``mmpipe.memory.budget.choose_policies``, costs from the meta device) for the cheapest per-block
policy under the cap, runs it (recompute and/or offload) and checks it the same way. Offload goes
to the file tier on CPU and to pinned host memory (``HostTier``: side-stream copies, prefetch in
the backward) on CUDA.

Printed: the longest length that fits each way and their ratio, and step-time overheads
``t(policy) / t(keep) - 1``, medians of ``--reps`` steps of each, interleaved (keep, policy, keep,
...) after a warm-up step of each, so that both see the same machine:

- ``overhead``: at the longest length both fit (keep's longest), auto as a run with this cap gets
  it: the policy the planner chooses for that length (at the cap's edge it still recomputes or
  offloads what its estimate says does not fit);
- ``overhead_longest_policy``: at the same length, the policy auto needs at its *longest* length
  (a stress figure: a run planned for long sequences that meets short ones; compute shrinks with
  the length faster than the bytes the policy moves, so offloading costs most there);
- ``overhead_at_max_len_auto``: at auto's longest length, its policy against keep-everything run
  there without the cap (what fitting that length costs).

The cap
defaults to what keep-everything needs at ``--cap-frames`` latent frames; lengths are swept every
``--frame-step`` frames. ``--curve`` adds, at keep's longest length, the overhead of the policy auto
chose for each longer length (what each multiple of the length costs) and of a recomputation-only
policy for auto's longest length (what the offload tier saves or costs). The last stdout line is
one JSON object.

    python benchmarks/memory.py                  # CPU, float32, file tier, about two minutes on 2 cores
    # GPU, bf16, pinned host tier, 12 heads x 128; a cap at 16k tokens (64 frames), where a step is
    # bound by the GPU's compute rather than by launching kernels (at 2k tokens it is: ~50 ms a step)
    python benchmarks/memory.py --device cuda --cap-frames 64 --max-frames 192 --frame-step 32 --reps 5 --curve
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import functools
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from diffusers import WanTransformer3DModel
from diffusers.utils import logging as diffusers_logging

from mmpipe.memory.budget import FILE_TIER_BYTES_PER_S, BlockPricing, choose_policies
from mmpipe.memory.host import HostTier
from mmpipe.memory.policy import BlockPolicy, apply_block_policies, count_saved_bytes
from mmpipe.memory.tiers import FileTier, Tier
from mmpipe.sched.cost import measure_stage_cost
from mmpipe.stages._source import ModuleSource
from mmpipe.stages.dit import WanDiTFlowMatchingStage

GRID = 32  # latent height and width: 16 x 16 = 256 tokens a frame after 2 x 2 patches
TOKENS = (GRID // 2) ** 2


@dataclasses.dataclass(frozen=True)
class Setup:
    """The model, the device and how the planner prices the device's compute and offload tier."""

    layers: int
    heads: int
    head_dim: int
    device: torch.device
    dtype: torch.dtype
    flops_per_s: float
    offload_bytes_per_s: float
    overlap: bool  # the tier's copies run beside compute (a side stream)

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"


@functools.cache
def pristine(setup: Setup) -> torch.nn.Module:
    """The model, built once per setup: randomly initialising the 300M-parameter GPU configuration
    takes seconds, and the benchmark runs a few hundred steps, each on a fresh copy."""
    torch.manual_seed(0)
    width = setup.heads * setup.head_dim
    module = WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=setup.heads, attention_head_dim=setup.head_dim,
        in_channels=16, out_channels=16, text_dim=64, freq_dim=64, ffn_dim=4 * width,
        num_layers=setup.layers, cross_attn_norm=True, qk_norm="rms_norm_across_heads", rope_max_seq_len=1024,
    )  # fmt: skip
    module.to(device=setup.device)
    if setup.dtype != torch.float32:
        module.to(dtype=setup.dtype)  # all of it (diffusers warns that it keeps norms in fp32 when loading)
    return module.requires_grad_(False)  # never trained itself: only its copies are


def build_stage(setup: Setup) -> WanDiTFlowMatchingStage:
    """A fresh stage (its own copy of the weights, no block policies applied yet)."""
    module = copy.deepcopy(pristine(setup)).requires_grad_(True)
    return WanDiTFlowMatchingStage("dit", ModuleSource.from_module(module), shift=3.0)


def inputs(setup: Setup, frames: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    raw = {
        "latents": torch.randn(1, 16, frames, GRID, GRID, generator=gen),
        "context": torch.randn(1, 16, 64, generator=gen),
    }
    return {k: v.to(device=setup.device, dtype=setup.dtype) for k, v in raw.items()}


def sync(setup: Setup) -> None:
    if setup.cuda:
        torch.cuda.synchronize(setup.device)


def step(setup: Setup, frames: int, policies: list[BlockPolicy] | None, tier: Tier) -> tuple[int, float]:
    """(resident saved bytes, seconds) of one forward + backward with ``policies`` (None: keep). Steps
    share one tier, as a run's steps share their rank's."""
    stage = build_stage(setup)
    if policies is not None:
        apply_block_policies(list(stage.module.blocks), policies, tier=tier)  # type: ignore[union-attr]
    batch = inputs(setup, frames)
    sync(setup)
    start = time.perf_counter()
    with count_saved_bytes() as held:
        loss = stage.forward(stage.module, batch, seed=0)["loss"]
    loss.backward()
    sync(setup)
    return held[0], time.perf_counter() - start


def fixed_bytes(setup: Setup) -> int:
    return 16 * sum(p.numel() for p in pristine(setup).parameters())


def auto_choice(setup: Setup, frames: int, cap: int, *, offload: bool = True) -> Any:
    """The planner's choice at ``frames`` under ``cap`` (``offload=False``: recomputation only)."""
    stage = build_stage(setup)
    shapes = {k: (tuple(v.shape), v.dtype) for k, v in inputs(setup, frames).items()}
    cost = measure_stage_cost(stage, shapes, dtype=setup.dtype, seed=0)
    # On a GPU the copies overlap the blocks' forward and backward (3x the forward's FLOPs)
    hidden = 3 * cost.block_flops / setup.flops_per_s if setup.overlap else 0.0
    pricing = BlockPricing.from_cost(
        cost, flops_per_s=setup.flops_per_s, offload_bytes_per_s=setup.offload_bytes_per_s, hidden_s=hidden
    )
    return choose_policies(pricing, budget_bytes=cap, inflight=1, fixed_bytes=fixed_bytes(setup), offload=offload)


def counts(choice: Any) -> dict[str, int]:
    return {"recompute": choice.recompute, "offload": choice.offload, "blocks": choice.blocks}


def interleaved_medians(
    setup: Setup, frames: int, policies: list[BlockPolicy], tier: Tier, reps: int
) -> tuple[float, float]:
    """Median step seconds of keep-everything and of ``policies`` at ``frames``, run alternately."""
    step(setup, frames, None, tier)  # warm-up of each (the tier's spill file grows to size once)
    step(setup, frames, policies, tier)
    keep, policy = [], []
    for _ in range(reps):
        keep.append(step(setup, frames, None, tier)[1])
        policy.append(step(setup, frames, policies, tier)[1])
    return statistics.median(keep), statistics.median(policy)


def make_setup(args: argparse.Namespace) -> Setup:
    device = torch.device(args.device)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit("--device cuda: no CUDA device is visible")
        return Setup(
            layers=args.layers, heads=args.heads or 12, head_dim=args.head_dim or 128, device=device,
            dtype=torch.bfloat16, flops_per_s=989e12 * 0.45, offload_bytes_per_s=5e10, overlap=True,
        )  # fmt: skip
    return Setup(
        layers=args.layers, heads=args.heads or 4, head_dim=args.head_dim or 32, device=device,
        dtype=torch.float32, flops_per_s=5e10, offload_bytes_per_s=FILE_TIER_BYTES_PER_S, overlap=False,
    )  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu", help="cpu (file tier) or cuda (pinned host tier)")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--heads", type=int, default=0, help="default: 4 on CPU, 12 on CUDA")
    parser.add_argument("--head-dim", type=int, default=0, help="default: 32 on CPU, 128 on CUDA")
    parser.add_argument("--cap-frames", type=int, default=2, help="the cap: what keep needs at this many frames")
    parser.add_argument("--max-frames", type=int, default=16)
    parser.add_argument("--frame-step", type=int, default=1, help="latent frames between the lengths swept")
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument(
        "--curve",
        action="store_true",
        help="also time, at keep's longest length, the policy auto chose at each longer length it fits, and a "
        "recomputation-only policy for auto's longest length (how the overhead grows with the length bought)",
    )
    args = parser.parse_args()
    if args.frame_step < 1 or args.cap_frames < 1 or args.max_frames < args.cap_frames:
        raise SystemExit(
            f"--frame-step {args.frame_step}, --cap-frames {args.cap_frames}, --max-frames {args.max_frames}: "
            "need steps and a cap of at least one frame and --max-frames >= --cap-frames"
        )
    diffusers_logging.set_verbosity_error()
    setup = make_setup(args)
    spill = Path(tempfile.mkdtemp(prefix="mmpipe-bench-spill-"))
    tier: Tier = HostTier() if setup.cuda else FileTier(spill)
    fixed = fixed_bytes(setup)
    cap = step(setup, args.cap_frames, None, tier)[0] + fixed
    max_keep = max_auto = 0
    chosen: dict[int, Any] = {}
    lengths = sorted({*range(args.frame_step, args.max_frames + 1, args.frame_step), args.cap_frames})
    for frames in lengths:
        keep_held, _ = step(setup, frames, None, tier)
        if keep_held + fixed <= cap:
            max_keep = frames
        try:
            choice = auto_choice(setup, frames, cap)
        except ValueError:
            break  # longer sequences need more than the cap even with every block recomputed / offloaded
        held, _ = step(setup, frames, choice.policies(), tier)
        print(f"frames {frames:3d} ({frames * TOKENS} tokens): keep {(keep_held + fixed) / 2**20:7.1f} MiB, auto "
              f"{(held + fixed) / 2**20:7.1f} MiB with {choice.recompute} recomputed / {choice.offload} offloaded "
              f"(cap {cap / 2**20:.1f} MiB)", flush=True)  # fmt: skip
        if held + fixed <= cap:
            max_auto, chosen[frames] = frames, choice
    assert max_keep >= 1 and max_auto >= max_keep
    keep_t, auto_t = interleaved_medians(setup, max_keep, chosen[max_keep].policies(), tier, args.reps)
    print(f"auto's own policy at {max_keep * TOKENS} tokens: {auto_t / keep_t - 1:+.1%}", flush=True)
    policy = chosen[max_auto].policies()
    stress_keep_t, stress_t = interleaved_medians(setup, max_keep, policy, tier, args.reps)
    print(
        f"policy for {max_auto * TOKENS} tokens at {max_keep * TOKENS}: {stress_t / stress_keep_t - 1:+.1%}", flush=True
    )
    # and at auto's longest length against keep-everything run there without the cap
    long_keep_t, long_auto_t = interleaved_medians(setup, max_auto, policy, tier, args.reps)
    extra: dict[str, Any] = {}
    if args.curve:
        curve = []
        for frames, choice in sorted(chosen.items()):
            if max_keep < frames < max_auto:  # (auto's longest is the headline figure above)
                k, a = interleaved_medians(setup, max_keep, choice.policies(), tier, args.reps)
                curve.append({"len": frames * TOKENS, "policy": counts(choice), "overhead": round(a / k - 1, 4)})
                print(f"policy for {frames * TOKENS} tokens at {max_keep * TOKENS}: {a / k - 1:+.1%}", flush=True)
        extra["overhead_curve"] = curve
        try:
            plain = auto_choice(setup, max_auto, cap, offload=False)
        except ValueError as err:
            extra["recompute_only"] = {"fits": False, "why": str(err)}
        else:
            k, a = interleaved_medians(setup, max_keep, plain.policies(), tier, args.reps)
            extra["recompute_only"] = {"policy": counts(plain), "overhead": round(a / k - 1, 4)}
    result = {
        "device": torch.cuda.get_device_name(setup.device) if setup.cuda else "cpu",
        "tier": type(tier).__name__,
        "dtype": str(setup.dtype).removeprefix("torch."),
        "model": {"layers": setup.layers, "heads": setup.heads, "head_dim": setup.head_dim},
        "cap_mib": round(cap / 2**20, 1),
        "max_len_keep": max_keep * TOKENS,
        "max_len_auto": max_auto * TOKENS,
        "max_len_ratio": round(max_auto / max_keep, 3),
        "auto_policy": counts(chosen[max_auto]),
        "overhead_at_len": max_keep * TOKENS,
        "overhead_policy": counts(chosen[max_keep]),
        "keep_step_s": round(keep_t, 4),
        "auto_step_s": round(auto_t, 4),
        "overhead": round(auto_t / keep_t - 1, 4),
        "overhead_longest_policy": round(stress_t / stress_keep_t - 1, 4),
        "overhead_at_max_len_auto": round(long_auto_t / long_keep_t - 1, 4),  # keep there ignores the cap
        "offloaded_bytes": tier.stats.offloaded_bytes,
        "prefetched_bytes": tier.stats.prefetched_bytes,
    } | extra
    tier.close()
    shutil.rmtree(spill, ignore_errors=True)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
