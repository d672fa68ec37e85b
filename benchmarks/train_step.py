"""`make run`'s training step: ``mmpipe train`` with its defaults against the plain PyTorch loop a user
would write instead, on the same 2 cores.

Contender: ``mmpipe train launch.nproc=0 placement=auto`` as `make run` runs it (every default: the
planner's placement and micro-batches, the frozen-output cache, fused AdamW), ``train.steps``
shortened to ``--steps``; its calibration is made once up front (``$MMPIPE_CACHE`` = a folder of
this run's, untimed). Its step time is the median of the rank-0 intervals between consecutive
training steps' first events over the last ``--window`` steps: after the first epoch, when the
cache serves every frozen output, as in most of `make run`'s 4400 steps.

Baselines, the same DiT (the preset's ``WanTransformer3DModel``), the same global batch and
flow-matching loss, on latents and text states made once up front (what the cache gives the
contender), fused AdamW and gradient clipping as the contender, one micro-batch:
  ddp_2proc_1thread     ``torch.nn.parallel.DistributedDataParallel`` over gloo, 2 processes x 1
                        thread, half the batch each (what ``torchrun --nproc-per-node 2`` runs);
  single_1proc_2threads one process, 2 intra-op threads, the whole batch.
Each baseline's step time is the median over ``--window`` steps after ``--warmup``.

``--repeats`` rounds, each running the contender and both baselines in turn; per round contender /
the faster baseline; reported: the median of those per-round ratios and their range. Context, not a
contender: ``mmpipe train launch.nproc=1`` (one rank, both cores' threads: the layout of the
one-process baseline), timed as the contender is, against that baseline. The last stdout line is
JSON: ``{"contender", "contender_placement", "contender_micro_batches", "samples_per_s": {name:
[per round]}, "vs_best_baseline", "ratio_range", "vs": {name: median}, "best_baseline",
"mmpipe_1rank_vs_single_1proc_2threads", "batch", "steps", "window", "repeats", "wall_s"}``.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
import yaml

MMPIPE = [sys.executable, "-m", "mmpipe.cli"]


def median_step_s(run_dir: Path, window: int) -> float:
    """Median seconds between consecutive training steps' first rank-0 events, last ``window`` steps."""
    first: dict[int, float] = {}
    with (run_dir / "events" / "rank0.jsonl").open() as f:
        for line in f:
            e = json.loads(line)
            if e["phase"] == "train":
                first[e["step"]] = min(first.get(e["step"], e["start"]), e["start"])
    steps = sorted(first)[-(window + 1) :]
    return statistics.median(first[b] - first[a] for a, b in zip(steps, steps[1:], strict=False))


def contender(
    tmp: Path, steps: int, window: int, env: dict[str, str], tag: str, ranks: str = "launch.nproc=0"
) -> tuple[float, dict[str, Any]]:
    run_dir = tmp / f"mmpipe-{tag}"
    cmd = [*MMPIPE, "train", f"run_dir={run_dir}", ranks, "placement=auto"]
    cmd += [f"train.steps={steps}", "train.progress=false"]
    subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    cfg = yaml.safe_load((run_dir / "config.yaml").read_text())
    return median_step_s(run_dir, window), cfg


def flow_matching_loss(
    dit: torch.nn.Module, x0: torch.Tensor, ctx: torch.Tensor, shift: float, gen: torch.Generator
) -> torch.Tensor:
    """Wan's flow-matching loss as a plain training loop computes it: sigma from the scheduler's
    shifted uniform, the noised latents, the DiT's velocity against ``noise - x0``."""
    u = torch.rand(x0.shape[0], generator=gen)
    sigma = shift * u / (1 + (shift - 1) * u)
    noise = torch.randn(x0.shape, generator=gen)
    s = sigma.view(-1, 1, 1, 1, 1)
    pred = dit(hidden_states=(1 - s) * x0 + s * noise, timestep=sigma * 1000, encoder_hidden_states=ctx)[0]
    return F.mse_loss(pred, noise - x0)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _loop(rank: int, world: int, threads: int, batch: int, warmup: int, window: int, port: int, out: Any) -> None:
    """The plain loop: ``world`` processes (DDP over gloo when 2) x ``threads`` threads."""
    from mmpipe.config import ModelConfig
    from mmpipe.data.shapes import caption_vocabulary
    from mmpipe.models.wan import build_tiny_wan_pipeline

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    spec = ModelConfig()
    dit = build_tiny_wan_pipeline(spec, [*caption_vocabulary(), "blurry static"], seed=0).transformer.train()
    model: torch.nn.Module = dit
    if world > 1:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("gloo", rank=rank, world_size=world)
        model = torch.nn.parallel.DistributedDataParallel(dit)
    opt = torch.optim.AdamW(dit.parameters(), lr=3e-3, weight_decay=0.01, fused=True)
    rows = batch // world
    gen = torch.Generator().manual_seed(rank)
    # 1024 clips' latents (17 x 64 x 64 -> 16 x 5 x 8 x 8) and caption states, made once
    latents = torch.randn(1024, 16, 5, 8, 8, generator=gen)
    context = torch.randn(1024, spec.text_len, spec.text_dim, generator=gen)
    times = []
    for _ in range(warmup + window + 1):
        times.append(time.perf_counter())
        idx = torch.randint(0, 1024, (rows,), generator=gen)
        loss = flow_matching_loss(model, latents[idx], context[idx], spec.flow_shift, gen)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(dit.parameters(), 1.0)
        opt.step()
        if world > 1:  # the loss a step, logged as the contender logs it
            dist.all_reduce(loss.detach())
    if rank == 0:
        out.put(statistics.median(b - a for a, b in zip(times[warmup:], times[warmup + 1 :], strict=False)))
    if world > 1:
        dist.destroy_process_group()


