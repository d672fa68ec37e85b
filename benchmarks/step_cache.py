"""Step caching (``cache.policy``, ``mmpipe.stages.cache``) against the uncached model, on CPU.

    python benchmarks/step_cache.py                 # 20 steps, guidance 5, 5 rounds (~2-3 min on 2 cores)
    python benchmarks/step_cache.py --steps 30 --repeats 3 --extra first_block=0.3,mag=0.12

Model: Wan 2.1 T2V 1.3B's DiT architecture shrunk to run in seconds on a CPU (random weights,
float32): head width 128, text width 4096, frequency width 256 and the FFN ratio kept; 2 heads instead
of 12 (width 256), 8 blocks instead of 30; latents 1 x 16 x 3 x 16 x 16 (192 tokens). Loop: UniPC
flow matching (shift 3, as mmpipe's Wan pipelines) with classifier-free guidance, each branch called
as ``transformer(hidden_states=..., timestep=..., encoder_hidden_states=..., return_dict=False)``
inside ``transformer.cache_context("cond" | "uncond", step_index=i, num_inference_steps=S)``, as
diffusers' ``WanPipeline`` calls it.

Baseline: the same loop on the same model with no cache installed ("uncached, same loop"). Each
round runs the baseline and every policy at its default threshold (the order rotated each round, the
cache installed and reset outside the timed region); per round, speedup = baseline seconds / policy
seconds; reported: the median of those per-round ratios and their range [min, max], never a ratio of
medians. ``computed_calls``: transformer calls whose whole block stack ran (counted by a hook on the
last block's FFN, which runs only then) out of ``total_calls`` (steps x 2 branches). ``psnr_db``:
PSNR of the policy's final latents against the baseline's, same seed, in latent space (not decoded),
peak = the baseline latents' range (max - min); null where they are bitwise equal. ``mag`` has no
published ratios for this shrunk architecture: they are calibrated first by one untimed uncached run
of the same loop on another seed (``calibrate_mag_ratios``, seed + 1); ``teacache`` has no published fit for it either and runs
uncalibrated (identity polynomial). With random weights the residuals do not evolve as a trained
model's do, so how often each policy skips, and its PSNR, say little about a real checkpoint; the
latency of a skipped step and the bookkeeping overhead are what this measures. On this random
model ``first_block`` and ``teacache`` skip nothing at their defaults (its first-block residual
changes by ~0.38 a step, its timestep projection by ~0.6, where trained models change by a few
percent), so ``--extra`` (default ``first_block=0.5,teacache=1.5``) adds rows at thresholds picked
to make this model skip: they show the cost of skipped steps, not settings to use.

``--threads`` defaults to 1: on a machine whose 2 cores other processes share, two intra-op threads
spin against them and the timings scatter (about 0.1 s vs 0.8 s per call here); pass 2 on an idle one.

The last stdout line is one JSON object: ``{"model", "loop", "baseline", "baseline_latency_s",
"policies": [{"policy", "default_threshold", "threshold", "calibration", "latency_s_median", "latency_s", "speedup_median",
"speedup_range", "computed_calls", "total_calls", "psnr_db", "max_abs_diff"}, ...], "threads",
"repeats", "wall_s"}``.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
import warnings
from typing import Any

import torch
from diffusers import UniPCMultistepScheduler, WanTransformer3DModel

from mmpipe.stages.cache import (
    CacheConfig,
    apply_cache,
    calibrate_mag_ratios,
    installed_cache,
    remove_cache,
    reset_cache,
)

POLICIES = ("none", "first_block", "teacache", "mag")
LATENT_SHAPE = (1, 16, 3, 16, 16)
TEXT_TOKENS, TEXT_DIM = 32, 4096


def build_dit(layers: int) -> WanTransformer3DModel:
    """Wan 2.1 1.3B's DiT config (head 128, FFN ~5.8x width, text 4096, freq 256) at 2 heads."""
    torch.manual_seed(0)
    return WanTransformer3DModel(
        patch_size=(1, 2, 2),
        num_attention_heads=2,
        attention_head_dim=128,
        in_channels=16,
        out_channels=16,
        text_dim=TEXT_DIM,
        freq_dim=256,
        ffn_dim=1536,
        num_layers=layers,
        cross_attn_norm=True,
        qk_norm="rms_norm_across_heads",
        eps=1e-6,
    ).eval()


@torch.no_grad()
def denoise(dit: WanTransformer3DModel, steps: int, guidance: float, seed: int) -> torch.Tensor:
    """One generation: UniPC flow matching, guidance on, each branch in its cache context."""
    g = torch.Generator().manual_seed(seed)
    latents = torch.randn(*LATENT_SHAPE, generator=g)
    context = {b: torch.randn(1, TEXT_TOKENS, TEXT_DIM, generator=g) for b in ("cond", "uncond")}
    scheduler = UniPCMultistepScheduler(
        prediction_type="flow_prediction", use_flow_sigmas=True, num_train_timesteps=1000, flow_shift=3.0
    )
    scheduler.set_timesteps(steps)
    for i, t in enumerate(scheduler.timesteps):
        pred = {}
        for branch, ctx in context.items():
            with dit.cache_context(branch, step_index=i, num_inference_steps=steps):
                pred[branch] = dit(
                    hidden_states=latents, timestep=t.expand(1), encoder_hidden_states=ctx, return_dict=False
                )[0]
        velocity = pred["uncond"] + guidance * (pred["cond"] - pred["uncond"])
        latents = scheduler.step(velocity, t, latents, return_dict=False)[0]
    return latents


