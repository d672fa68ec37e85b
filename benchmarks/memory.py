"""Measured peak memory of a training step: keep-everything, recompute-every-block and mmpipe's auto policy.

A Wan-architecture DiT (random weights, ``--layers`` blocks of ``--heads`` x ``--head-dim``) trains
with AdamW on latents of growing length (latent frames of 32 x 32: 256 tokens a frame). Three
policies for the activations its blocks save for the backward, one column each:

- ``keep``: every block keeps them;
- ``recompute_all``: ``BlockPolicy.RECOMPUTE`` on every block (only each block's input stays; the
  backward runs the block again);
- ``auto``: the budget planner's choice (``mmpipe.memory.budget.choose_policies``, costs from the
  meta device, ``mmpipe.sched.cost``): the cheapest per-block mix of keep, recompute and offload
  (``FileTier`` on CPU, the pinned ``HostTier`` on CUDA) whose *estimate* fits the cap.

Measurement. Each (policy, length) runs in a fresh process (this script with ``--child``). After
its imports (the interpreter and libraries: its baseline) it reads its resident size (``VmRSS``),
resets the resident high-water mark (Linux >= 4.0: ``5 > /proc/self/clear_refs``), builds the
model, its AdamW and the inputs, and runs one warm-up training step (forward, backward,
``optimizer.step()``, which allocates AdamW's moments) and ``--reps`` more. Its peak is ``VmHWM``
at the end less the baseline: weights, gradients, AdamW's moments, saved activations,
rematerialised blocks, offloaded tensors still in memory (the file tier's pending writes, its
read-back mappings), the backward's working set, library code the step pages in, and what the
allocator keeps. On CUDA it is ``torch.cuda.max_memory_allocated`` since
``reset_peak_memory_stats``, less what was allocated then (the host tier's pinned buffers are not
GPU memory; the parent never initialises CUDA). Step time: the median of the ``--reps`` steps after
the warm-up (forward, backward, optimizer step), each process on its own, not interleaved. A child
that fails (out of memory, killed, over ``--child-timeout`` seconds) is a length that does not
fit, reported with its stderr's tail.

The cap: ``--cap-factor`` (default 1.0) times keep-everything's measured peak at ``--cap-frames``,
measured first. A length fits a policy when its measured peak is at most the cap; the planner's
estimate decides nothing. Auto's planner is asked for the cheapest policy under the cap minus the
fixed part (``choose_policies(budget_bytes=cap, fixed_bytes=fixed)``), the fixed part being
keep-everything's measured peak at one frame less the saved activations the cost model counts
there: weights, gradients, AdamW's moments and the step's other overheads at the shortest length
(one more child). A policy already measured at a length (auto choosing keep-everything, or
recompute on every block) is not run again: its row is that run (``measured_by``). Every row
carries the planner's estimate for its policy (``estimate_bytes``), so where the cost model and
the measurement part is visible.

The sweep: ``--cap-frames``, then every ``--frame-step`` frames up to ``--max-frames`` (default
8 x ``--cap-frames``). A column stops at its first length that does not fit: its longest length
is the one before, and every shorter swept length fits too. A column that still fits at
``--max-frames`` is flagged in ``capped_by_sweep`` (its figure is a lower bound).

Printed: each row as it is measured, each column's longest length, auto's step time over
recompute-all's at every length both fit, and two goals, met or missed: auto's longest length at
least 3 x keep's, and auto fitting, no slower than recompute-all (within ``TIME_NOISE``, 5 %:
separate processes), at every length recompute-all fits. The last stdout line is one JSON object:
``max_len_keep``, ``max_len_recompute_all``, ``max_len_auto`` (tokens), ``max_len_ratio`` (auto /
keep), ``auto_vs_recompute_all`` (the step-time ratio at the longest length both fit; by length in
``auto_vs_recompute_all_by_len``), ``cap_bytes``, ``fixed_bytes``, ``device`` and ``rows``.

The allocator is part of what is measured: glibc serves tensors under its mmap threshold (which
rises to each freed mapping's size, up to 32 MiB) from its heaps, whose freed memory mostly stays
resident, so a policy's peak includes the heaps' fragmentation. The children inherit the
environment: with ``MALLOC_MMAP_THRESHOLD_=131072`` (recorded in ``malloc_env``) every larger
tensor is a fresh mapping, returned when freed.

    python benchmarks/memory.py     # CPU, float32, file tier; 8 blocks of 4 x 32
    MALLOC_MMAP_THRESHOLD_=131072 python benchmarks/memory.py
    python benchmarks/memory.py --device cuda --cap-frames 64 --frame-step 64 --reps 3  # bf16, 12 x 128
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from typing import Any, cast

import torch
from diffusers import WanTransformer3DModel
from diffusers.utils import logging as diffusers_logging

from mmpipe.memory.budget import FILE_TIER_BYTES_PER_S, BlockPricing, choose_policies
from mmpipe.memory.host import HostTier
from mmpipe.memory.policy import BLOCK_LETTERS, BlockPolicy, apply_block_policies
from mmpipe.memory.tiers import FileTier, Tier
from mmpipe.sched.cost import measure_stage_cost
from mmpipe.stages._source import ModuleSource
from mmpipe.stages.dit import WanDiTFlowMatchingStage

GRID = 32  # latent height and width: 16 x 16 = 256 tokens a frame after 2 x 2 patches
TOKENS = (GRID // 2) ** 2
COLUMNS = ("keep", "recompute_all", "auto")
LETTER = {policy: letter for letter, policy in BLOCK_LETTERS.items()}
TIME_NOISE = 0.05  # auto counts as no slower than recompute-all within this (steps of separate processes)
GOAL_RATIO = 3.0  # auto's longest length over keep's
MiB = 2**20


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


def make_setup(device: str, layers: int, heads: int, head_dim: int) -> Setup:
    """CPU: float32, file tier, 4 x 32 heads by default; CUDA: bf16, pinned host tier, 12 x 128."""
    if torch.device(device).type == "cuda":
        return Setup(
            layers=layers, heads=heads or 12, head_dim=head_dim or 128, device=torch.device(device),
            dtype=torch.bfloat16, flops_per_s=989e12 * 0.45, offload_bytes_per_s=5e10, overlap=True,
        )  # fmt: skip
    return Setup(
        layers=layers, heads=heads or 4, head_dim=head_dim or 32, device=torch.device(device),
        dtype=torch.float32, flops_per_s=5e10, offload_bytes_per_s=FILE_TIER_BYTES_PER_S, overlap=False,
    )  # fmt: skip


def wan_dit(setup: Setup) -> torch.nn.Module:
    """The Wan DiT, randomly initialised (seeded) on the current default device, in float32."""
    torch.manual_seed(0)
    width = setup.heads * setup.head_dim
    module = WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=setup.heads, attention_head_dim=setup.head_dim,
        in_channels=16, out_channels=16, text_dim=64, freq_dim=64, ffn_dim=4 * width,
        num_layers=setup.layers, cross_attn_norm=True, qk_norm="rms_norm_across_heads", rope_max_seq_len=1024,
    )  # fmt: skip
    return cast(torch.nn.Module, module)


def make_stage(module: torch.nn.Module) -> WanDiTFlowMatchingStage:
    return WanDiTFlowMatchingStage("dit", ModuleSource.from_module(module), shift=3.0)


def input_shapes(setup: Setup, frames: int) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    return {"latents": ((1, 16, frames, GRID, GRID), setup.dtype), "context": ((1, 16, 64), setup.dtype)}


# -- the child: one measured run -----------------------------------------------------------------------


def status_bytes(field: str) -> int:
    """A ``/proc/self/status`` field (``VmRSS``, ``VmHWM``: kB) in bytes."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":"))


