"""Predicted vs measured step time: run real training, calibrate the simulator on the run's own
events, simulate the same plan, print both (issue 4's 20% bar), then one JSON line.

    python benchmarks/simulator.py [--steps 10]
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from mmpipe.config import DataConfig, LaunchConfig, RunConfig, TrainConfig
from mmpipe.runtime.events import read_events
from mmpipe.sched.simulator import bubble_fractions, calibrate, measured_step_time, simulate
from mmpipe.train import build_training_graph, make_plans, pipeline_dir, train

CASES = {
    "one-rank": (1, None),
    "two-ranks-balanced": (2, {"text": [1], "vae": [0], "dit": [1]}),
    "three-ranks-fan-in": (3, {"text": [0], "vae": [1], "dit": [2]}),
}


def compare(run_dir: Path, nproc: int, placement: dict | None, steps: int, warmup: int) -> dict:
    cfg = RunConfig(
        run_dir=str(run_dir),
        data=DataConfig(val_samples=8),
        train=TrainConfig(
            steps=steps,
            batch_size=8,
            micro_batches=4,
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
    events = read_events(run_dir)
    measured = measured_step_time(events, first_step=warmup, last_step=steps)
    plan, _ = make_plans(build_training_graph(cfg.model, pipeline_dir(cfg.model, run_dir)), cfg)
    sim = simulate(plan, calibrate(events, first_step=warmup + 1), steps=5)
    return {
        "measured_step_s": round(measured, 4),
        "predicted_step_s": round(sim.step_time, 4),
        "ratio": round(sim.step_time / measured, 4),
        "measured_bubble": {str(r): round(b, 3) for r, b in bubble_fractions(events, first_step=warmup + 1).items()},
        "predicted_bubble": {str(r): round(b, 3) for r, b in sim.bubble.items()},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    args = parser.parse_args()
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, (nproc, placement) in CASES.items():
            results[name] = compare(Path(tmp) / name, nproc, placement, args.steps, args.warmup)
            r = results[name]
            print(f"{name}: measured {r['measured_step_s']} s/step, predicted {r['predicted_step_s']} (x{r['ratio']})")
    print(json.dumps({"results": results, "steps": args.steps, "warmup": args.warmup}))


if __name__ == "__main__":
    main()