def psnr_db(out: torch.Tensor, ref: torch.Tensor) -> float | None:
    mse = (out - ref).double().pow(2).mean().item()
    peak = (ref.max() - ref.min()).item()
    return None if mse == 0 else round(10 * math.log10(peak**2 / mse), 2)


def timed_run(dit: WanTransformer3DModel, args: argparse.Namespace) -> tuple[float, torch.Tensor]:
    reset_cache(dit)
    start = time.perf_counter()
    out = denoise(dit, args.steps, args.guidance, args.seed)
    return time.perf_counter() - start, out


def parse_extra(text: str) -> list[tuple[str, float]]:
    """``policy=threshold,...`` -> [(policy, threshold), ...]."""
    pairs = [item.split("=") for item in text.split(",") if item]
    return [(policy, float(threshold)) for policy, threshold in pairs]


def run_round(
    dit: WanTransformer3DModel, variants: dict[str, CacheConfig], r: int, args: argparse.Namespace, computed: list[int]
) -> dict[str, tuple[float, torch.Tensor, int, Any]]:
    """The baseline and every variant once, in an order rotated by ``r``: name -> (seconds, final
    latents, calls computed, what was installed)."""
    order = ["uncached", *variants]
    order = order[r % len(order) :] + order[: r % len(order)]
    runs = {}
    for name in order:
        if name != "uncached":
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # teacache: uncalibrated on this architecture (said above)
                apply_cache(dit, variants[name])
        installed = installed_cache(dit)
        computed[0] = 0
        seconds, out = timed_run(dit, args)
        remove_cache(dit)
        runs[name] = (seconds, out, computed[0], installed)
        print(f"round {r}: {name:18s} {seconds:.2f} s, {computed[0]} calls computed", file=sys.stderr)
    return runs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--guidance", type=float, default=5.0)
    parser.add_argument("--repeats", type=int, default=5, help="rounds (each: the baseline and every variant)")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--extra", default="first_block=0.5,teacache=1.5", help="policy=threshold rows to add")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    wall = time.perf_counter()

    dit = build_dit(args.layers)
    computed = [0]
    dit.blocks[-1].ffn.register_forward_hook(lambda *_: computed.__setitem__(0, computed[0] + 1))
    timed_run(dit, args)  # warm-up: allocator, first-call dispatch
    # Calibrated on another seed (noise and context) than the one measured: out of sample, as in use.
    mag_ratios = calibrate_mag_ratios(dit, lambda: denoise(dit, args.steps, args.guidance, args.seed + 1))
    rows = [(p, None) for p in POLICIES] + parse_extra(args.extra)
    variants = {
        p if t is None else f"{p}@{t:g}": CacheConfig(
            policy=p, threshold=t, num_inference_steps=args.steps, mag_ratios=mag_ratios if p == "mag" else None
        )
        for p, t in rows
    }

    rounds = [run_round(dit, variants, r, args, computed) for r in range(args.repeats)]
    ref = rounds[0]["uncached"][1]
    assert all(torch.equal(runs["uncached"][1], ref) for runs in rounds), "the uncached loop is not deterministic"
    results = []
    for name, config in variants.items():
        seconds = [runs[name][0] for runs in rounds]
        speedup = [runs["uncached"][0] / runs[name][0] for runs in rounds]
        _, out, calls, installed = rounds[-1][name]
        results.append(
            {
                "policy": str(config.policy),
                "default_threshold": config.threshold is None,
                "threshold": None if installed is None else installed.threshold,
                "calibration": None if installed is None else installed.calibration,
                "latency_s_median": round(statistics.median(seconds), 3),
                "latency_s": [round(t, 3) for t in seconds],
                "speedup_median": round(statistics.median(speedup), 3),
                "speedup_range": [round(min(speedup), 3), round(max(speedup), 3)],
                "computed_calls": calls,
                "total_calls": 2 * args.steps,
                "psnr_db": psnr_db(out, ref),
                "max_abs_diff": (out - ref).abs().max().item(),
            }
        )
    summary = {
        "model": f"Wan2.1-1.3B DiT shrunk: 2 heads x 128, {args.layers} blocks, FFN 1536, random weights, float32",
        "latents": list(LATENT_SHAPE),
        "loop": f"UniPC flow matching, {args.steps} steps, guidance {args.guidance} (cond + uncond calls per step)",
        "baseline": "uncached, same loop",
        "baseline_latency_s": [round(runs["uncached"][0], 3) for runs in rounds],
        "psnr_space": "latent (final latents, not decoded); peak = baseline range",
        "policies": results,
        "threads": args.threads,
        "repeats": args.repeats,
        "wall_s": round(time.perf_counter() - wall, 1),
    }
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