class Meter:
    """Peak memory of what runs after :meth:`start`: on CPU the resident high-water mark less the
    resident size at the start, on CUDA the peak allocated less what was allocated at the start."""

    def __init__(self, setup: Setup) -> None:
        self.setup, self.baseline = setup, 0

    def start(self) -> None:
        if self.setup.cuda:
            torch.cuda.synchronize(self.setup.device)
            torch.cuda.reset_peak_memory_stats(self.setup.device)
            self.baseline = torch.cuda.memory_allocated(self.setup.device)
            return
        self.baseline = status_bytes("VmRSS")
        with open("/proc/self/clear_refs", "w") as f:  # VmHWM := VmRSS
            f.write("5")

    def peak(self) -> int:
        if self.setup.cuda:
            torch.cuda.synchronize(self.setup.device)
            return torch.cuda.max_memory_allocated(self.setup.device) - self.baseline
        return status_bytes("VmHWM") - self.baseline


def train_step(
    setup: Setup, stage: WanDiTFlowMatchingStage, optimizer: torch.optim.Optimizer, batch: dict[str, torch.Tensor]
) -> float:
    """Seconds of one forward, backward and optimizer step."""
    if setup.cuda:
        torch.cuda.synchronize(setup.device)
    start = time.perf_counter()
    stage.forward(stage.module, batch, seed=0)["loss"].backward()
    optimizer.step()
    optimizer.zero_grad()
    if setup.cuda:
        torch.cuda.synchronize(setup.device)
    return time.perf_counter() - start


