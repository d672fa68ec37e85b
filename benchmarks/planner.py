"""The planner on the reference workloads, against Megatron-Bridge's published Wan 14B figure, and
the simulator against real local runs.

1. Plans Wan2.1-14B T2V (720p x 81), HunyuanVideo-shaped T2V with a 7B LLM text encoder
   (720p x 129) and the full-size understand-then-generate preset on 64, 512 and 4096 H200-class
   GPUs, in 8-GPU nodes and in 72-GPU NVLink domains, with the global batch capped at one sample
   per GPU. Each row: ``vs_colocated``, the planned throughput over the *colocated (FSDP + SP)*
   baseline (every stage colocated on all ranks with its own FSDP x Ulysses x ring split,
   gathered-once parameters and every memory policy, searched and simulated as the plan is, without
   frozen replicas taking turns: what users write by hand; its name and layout are in
   ``baseline``); ``vs_colocated_sequential`` and ``vs_uniform``, context baselines (data
   parallelism only; rank counts proportional to parameters); ``vs_lower_bound``, the fraction of
   the throughput of every GPU running model FLOPs at its peak, which is the plan's ``mfu`` (model
   FLOPs / (step time x GPUs x peak)); ``vs_efficiency_bound``, the same at the cost model's
   efficiency (0.45, uncalibrated); whether the plan fits memory and how long planning took (stage
   costing on the meta device is timed separately: ``cost_seconds``).
2. ``megatron_wan14b``: the Wan2.1-14B DiT alone (trained on precomputed latents and text
   embeddings, as Megatron-Bridge does) at 480x832 x 93 frames (37,440 tokens a sample) on 128
   H100 SXM (``hgx_h100_128``) with Megatron-Bridge's H100 global batch of 128, planned; its
   ``predicted_tflops_per_gpu`` (model FLOP/s per GPU) beside the published 325.77 TFLOP/s (about
   33 % MFU). The prediction is the cost model's: default efficiency 0.45, not calibrated on an H100.
3. ``mmpipe profile`` calibrates the tiny T2V stages on this CPU, then the runtime issue's parity
   placements are run for real on local ranks and their step time is predicted by the calibrated
   cost model + simulator (``sim_vs_measured``).

    python benchmarks/planner.py [--skip-measured] [--steps 10]

The last line is one JSON object ``{"results": [...], "megatron_wan14b": {...}, "sim_vs_measured": [...]}``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import tempfile
import time
from pathlib import Path

from mmpipe.assemble.placement import default_placement
from mmpipe.assemble.planning import build_workload, predict
from mmpipe.config import DataConfig, LaunchConfig, ModelConfig, RunConfig, TrainConfig, compose_config, from_dict
from mmpipe.models import build_training_graph
from mmpipe.rundir import pipeline_dir
from mmpipe.runtime.events import read_events
from mmpipe.sched.cluster import Cluster
from mmpipe.sched.planner import Planner
from mmpipe.sched.results import describe, parse_placement, summarize
from mmpipe.sched.simulator import measured_step_time
from mmpipe.train import train
from mmpipe.train.profile import profile

WORKLOADS = ("wan14b_t2v", "hunyuan_t2v", "u2g_full")
CLUSTERS = ("h200_64", "h200_512", "h200_4096", "h200_nvl72_64", "h200_nvl72_512", "h200_nvl72_4096")
CASES = {  # the runtime issue's parity placements (tests/dist/test_parity.py)
    "one-rank": (1, None),
    "two-ranks-balanced": (2, {"text": [1], "vae": [0], "dit": [1]}),
    "two-ranks-dp": (2, {"text": [0], "vae": [0], "dit": {"ranks": [0, 1], "dp": 2}}),
    "three-ranks-fan-in": (3, {"text": [0], "vae": [1], "dit": [2]}),
}


def model_preset(name: str) -> ModelConfig:
    """A ``configs/model`` preset, composed as ``mmpipe plan model=NAME`` does."""
    return from_dict(ModelConfig, compose_config("plan", [f"model={name}"])["model"])


def plan_workloads() -> list[dict]:
    """One summary per (workload, cluster) of the reference grid, printed as a table row as it comes."""
    results = []
    print(
        f"{'workload':<12} {'cluster':<16} {'layout':<13} {'vs coloc':>8} {'vs seq':>7} {'MFU':>6} "
        f"{'vs eff':>6} {'fits':>5} {'plan s':>7}  baseline layout",
        flush=True,
    )
    for name in WORKLOADS:
        t0 = time.perf_counter()
        graph, workload = build_workload(model_preset(name), DataConfig(), 1)
        cost_s = time.perf_counter() - t0
        for cluster_name in CLUSTERS:
            cluster = Cluster.preset(cluster_name)
            w = dataclasses.replace(workload, global_batch=cluster.world_size)
            report = Planner(w, cluster, batch_is_cap=True).plan()  # global batch: up to one sample per GPU
            t1 = time.perf_counter()
            report.plan(graph)  # materialise every rank's action list, as the runtime gets it
            materialise_s = time.perf_counter() - t1
            entry = summarize([report])[0] | {
                "cost_seconds": round(cost_s, 2),
                "materialise_seconds": round(materialise_s, 2),
            }
            results.append(entry)
            base = entry["baseline"]
            print(
                f"{name:<12} {cluster_name:<16} {entry['layout']:<13} {_x(entry['vs_colocated']):>8} "
                f"{_x(entry['vs_colocated_sequential']):>7} {entry['mfu']:>6.1%} {entry['vs_efficiency_bound']:>6.3f} "
                f"{str(entry['fits_memory']):>5} {entry['plan_seconds']:>7.2f}  {base['layout'] if base else '-'}",
                flush=True,
            )
    return results


def _x(ratio: float | None) -> str:
    return f"x{ratio:.3f}" if ratio else "n/a"


# Megatron-Bridge's published Wan2.1-14B pre-training figure on H100 (BF16): model TFLOP/s per GPU
# and MFU; its H100 preset (scripts/performance/configs/wan/wan_workload_base_configs.py): global
# batch 128, micro-batch 1, TP 2 x CP 4, 8 of 40 blocks recomputed.
MEGATRON = {"gpus": 128, "sequence": 37_440, "tflops_per_gpu": 325.77, "mfu": 0.33, "global_batch": 128}
MEGATRON_VIDEO = ("model.video.frames=93", "model.video.height=480", "model.video.width=832")  # 24 x 30 x 52 tokens


def megatron_wan14b() -> dict:
    """The Wan2.1-14B DiT alone on ``hgx_h100_128`` at Megatron-Bridge's sequence and global batch,
    planned; predicted model TFLOP/s per GPU beside the published figure."""
    model = from_dict(ModelConfig, compose_config("plan", ["model=wan14b_t2v", *MEGATRON_VIDEO])["model"])
    _, workload = build_workload(model, DataConfig(), MEGATRON["global_batch"])
    dit = workload.only(["dit"], name="wan14b_t2v DiT")
    tokens = dit.costs["dit"].tokens
    if tokens != MEGATRON["sequence"]:
        raise RuntimeError(f"{MEGATRON_VIDEO} gives {tokens} DiT tokens a sample, not {MEGATRON['sequence']}")
    cluster = Cluster.preset("hgx_h100_128")
    if cluster.world_size != MEGATRON["gpus"]:
        raise RuntimeError(f"hgx_h100_128 has {cluster.world_size} GPUs, not {MEGATRON['gpus']}")
    report = Planner(dit, cluster).plan()  # the global batch kept exactly
    entry = {
        "predicted_tflops_per_gpu": round(report.best.mfu * cluster.peak_flops / 1e12, 2),
        "predicted_mfu": round(report.best.mfu, 4),
        "published_tflops_per_gpu": MEGATRON["tflops_per_gpu"],
        "published_mfu": MEGATRON["mfu"],
        "cluster": cluster.name,
        "gpus": cluster.world_size,
        "peak_tflops_per_gpu": cluster.peak_flops / 1e12,
        "sequence": tokens,
        "global_batch": report.global_batch,
        "workload": "Wan2.1-14B DiT only (precomputed latents and text embeddings), 480x832 x 93 frames",
        "plan": describe(report.best.candidate),
        "vs_colocated": report.vs(report.colocated),
        "plan_seconds": round(report.plan_seconds, 2),
        "note": (
            f"predicted by the cost model at its default efficiency {cluster.efficiency} "
            "(not calibrated on an H100; the prediction cannot exceed efficiency x peak); "
            "published: Megatron-Bridge, TP 2 x CP 4, 8 blocks recomputed"
        ),
    }
    print(
        f"megatron_wan14b: predicted {entry['predicted_tflops_per_gpu']} TFLOP/s per GPU "
        f"(MFU {entry['predicted_mfu']:.1%}) vs published {MEGATRON['tflops_per_gpu']} ({MEGATRON['mfu']:.0%}); "
        f"{cluster.name}, {tokens} tokens, global batch {entry['global_batch']}; plan: {entry['plan']}",
        flush=True,
    )
    return entry


def sim_vs_measured(steps: int, warmup: int) -> list[dict]:
    model, data = ModelConfig(), DataConfig(val_samples=8)
    batch, micro = 8, 4
    calibration = profile(model, data, micro_sizes=(1, 2), micro_batches=micro, threads=1)
    out = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, (nproc, placement) in CASES.items():
            run_dir = Path(tmp) / name
            cfg = RunConfig(
                run_dir=str(run_dir),
                data=data,
                train=TrainConfig(
                    steps=steps,
                    batch_size=batch,
                    micro_batches=micro,
                    log_every=1,
                    val_every=10_000,
                    ckpt_every=10_000,
                    progress=False,
                    threads=1,
                ),
                launch=LaunchConfig(nproc=nproc),
                placement=placement,
            )
            train(cfg)
            measured = measured_step_time(read_events(run_dir), first_step=warmup, last_step=steps)
            graph = build_training_graph(cfg.model, pipeline_dir(cfg.model, run_dir))
            _, workload = build_workload(model, data, batch)
            groups = parse_placement(placement) if placement else default_placement(graph, nproc)
            predicted = predict(workload, Cluster.local(nproc), groups, micro, calibration)
            entry = {
                "case": name,
                "ranks": nproc,
                "predicted_s": round(predicted.step_time, 4),
                "measured_s": round(measured, 4),
                "ratio": round(predicted.step_time / measured, 3),
            }
            out.append(entry)
            print(
                f"{name}: predicted {entry['predicted_s']} s/step, measured {entry['measured_s']} (x{entry['ratio']})"
            )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--skip-measured", action="store_true", help="only plan the reference workloads")
    parser.add_argument("--skip-planning", action="store_true", help="only compare the simulator with real runs")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    args = parser.parse_args()
    os.environ.setdefault("MMPIPE_CACHE", tempfile.mkdtemp(prefix="mmpipe-bench-cache-"))  # cold costing
    results = [] if args.skip_planning else plan_workloads()
    megatron = None if args.skip_planning else megatron_wan14b()
    measured = [] if args.skip_measured else sim_vs_measured(args.steps, args.warmup)
    print(json.dumps({"results": results, "megatron_wan14b": megatron, "sim_vs_measured": measured}))


if __name__ == "__main__":
    main()
