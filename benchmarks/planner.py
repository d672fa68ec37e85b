"""The planner on the reference workloads, and the simulator against real local runs.

1. Plans Wan2.1-14B T2V (720p x 81), HunyuanVideo-shaped T2V with a 7B LLM text encoder
   (720p x 129) and the full-size understand-then-generate preset on 64, 512 and 4096 H200-class
   GPUs, in 8-GPU nodes and in 72-GPU NVLink domains; prints the planned throughput against
   colocated-sequential, uniform split and the lower bound, whether the plan fits memory and how
   long planning took (stage costing on the meta device is timed separately: ``cost_seconds``).
2. ``mmpipe profile`` calibrates the tiny T2V stages on this CPU, then the runtime issue's parity
   placements are run for real on local ranks and their step time is predicted by the calibrated
   cost model + simulator (``sim_vs_measured``).

    python benchmarks/planner.py [--skip-measured] [--steps 10]

The last line is one JSON object ``{"results": [...], "sim_vs_measured": [...]}``.
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
from mmpipe.sched.results import parse_placement, summarize
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
    results = []
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
            print(
                f"{name:<12} {cluster_name:<16} x{entry['vs_colocated'] or float('nan'):.2f} vs colocated, "
                f"x{entry['vs_lower_bound']:.2f} of lower bound, MFU {entry['mfu']:.1%}, "
                f"fits={entry['fits_memory']}, planned in {entry['plan_seconds']:.2f} s "
                f"(+{materialise_s:.2f} s for {cluster.world_size} action lists)",
                flush=True,
            )
    return results


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
    measured = [] if args.skip_measured else sim_vs_measured(args.steps, args.warmup)
    print(json.dumps({"results": results, "sim_vs_measured": measured}))


if __name__ == "__main__":
    main()