def child(setup: Setup, frames: int, blocks: str, reps: int) -> dict[str, Any]:
    """One warm-up and ``reps`` measured training steps with the per-block policies ``blocks`` (one
    letter a block: k, r, o), their peak memory and median step seconds."""
    with tempfile.TemporaryDirectory(prefix="mmpipe-bench-spill-") as spill:
        tier: Tier = HostTier() if setup.cuda else FileTier(spill)
        meter = Meter(setup)
        meter.start()
        module = wan_dit(setup).to(dtype=setup.dtype).to(device=setup.device)
        apply_block_policies(list(cast(Any, module).blocks), [BLOCK_LETTERS[c] for c in blocks], tier=tier)
        optimizer = torch.optim.AdamW(module.parameters(), lr=1e-4)
        gen = torch.Generator().manual_seed(1)
        batch = {
            k: torch.randn(shape, generator=gen).to(device=setup.device, dtype=dtype)
            for k, (shape, dtype) in input_shapes(setup, frames).items()
        }
        stage = make_stage(module)
        times = [train_step(setup, stage, optimizer, batch) for _ in range(reps + 1)]
        peak = meter.peak()
        tier.close()
    return {
        "peak_bytes": peak,
        "step_s": statistics.median(times[1:]),
        "offloaded_bytes": tier.stats.offloaded_bytes,
        "device": torch.cuda.get_device_name(setup.device) if setup.cuda else "cpu",
    }


# -- the parent: the sweep ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Row:
    """One column at one length: the policy run, what it measured and whether that fits the cap."""

    column: str
    frames: int
    blocks: str  # one letter a block (k, r, o); empty when the planner found nothing that fits
    fits: bool
    peak_bytes: int | None = None
    step_s: float | None = None
    estimate_bytes: int | None = None  # the planner's resident estimate for this policy
    offloaded_bytes: int = 0
    measured_by: str = ""  # the column whose run this is (auto choosing keep or recompute-all shares theirs)
    error: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {"len": self.frames * TOKENS, "policy": self.column} | {
            k: v for k, v in dataclasses.asdict(self).items() if k != "column"
        }


@functools.cache
def pricing(setup: Setup, frames: int) -> BlockPricing:
    """The planner's view of the stage at ``frames`` (the cost model's meta-device measurement)."""
    with torch.device("meta"):
        stage = make_stage(wan_dit(setup))
    cost = measure_stage_cost(stage, input_shapes(setup, frames), dtype=setup.dtype, seed=0)
    # On a GPU the copies overlap the blocks' forward and backward (3x the forward's FLOPs)
    hidden = 3 * cost.block_flops / setup.flops_per_s if setup.overlap else 0.0
    return BlockPricing.from_cost(
        cost,
        flops_per_s=setup.flops_per_s,
        offload_bytes_per_s=setup.offload_bytes_per_s,
        hidden_s=hidden,
        pending_blocks=0 if setup.cuda else 1,  # the file tier writes one block at a time
    )


def estimate(setup: Setup, frames: int, blocks: str, fixed: int) -> int:
    """The planner's resident estimate for ``blocks`` at ``frames``."""
    return pricing(setup, frames).resident_bytes(
        blocks.count(LETTER[BlockPolicy.RECOMPUTE]), blocks.count(LETTER[BlockPolicy.OFFLOAD]),
        inflight=1, fixed_bytes=fixed,
    )  # fmt: skip


