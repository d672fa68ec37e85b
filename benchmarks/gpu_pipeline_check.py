"""A pipelined placement on CUDA tensors against the single-rank CUDA run (a check, not a speed figure).

Runs the embedded default (tiny Wan preset, moving shapes) through the real CLI twice for
``--steps`` steps on the same GPU:

* ``mmpipe train device=cuda`` on one rank;
* ``mmpipe train device=cuda launch.nproc=2 launch.backend=gloo``: the default 2-rank placement
  (frozen text encoder and VAE on rank 0, the trained DiT on rank 1), both ranks sharing the one
  GPU, edge tensors and their gradients staged through host memory by gloo (NCCL runs one rank
  per GPU).

Both use the CUDA defaults (bf16 precision, ``model.kernels=auto``). ``max_loss_diff`` is the
largest difference of the per-step training losses in ``metrics.jsonl``; ``max_val_loss_diff``
the same for the validation losses. A pipeline-only placement runs each stage's kernels on the same
device with the same inputs, so the losses are expected equal up to bf16 reassociation at most.
The last stdout line is one JSON object.

    python benchmarks/gpu_pipeline_check.py               # H200 (~1 min)
    python benchmarks/gpu_pipeline_check.py --device cpu  # the same on CPU ranks
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

SMALL = ["data.frames=9", "data.height=32", "data.width=32", "data.val_samples=4", "train.batch_size=4"]


def train(run_dir: Path, device: str, steps: int, extra: list[str]) -> tuple[list[dict[str, Any]], float]:
    cmd = [sys.executable, "-m", "mmpipe.cli", "train", f"run_dir={run_dir}", f"device={device}",
           f"train.steps={steps}", "train.log_every=1", f"train.val_every={steps}", f"train.ckpt_every={steps}",
           "train.progress=false", *SMALL, *extra]  # fmt: skip
    t0 = time.perf_counter()
    # cwd: not the checkout, whose ./mmpipe lacks the folders the installed package maps into it
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=dict(os.environ), cwd=run_dir.parent)
    if res.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({res.returncode}):\n{res.stderr[-4000:]}")
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return records, time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--steps", type=int, default=10)
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="mmpipe-gpu-pipe-") as tmp:
        single, t1 = train(Path(tmp) / "one", args.device, args.steps, [])
        backend = ["launch.backend=gloo"] if args.device == "cuda" else []
        piped, t2 = train(Path(tmp) / "two", args.device, args.steps, ["launch.nproc=2", *backend])
    losses = [(a["loss"], b["loss"]) for a, b in zip(single, piped, strict=True) if "loss" in a]
    vals = [(a["val_loss"], b["val_loss"]) for a, b in zip(single, piped, strict=True) if "val_loss" in a]
    result = {
        "benchmark": "gpu_pipeline_check",
        "device": args.device,
        "placement": "text, vae on rank 0; dit on rank 1 (launch.nproc=2 default), ranks sharing one GPU over gloo",
        "steps": len(losses),
        "losses_single": [a for a, _ in losses],
        "losses_pipelined": [b for _, b in losses],
        "max_loss_diff": max(abs(a - b) for a, b in losses),
        "max_val_loss_diff": max(abs(a - b) for a, b in vals),
        "wall_s": {"single": t1, "pipelined": t2},
    }
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
