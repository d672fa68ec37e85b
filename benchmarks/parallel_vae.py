"""Frame-parallel Wan VAE decode on CPU: one process (2 threads, then 1) against 2 gloo processes of
1 thread each (``mmpipe.parallel.vae.parallel_wan_decode``).

The VAE is Wan 2.1's architecture (diffusers' ``AutoencoderKLWan`` defaults: base_dim 96, z_dim 16,
num_res_blocks 2) with random weights, float32; the latents are seeded noise scaled by the VAE's
latent statistics (as ``WanPipeline`` de-normalises them) for ``--frames`` video frames at
``--size`` x ``--size`` pixels. Each repeat runs, in order: the whole decode on rank 0 with 2
threads and with 1 (rank 1 waits in a barrier), then the 2-rank parallel decode for each halo: the
exact one (the decoder's receptive field, 38 latent frames for this architecture) and each
``--approx-halo`` (shorter: faster and approximate), then the split by row bands
(``mmpipe.parallel.vae_patch``: exact, no halo of frames). A parallel time is rank 0's wall time from a
barrier to the gathered video (the gather waits for the slower rank). Ratios are whole / parallel
per repeat (above 1: the parallel decode is faster), reported as the median and range over repeats;
the error is the largest absolute difference of the gathered video from the whole decode over all
repeats. The first repeat is a warm-up (oneDNN builds its kernels) and is not reported.

Random weights say nothing about how fast a decoder forgets, so the error of a shorter halo is also
measured on trained weights (``error_vs_halo``): the packaged moving-shapes VAE (Wan 2.1's block
structure at width 8, ``num_res_blocks=1``: receptive field 30), on the latents it encodes from two
held-out moving-shapes clips of ``--curve-frames`` frames at 64 x 64, decoding the last two latent
frames with each halo against the whole decode (max and RMS absolute error; video in [-1, 1]).

    python benchmarks/parallel_vae.py            # about 3 minutes on 2 cores
    python benchmarks/parallel_vae.py --quick    # smoke run, under a minute

A table goes to stderr; the last line of stdout is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from typing import Any

import torch
import torch.distributed as dist
from diffusers.models.autoencoders.autoencoder_kl_wan import AutoencoderKLWan

from mmpipe.data.shapes import MovingShapesDataset
from mmpipe.models.shapes_vae import HELD_OUT_SEED, load_shapes_vae
from mmpipe.parallel.vae import (
    decode_frame_range,
    parallel_wan_decode,
    plan_frame_ranges,
    wan_decode_receptive_field,
)
from mmpipe.parallel.vae_patch import patch_parallel_wan_decode
from mmpipe.runtime import procs
from mmpipe.runtime.inference import launch_ranks

WORLD = 2


def build_inputs(frames: int, size: int) -> tuple[AutoencoderKLWan, torch.Tensor]:
    """The same random VAE and latents in every process."""
    torch.manual_seed(0)
    vae = AutoencoderKLWan().eval()
    z = vae.config.z_dim
    gen = torch.Generator().manual_seed(1)
    noise = torch.randn(1, z, 1 + (frames - 1) // 4, size // 8, size // 8, generator=gen)
    std = torch.tensor(vae.config.latents_std).view(1, z, 1, 1, 1)
    mean = torch.tensor(vae.config.latents_mean).view(1, z, 1, 1, 1)
    return vae, noise * std + mean


def _seconds(fn: Any) -> tuple[float, torch.Tensor]:
    start = time.perf_counter()
    out = fn()
    return time.perf_counter() - start, out


@torch.inference_mode()
def run_rank(rank: int, world: int, args: argparse.Namespace, phase: Any) -> dict[str, Any]:
    """Every repeat's times (rank 0's) and the largest error per halo. ``phase``: a multiprocessing
    barrier that holds rank 1 while rank 0 decodes alone; not a gloo barrier, whose wait polls a
    core and would slow rank 0's 2-thread decode several times over."""
    torch.set_num_threads(1)
    vae, z = build_inputs(args.frames, args.size)
    field = wan_decode_receptive_field(vae)
    halos = [field, *args.approx_halo]
    times: dict[str, list[float]] = {}
    errors = dict.fromkeys(halos, 0.0)
    for repeat in range(1 + args.repeats):
        if rank == 0:
            for threads in (2, 1):
                torch.set_num_threads(threads)
                seconds, whole = _seconds(lambda: vae.decode(z).sample)
                times.setdefault(f"whole_{threads}t", []).append(seconds)
            torch.set_num_threads(1)
        phase.wait()
        for halo in halos:
            dist.barrier()
            seconds, got = _seconds(lambda halo=halo: parallel_wan_decode(vae, z, dist.group.WORLD, halo=halo))
            times.setdefault(f"halo_{halo}", []).append(seconds)
            if rank == 0:
                errors[halo] = max(errors[halo], float((got - whole).abs().max()))
        dist.barrier()  # the split by row bands (mmpipe.parallel.vae_patch), exact
        seconds, got = _seconds(lambda: patch_parallel_wan_decode(vae, z, dist.group.WORLD))
        times.setdefault("rows", []).append(seconds)
        if rank == 0:
            errors["rows"] = max(errors.get("rows", 0.0), float((got - whole).abs().max()))
        if rank == 0:
            print(f"repeat {repeat}: " + ", ".join(f"{k} {v[-1]:.2f}s" for k, v in times.items()), file=sys.stderr)
    return {"field": field, "halos": halos, "times": {k: v[1:] for k, v in times.items()}, "errors": errors}