class Runner:
    """Runs children (each (length, policies) once: a second column asking for it shares the
    measurement) and judges their peaks against the cap."""

    def __init__(self, args: argparse.Namespace, setup: Setup) -> None:
        self.args, self.setup = args, setup
        self.done: dict[tuple[int, str], dict[str, Any]] = {}  # (frames, blocks) -> the child's result
        self.cap = self.fixed = 0

    def spawn(self, frames: int, blocks: str) -> dict[str, Any]:
        """A child's result, or ``{"error": ...}`` when it failed."""
        command = [
            sys.executable, os.path.abspath(__file__), "--child", "--device", str(self.setup.device),
            "--layers", str(self.setup.layers), "--heads", str(self.setup.heads),
            "--head-dim", str(self.setup.head_dim), "--frames", str(frames), "--blocks", blocks,
            "--reps", str(self.args.reps),
        ]  # fmt: skip
        try:
            out = subprocess.run(command, capture_output=True, text=True, timeout=self.args.child_timeout)
        except subprocess.TimeoutExpired as err:
            return {"error": f"timed out after {err.timeout:g} s"}
        lines = out.stdout.strip().splitlines()
        try:
            if out.returncode == 0 and lines:
                return cast(dict[str, Any], json.loads(lines[-1]))
        except ValueError:
            pass
        return {"error": f"exit status {out.returncode}: ...{out.stderr[-1500:]}"}

    def peak(self, column: str, frames: int, blocks: str) -> int | None:
        """The measured peak of ``blocks`` at ``frames`` (run now unless it ran before; None: it failed)."""
        if (frames, blocks) not in self.done:
            self.done[(frames, blocks)] = self.spawn(frames, blocks) | {"column": column}
        return self.done[(frames, blocks)].get("peak_bytes")

    def measure(self, column: str, frames: int, blocks: str) -> Row:
        peak = self.peak(column, frames, blocks)
        got = self.done[(frames, blocks)]
        return Row(
            column, frames, blocks, fits=peak is not None and peak <= self.cap, peak_bytes=peak,
            step_s=got.get("step_s"), estimate_bytes=estimate(self.setup, frames, blocks, self.fixed),
            offloaded_bytes=got.get("offloaded_bytes", 0), measured_by=got["column"], error=got.get("error"),
        )  # fmt: skip

    def calibrate(self) -> None:
        """The cap (keep-everything at ``--cap-frames``) and the planner's fixed part (keep-everything
        at one frame less the saved activations the cost model counts there)."""
        keep = "k" * self.setup.layers
        peaks = {}
        for frames in (1, self.args.cap_frames):
            peaks[frames] = self.peak("keep", frames, keep)
            if peaks[frames] is None:
                raise SystemExit(f"keep-everything at {frames} frames failed: {self.done[(frames, keep)]['error']}")
        self.fixed = max(0, (peaks[1] or 0) - pricing(self.setup, 1).resident_bytes(0, 0, inflight=1))
        self.cap = round(self.args.cap_factor * (peaks[self.args.cap_frames] or 0))

    @property
    def device_name(self) -> str:
        """As the children name it (the parent does not initialise CUDA)."""
        return next((got["device"] for got in self.done.values() if "device" in got), str(self.setup.device))

    def auto(self, frames: int) -> Row:
        """The planner's policy at ``frames``, measured (or why the planner found none)."""
        try:
            choice = choose_policies(
                pricing(self.setup, frames), budget_bytes=self.cap, inflight=1, fixed_bytes=self.fixed
            )
        except ValueError as err:
            return Row("auto", frames, "", fits=False, error=f"planner: {err}")
        return self.measure("auto", frames, "".join(LETTER[p] for p in choice.policies()))

    def run(self, column: str, frames: int) -> Row:
        if column == "auto":
            return self.auto(frames)
        letter = LETTER[BlockPolicy.KEEP if column == "keep" else BlockPolicy.RECOMPUTE]
        return self.measure(column, frames, letter * self.setup.layers)


def show(row: Row, cap: int) -> str:
    """One printed line: the row's policy, measured peak, the planner's estimate, step time and verdict."""
    peak = f"{row.peak_bytes / MiB:8.1f}" if row.peak_bytes is not None else "       -"
    est = f"{row.estimate_bytes / MiB:8.1f}" if row.estimate_bytes is not None else "       -"
    step = f"{row.step_s:7.3f} s" if row.step_s is not None else "      - "
    shared = f" ({row.measured_by}'s run)" if row.measured_by not in ("", row.column) else ""
    why = f": {row.error.strip().splitlines()[-1]}" if row.error and row.error.strip() else ""
    return (
        f"{row.column:13s} {row.frames:3d} frames ({row.frames * TOKENS:6d} tokens) {row.blocks or '-':>8s}: "
        f"peak {peak} MiB (planner {est}, cap {cap / MiB:.1f}), step {step} {'fits' if row.fits else 'does not fit'}"
        f"{why}{shared}"
    )