def baseline(world: int, threads: int, batch: int, warmup: int, window: int) -> float:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = _free_port()
    procs = [
        ctx.Process(target=_loop, args=(r, world, threads, batch, warmup, window, port, out)) for r in range(world)
    ]
    for p in procs:
        p.start()
    step_s = out.get(timeout=1800)
    for p in procs:
        p.join()
        if p.exitcode:
            raise RuntimeError(f"baseline process exited with {p.exitcode}")
    return float(step_s)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=320, help="the contender's train.steps (>= 128 + window: one epoch)")
    p.add_argument("--window", type=int, default=150)
    p.add_argument("--warmup", type=int, default=30, help="the baselines' untimed steps")
    p.add_argument("--repeats", type=int, default=3)
    a = p.parse_args()
    t0 = time.perf_counter()
    batch = 8  # train.batch_size's default
    with tempfile.TemporaryDirectory(prefix="train_step_") as d:
        tmp = Path(d)
        env = {**os.environ, "MMPIPE_CACHE": str(tmp / "cache")}
        subprocess.run(  # the calibration placement=auto makes on a new machine, once, untimed
            [*MMPIPE, "train", f"run_dir={tmp / 'warm'}", "launch.nproc=0", "placement=auto", "train.steps=2"],
            check=True,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        runs: dict[str, list[float]] = {
            "mmpipe": [],
            "mmpipe_1rank_2threads": [],
            "ddp_2proc_1thread": [],
            "single_1proc_2threads": [],
        }
        cfg: dict[str, Any] = {}
        for r in range(a.repeats):
            step_s, cfg = contender(tmp, a.steps, a.window, env, str(r))
            runs["mmpipe"].append(batch / step_s)
            one_rank_s, _ = contender(tmp, a.steps, a.window, env, f"{r}-1rank", "launch.nproc=1")
            runs["mmpipe_1rank_2threads"].append(batch / one_rank_s)
            runs["ddp_2proc_1thread"].append(batch / baseline(2, 1, batch, a.warmup, a.window))
            runs["single_1proc_2threads"].append(batch / baseline(1, 2, batch, a.warmup, a.window))
            print(f"round {r}: " + ", ".join(f"{k} {v[-1]:.1f}" for k, v in runs.items()) + " samples/s", flush=True)
    names = ["ddp_2proc_1thread", "single_1proc_2threads"]
    best = max(names, key=lambda n: statistics.median(runs[n]))
    per_round = [c / max(runs[n][i] for n in names) for i, c in enumerate(runs["mmpipe"])]
    vs = {n: statistics.median(c / b for c, b in zip(runs["mmpipe"], runs[n], strict=True)) for n in names}
    # context: the engine's own cost at the best baseline's layout (one rank, both cores' threads)
    one_rank_vs_single = statistics.median(
        c / b for c, b in zip(runs["mmpipe_1rank_2threads"], runs["single_1proc_2threads"], strict=True)
    )
    print(
        json.dumps(
            {
                "contender": "mmpipe train launch.nproc=0 placement=auto (defaults), cached calibration",
                "contender_placement": cfg.get("placement"),
                "contender_micro_batches": cfg.get("train", {}).get("micro_batches"),
                "samples_per_s": runs,
                "vs_best_baseline": statistics.median(per_round),
                "ratio_range": [min(per_round), max(per_round)],
                "vs": vs,
                "best_baseline": best,
                "mmpipe_1rank_vs_single_1proc_2threads": one_rank_vs_single,
                "batch": batch,
                "steps": a.steps,
                "window": a.window,
                "repeats": a.repeats,
                "wall_s": round(time.perf_counter() - t0, 1),
            }
        )
    )


if __name__ == "__main__":
    main()