def run_world(args: argparse.Namespace) -> dict[str, Any]:
    """Rank 0's result (``phase``: a multiprocessing barrier of the launcher's context)."""
    phase = procs.context().Barrier(WORLD)
    return launch_ranks(run_rank, WORLD, args, phase, timeout_s=1800)[0]


@torch.inference_mode()
def error_vs_halo(frames: int, halos: list[int]) -> dict[str, Any]:
    """The trained moving-shapes VAE's error for each halo (see the module docstring)."""
    vae = load_shapes_vae()
    clips = MovingShapesDataset(num_samples=2, frames=frames, height=64, width=64, seed=HELD_OUT_SEED)
    z = vae.encode(torch.stack([clips[i]["video"] for i in range(len(clips))])).latent_dist.mode()
    whole = vae.decode(z).sample
    field, start, stop = wan_decode_receptive_field(vae), z.shape[2] - 2, z.shape[2]
    tail = whole[:, :, 1 + 4 * (start - 1) :]
    rows = []
    for halo in [h for h in halos if h <= start] + [field]:
        err = (decode_frame_range(vae, z, start, stop, halo) - tail).abs()
        rows.append({"halo": halo, "max_abs_error": float(err.max()), "rms_error": float(err.pow(2).mean().sqrt())})
    return {"vae": "moving-shapes (trained)", "receptive_field": field, "latent_frames": z.shape[2], "rows": rows}


def summarise(result: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    times = result["times"]
    latent_frames = 1 + (args.frames - 1) // 4
    rows = []
    for halo in result["halos"]:
        par = times[f"halo_{halo}"]
        row: dict[str, Any] = {
            "halo": halo,
            "exact": halo >= result["field"],
            "ranges": plan_frame_ranges(latent_frames, WORLD, halo),
            "parallel_s_median": statistics.median(par),
            "max_abs_error": result["errors"][halo],
        }
        for base in ("whole_1t", "whole_2t"):
            ratios = [w / p for w, p in zip(times[base], par, strict=True)]
            row[f"ratio_vs_{base}"] = {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios)}
        rows.append(row)
    split: dict[str, Any] = {
        "split": "rows",
        "exact": True,
        "parallel_s_median": statistics.median(times["rows"]),
        "max_abs_error": result["errors"]["rows"],
    }
    for base in ("whole_1t", "whole_2t"):
        ratios = [w / p for w, p in zip(times[base], times["rows"], strict=True)]
        split[f"ratio_vs_{base}"] = {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios)}
    rows.append(split)
    return {
        "benchmark": "parallel_vae",
        "vae": "AutoencoderKLWan defaults (Wan 2.1 architecture), random weights, float32",
        "video": {"frames": args.frames, "height": args.size, "width": args.size},
        "latent_frames": latent_frames,
        "receptive_field": result["field"],
        "repeats": args.repeats,
        "whole_1t_s_median": statistics.median(times["whole_1t"]),
        "whole_2t_s_median": statistics.median(times["whole_2t"]),
        "parallel": rows,
        "machine": {"cpus": os.cpu_count(), "processor": platform.processor() or platform.machine()},
        "torch": torch.__version__,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--frames", type=int, default=17, help="video frames (1 + 4k)")
    parser.add_argument("--size", type=int, default=64, help="video height and width, a multiple of 8")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--approx-halo", type=int, nargs="*", default=[1], help="shorter halos to measure")
    parser.add_argument("--curve-frames", type=int, default=129, help="clip frames for error_vs_halo (1 + 4k)")
    parser.add_argument("--quick", action="store_true", help="9 frames at 32 x 32, 1 repeat; a 65-frame curve")
    args = parser.parse_args(argv)
    if args.quick:
        args.frames, args.size, args.repeats, args.curve_frames = 9, 32, 1, 65
    summary = summarise(run_world(args), args)
    torch.set_num_threads(os.cpu_count() or 1)
    summary["error_vs_halo"] = error_vs_halo(args.curve_frames, [1, 2, 4, 8, 12, 16, 20, 24])
    for row in summary["error_vs_halo"]["rows"]:
        print(
            f"shapes VAE halo {row['halo']:>3}: max {row['max_abs_error']:.1e}, rms {row['rms_error']:.1e}",
            file=sys.stderr,
        )
    for row in summary["parallel"]:
        r1, r2 = row["ratio_vs_whole_1t"], row["ratio_vs_whole_2t"]
        what = f"halo {row['halo']:>3} ranges {row['ranges']}" if "halo" in row else "rows (bands)"
        print(
            f"{what}: x{r1['median']:.2f} vs 1 thread "
            f"[{r1['min']:.2f}, {r1['max']:.2f}], x{r2['median']:.2f} vs 2 threads, error {row['max_abs_error']:.2e}",
            file=sys.stderr,
        )
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