def sweep(runner: Runner, lengths: Sequence[int]) -> list[Row]:
    """Every column at each length in turn, each until its first length that does not fit."""
    rows: list[Row] = []
    alive = set(COLUMNS)
    for frames in lengths:
        for column in COLUMNS:
            if column in alive:
                row = runner.run(column, frames)
                print(show(row, runner.cap), flush=True)
                rows.append(row)
                if not row.fits:
                    alive.discard(column)
        if not alive:
            break
    return rows


def longest(rows: Sequence[Row], column: str) -> int:
    """The column's longest length (frames) whose run, and every shorter one's, fits (0: none)."""
    best = 0
    for row in sorted((r for r in rows if r.column == column), key=lambda r: r.frames):
        if not row.fits:
            break
        best = row.frames
    return best


def step_ratios(rows: Sequence[Row]) -> dict[int, float]:
    """Auto's step seconds over recompute-all's, at each length both fit (frames -> ratio)."""
    steps = {(r.column, r.frames): r.step_s for r in rows if r.fits and r.step_s}
    return {
        frames: seconds / steps[("recompute_all", frames)]
        for (column, frames), seconds in steps.items()
        if column == "auto" and ("recompute_all", frames) in steps
    }


def no_slower(rows: Sequence[Row], ratios: dict[int, float]) -> bool | None:
    """Whether auto fits, no slower than recompute-all (within ``TIME_NOISE``), at every length
    recompute-all fits (None: recompute-all fits nowhere)."""
    lengths = [r.frames for r in rows if r.column == "recompute_all" and r.fits]
    if not lengths:
        return None
    return all(f in ratios and ratios[f] <= 1 + TIME_NOISE for f in lengths)


def summarize(runner: Runner, rows: Sequence[Row], lengths: Sequence[int]) -> dict[str, Any]:
    """The JSON result (lengths in tokens)."""
    best = {c: longest(rows, c) for c in COLUMNS}
    ratios = step_ratios(rows)
    both = max(ratios, default=None)
    ratio = best["auto"] / best["keep"] if best["keep"] else None
    setup, args = runner.setup, runner.args
    return {
        "measured": True,
        "device": runner.device_name,
        "peak": "max_memory_allocated - allocated at start" if setup.cuda else "VmHWM - VmRSS at start (clear_refs 5)",
        "dtype": str(setup.dtype).removeprefix("torch."),
        "model": {"layers": setup.layers, "heads": setup.heads, "head_dim": setup.head_dim},
        "tokens_per_frame": TOKENS,
        "reps": args.reps,
        "cap_frames": args.cap_frames,
        "cap_factor": args.cap_factor,
        "cap_bytes": runner.cap,
        "fixed_bytes": runner.fixed,
        "malloc_env": {k: v for k, v in os.environ.items() if k.startswith("MALLOC_")},
        "max_frames": lengths[-1],
        **{f"max_len_{c}": best[c] * TOKENS for c in COLUMNS},
        "max_len_ratio": round(ratio, 3) if ratio is not None else None,
        "recompute_all_ratio": round(best["recompute_all"] / best["keep"], 3) if best["keep"] else None,
        "capped_by_sweep": {c: best[c] == lengths[-1] for c in COLUMNS},
        "auto_vs_recompute_all": round(ratios[both], 4) if both is not None else None,
        "auto_vs_recompute_all_at_len": both * TOKENS if both is not None else None,
        "auto_vs_recompute_all_by_len": {str(f * TOKENS): round(r, 4) for f, r in sorted(ratios.items())},
        "goal_ratio_met": ratio is not None and ratio >= GOAL_RATIO,
        "goal_auto_no_slower_met": no_slower(rows, ratios),
        "rows": [r.to_json() for r in rows],
    }


def report(result: dict[str, Any]) -> None:
    for column in COLUMNS:
        capped = " (the sweep's end: a lower bound)" if result["capped_by_sweep"][column] else ""
        print(f"longest length that fits, {column}: {result[f'max_len_{column}']} tokens{capped}")
    for length, r in result["auto_vs_recompute_all_by_len"].items():
        print(f"auto / recompute-all step time at {length} tokens: {r:.3f}")
    verdict = {True: "met", False: "missed", None: "not measured: recompute-all fits nowhere"}
    print(f"goal: auto's longest length >= {GOAL_RATIO:g} x keep's: x{result['max_len_ratio']} "
          f"({verdict[result['goal_ratio_met']]})")  # fmt: skip
    print(f"goal: auto fits, its step no slower than recompute-all's (within {TIME_NOISE:.0%}), at every length "
          f"recompute-all fits: {verdict[result['goal_auto_no_slower_met']]}")  # fmt: skip


def check_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """``parser.error`` naming the first bad value."""
    least = {"layers": 2, "heads": 0, "head_dim": 0, "cap_frames": 1, "frame_step": 1, "reps": 1, "frames": 1}
    for name, low in least.items():
        if getattr(args, name) < low:
            parser.error(f"--{name.replace('_', '-')} {getattr(args, name)}: must be at least {low}")
    if args.max_frames < args.cap_frames:
        parser.error(f"--max-frames {args.max_frames}: must be at least --cap-frames ({args.cap_frames})")
    for name in ("cap_factor", "child_timeout"):
        if not getattr(args, name) > 0:
            parser.error(f"--{name.replace('_', '-')} {getattr(args, name)}: must be positive")
    try:
        device = torch.device(args.device)
    except RuntimeError:
        parser.error(f"--device {args.device!r}: cpu or cuda[:N]")
    if device.type not in ("cpu", "cuda"):
        parser.error(f"--device {args.device!r}: cpu or cuda[:N]")
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error(f"--device {args.device!r}: no CUDA device is visible")
    if device.type == "cpu" and not os.path.exists("/proc/self/clear_refs"):
        parser.error("--device cpu: the peak is read from /proc/self/status after clear_refs (Linux >= 4.0)")
    if args.child and (len(args.blocks) != args.layers or set(args.blocks) - set(BLOCK_LETTERS)):
        parser.error(f"--blocks {args.blocks!r}: one of {'/'.join(BLOCK_LETTERS)} for each of {args.layers} blocks")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu", help="cpu (file tier) or cuda[:N] (pinned host tier)")
    parser.add_argument("--layers", type=int, default=8, help="transformer blocks (at least 2)")
    parser.add_argument("--heads", type=int, default=0, help="default (0): 4 on CPU, 12 on CUDA")
    parser.add_argument("--head-dim", type=int, default=0, help="default (0): 32 on CPU, 128 on CUDA")
    parser.add_argument("--cap-frames", type=int, default=2, help="the cap: what keep measures at this many frames")
    parser.add_argument("--cap-factor", type=float, default=1.0, help="the cap: this times keep's peak")
    parser.add_argument("--max-frames", type=int, default=0, help="the sweep's end (default: 8 x --cap-frames)")
    parser.add_argument("--frame-step", type=int, default=1, help="latent frames between the lengths swept")
    parser.add_argument("--reps", type=int, default=3, help="timed steps after the warm-up step, per run")
    parser.add_argument("--child-timeout", type=float, default=900.0, help="seconds one run may take")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)  # one run: --frames, --blocks
    parser.add_argument("--frames", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--blocks", default="", help=argparse.SUPPRESS)  # a letter a block: k, r, o (s)
    args = parser.parse_args(argv)
    args.max_frames = args.max_frames or 8 * args.cap_frames
    check_args(parser, args)
    return args


def main() -> None:
    args = parse_args()
    diffusers_logging.set_verbosity_error()
    setup = make_setup(args.device, args.layers, args.heads, args.head_dim)
    if args.child:
        print(json.dumps(child(setup, args.frames, args.blocks, args.reps)))
        return
    runner = Runner(args, setup)
    runner.calibrate()
    print(f"cap {runner.cap / MiB:.1f} MiB (keep-everything at {args.cap_frames} frames x {args.cap_factor:g}); "
          f"planner's fixed part {runner.fixed / MiB:.1f} MiB", flush=True)  # fmt: skip
    lengths = list(range(args.cap_frames, args.max_frames + 1, args.frame_step))
    rows = sweep(runner, lengths)
    result = summarize(runner, rows, lengths)
    report(result)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
