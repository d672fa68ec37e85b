"""One training step of the Wan2.1-T2V-1.3B pipeline on one GPU: mmpipe against a plain PyTorch loop.

Both sides train the same module objects (random weights built on the device, nothing downloaded:
UMT5-XXL text encoder and Wan VAE frozen in bf16, the 1.3B Wan DiT trained with float32 master
weights under bf16 autocast, AdamW, gradient clipping 1.0) on the same data: 832x480 x 33-frame
moving-shapes clips and their captions, micro-batch 1, Wan's flow-matching loss. The clips are drawn
once into memory before timing (drawing one costs about as much as a GPU step), and both sides
collate their step's clip (tokenize, stack) and copy it to the GPU inside the step.

* **baseline**: the loop diffusers' training examples write (``accelerate``'s ``mixed_precision=bf16``
  is autocast): encode text and video under ``no_grad``, noise, predict, MSE, backward, clip, step.
  At its best: without gradient checkpointing when the step fits in memory, else with
  ``transformer.enable_gradient_checkpointing()`` (the examples' ``--gradient_checkpointing``).
* **mmpipe**: the training loop ``mmpipe train device=cuda`` runs (:func:`mmpipe.train.start_rank`,
  the executor interpreting the one-rank plan) with its defaults on CUDA: bf16 precision,
  ``model.kernels=auto`` (mmpipe's Triton attention, fused norm + modulate and RoPE kernels), and
  the memory planner's activation policy (``memory.dit.policy=auto``: which blocks keep their
  activations and which recompute them, for the GPU's memory less a reserve and the frozen stages'
  weights; ``--budget-gb`` sets the budget instead). A contender that runs out of memory exits 3.

Each side runs ``--warmup`` steps (Triton autotuning, allocator warm-up), then ``--steps`` timed
steps (``torch.cuda.synchronize`` around each). ``ratio`` is the median over steps of mmpipe's
samples/s over the baseline's at the same step index, with its range. ``mfu``: the DiT's model
FLOPs (forward + backward, counted with ``FlopCounterMode`` on the meta device, recomputation not
counted) per mmpipe step over the whole step time (text and VAE encoding included) and the bf16
dense peak (989 TFLOP/s for an H200). The last stdout line is one JSON object.

    python benchmarks/gpu_train.py                       # H200, full size (~90 s)
    python benchmarks/gpu_train.py --device cpu --tiny   # a rehearsal of the same code on CPU
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from mmpipe.assemble.graphs import sample_inputs
from mmpipe.assemble.placement import make_plans, write_plans
from mmpipe.config import ModelConfig, RunConfig, compose_config, from_dict
from mmpipe.data import MovingShapesDataset, caption_vocabulary
from mmpipe.graph import Graph, TensorSpec
from mmpipe.models.wan import T2V_TRAIN_EDGES, build_full_wan_pipeline, build_text_stage
from mmpipe.report.recording import top_kernels
from mmpipe.sched.cost import measure_graph_costs
from mmpipe.stages import WanDiTFlowMatchingStage, WanVAEEncodeStage
from mmpipe.stages.dit import sample_flow_matching
from mmpipe.train.data import Collator
from mmpipe.train.loop import start_rank

H200_BF16_PEAK = 989e12  # dense bf16 FLOP/s (configs/cluster/h200_8.yaml)
RESULT: dict[str, Any] = {}


def log(msg: str) -> None:
    print(f"[gpu_train {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def preset(tiny: bool) -> ModelConfig:
    """The Wan2.1-T2V-1.3B architecture preset, or a shrunken copy for a CPU rehearsal."""
    spec = from_dict(ModelConfig, compose_config("plan", ["model=wan1_3b_t2v"])["model"], "model.")
    if not tiny:
        return spec
    arch = dict(spec.arch or {})
    arch["text"] = {**arch["text"], "num_layers": 1, "d_model": 64, "d_ff": 128, "num_heads": 2, "vocab_size": 512}
    arch["vae"] = {**arch["vae"], "base_dim": 8, "num_res_blocks": 1}
    arch["dit"] = {**arch["dit"], "num_layers": 2, "num_attention_heads": 2, "attention_head_dim": 32}
    arch["dit"].update(ffn_dim=128, text_dim=64, freq_dim=32)
    return dataclasses.replace(spec, arch=arch, text_len=16)


def training_graph(pipe: Any, spec: ModelConfig) -> Graph:
    """The t2v training graph over the pipeline's module objects (mmpipe's Python graph API)."""
    g = Graph("t2v_train")
    g.add_input("input_ids", TensorSpec(("B", spec.text_len), torch.int64))
    g.add_input("attention_mask", TensorSpec(("B", spec.text_len), torch.int64))
    g.add_input("video", TensorSpec(("B", 3, "T", "H", "W"), torch.float32))
    g.add_stage(build_text_stage("text", pipe.text_encoder, pipe.tokenizer, max_length=spec.text_len))
    g.add_stage(WanVAEEncodeStage.from_module("vae", pipe.vae))
    g.add_stage(WanDiTFlowMatchingStage.from_module("dit", pipe.transformer, shift=spec.flow_shift))
    for src, dst in T2V_TRAIN_EDGES:
        g.connect(src, dst)
    g.validate()
    return g


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def peak_gib(device: torch.device) -> float | None:
    return torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None


def reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


Batches = Callable[[int], dict[str, torch.Tensor]]  # step -> the step's collated micro-batch


def run_baseline(pipe: Any, batch: Batches, args: argparse.Namespace, shift: float) -> list[float]:
    """Seconds per step of the diffusers-example loop: without gradient checkpointing if it fits."""
    try:
        return baseline_steps(pipe, batch, args, shift, checkpointing=False)
    except torch.OutOfMemoryError:
        log("baseline: out of memory without gradient checkpointing; again with it")
        pipe.transformer.zero_grad(set_to_none=True)
        torch.cuda.empty_cache()
        return baseline_steps(pipe, batch, args, shift, checkpointing=True)


def baseline_steps(
    pipe: Any, batches: Batches, args: argparse.Namespace, shift: float, *, checkpointing: bool
) -> list[float]:
    device = torch.device(args.device)
    RESULT["baseline_gradient_checkpointing"] = checkpointing
    text_encoder, vae, dit = pipe.text_encoder, pipe.vae.to(torch.bfloat16), pipe.transformer
    dit.train()
    if checkpointing:
        dit.enable_gradient_checkpointing()
    # fused, as mmpipe's optimizer is: the flag a user tuning this loop sets first
    opt = torch.optim.AdamW([p for p in dit.parameters() if p.requires_grad], lr=1e-5, weight_decay=0.01, fused=True)
    mean = torch.tensor(vae.config.latents_mean, device=device).view(1, -1, 1, 1, 1)
    inv_std = 1.0 / torch.tensor(vae.config.latents_std, device=device).view(1, -1, 1, 1, 1)
    times = []

    def one_step(step: int) -> torch.Tensor:
        batch = batches(step)
        ids, mask = batch["input_ids"].to(device), batch["attention_mask"].to(device)
        video = batch["video"].to(device)
        with torch.no_grad():
            context = text_encoder(ids, mask).last_hidden_state
            context = context * mask[..., None].to(context.dtype)  # WanPipeline zeroes the padding
            x0 = (vae.encode(video.to(torch.bfloat16)).latent_dist.mode().float() - mean) * inv_std
        noise, sigma = sample_flow_matching(x0, seed=step, shift=shift)
        s = sigma.view(-1, 1, 1, 1, 1)
        xs = (1 - s) * x0 + s * noise
        with torch.autocast(device.type, dtype=torch.bfloat16):
            pred = dit(hidden_states=xs, timestep=sigma * 1000, encoder_hidden_states=context, return_dict=False)[0]
        loss = F.mse_loss(pred.float(), (noise - x0).float())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(dit.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    for step in range(args.warmup + args.steps):
        sync(device)
        t0 = time.perf_counter()
        loss = one_step(step)
        sync(device)
        times.append(time.perf_counter() - t0)
        log(f"baseline step {step}: {times[-1]:.3f} s, loss {loss.item():.4f}")
    if args.profile:
        RESULT["profile_baseline"] = top_kernels(lambda: one_step(args.warmup + args.steps))
    dit.disable_gradient_checkpointing()
    return times[args.warmup :]  # the optimizer and its state go with this frame


def mmpipe_config(spec: ModelConfig, args: argparse.Namespace, run_dir: Path, budget_gb: float | None) -> RunConfig:
    overrides = [
        f"run_dir={run_dir}",
        f"device={args.device}",
        f"data.frames={args.frames}",
        f"data.height={args.height}",
        f"data.width={args.width}",
        "data.num_samples=4",
        "data.val_samples=1",
        "train.batch_size=1",
        "train.micro_batches=1",
        "train.lr=1e-5",
        "train.warmup_steps=0",
        "train.progress=false",
    ]
    if not args.no_policy:
        overrides += ["memory.dit.policy=auto"] + ([f"memory.dit.budget_gb={budget_gb}"] if budget_gb else [])
    cfg = from_dict(RunConfig, compose_config("train", overrides))
    return dataclasses.replace(cfg, model=dataclasses.replace(spec, compile=args.compile))


def run_mmpipe(
    graph: Graph, cfg: RunConfig, args: argparse.Namespace, clips: list[dict[str, Any]]
) -> tuple[list[float], dict[str, Any]]:
    """Seconds per step of mmpipe's training loop, and the DiT group's activation policy."""
    device = torch.device(args.device)
    assert cfg.run_dir is not None
    Path(cfg.run_dir).mkdir(parents=True, exist_ok=True)
    write_plans(Path(cfg.run_dir), *make_plans(graph, cfg))  # what prepare_run writes for the loop to read
    loop = start_rank(cfg, graph, rank=0, world_size=1)
    loop.train_set = clips  # type: ignore[assignment]  # the clips drawn once, as the baseline reads them
    group = loop.train_plan.groups["dit"]
    policy = {"recompute": group.recompute, "offload": group.offload, "blocks": group.blocks}
    log(f"mmpipe plan: dit policy {policy}")
    times = []
    for step in range(args.warmup + args.steps):
        sync(device)
        t0 = time.perf_counter()
        record = loop.train_step(step) or {}
        sync(device)
        times.append(time.perf_counter() - t0)
        log(f"mmpipe step {step}: {times[-1]:.3f} s, loss {record.get('loss', float('nan')):.4f}")
    if args.profile:
        RESULT["profile_mmpipe"] = top_kernels(lambda: loop.train_step(args.warmup + args.steps))
    return times[args.warmup :], policy


def dit_model_flops(graph: Graph, spec: ModelConfig, args: argparse.Namespace) -> float:
    shapes = sample_inputs(graph, spec.text_len, args.frames, args.height, args.width)
    cost = measure_graph_costs(graph, shapes, dtype=torch.bfloat16, cache=False)["dit"]
    return cost.forward_flops + cost.backward_flops


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--tiny", action="store_true", help="a shrunken architecture (CPU rehearsal)")
    p.add_argument("--frames", type=int, default=33)
    p.add_argument("--height", type=int, default=480)
    p.add_argument("--width", type=int, default=832)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--budget-gb", type=float, default=None, help="mmpipe's DiT memory budget (default: the GPU's)")
    p.add_argument("--no-policy", action="store_true", help="mmpipe keeps every activation (no memory policy)")
    p.add_argument("--compile", action="store_true", help="mmpipe with model.compile=true (regional compilation)")
    p.add_argument("--profile", action="store_true", help="one more step a side under torch.profiler: top kernels")
    args = p.parse_args(argv)
    if args.tiny:
        args.frames, args.height, args.width = min(args.frames, 9), min(args.height, 64), min(args.width, 64)
    if (args.frames - 1) % 4 or args.height % 16 or args.width % 16:
        p.error(
            f"--frames must be 4k+1 and --height/--width multiples of 16, got {args.frames}x{args.height}x{args.width}"
        )
    if args.device == "cpu" and not args.no_policy and args.budget_gb is None:
        args.budget_gb = 1.0  # CPU ranks have no device memory to budget against
    if args.warmup < 1 or args.steps < 1:
        p.error("--warmup and --steps must be >= 1")
    return args


def on_term(*_: Any) -> None:
    print(json.dumps({**RESULT, "killed": True}), flush=True)
    sys.exit(124)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, on_term)
    device = torch.device(args.device)
    spec = preset(args.tiny)
    t0 = time.perf_counter()
    pipe = build_full_wan_pipeline(spec, caption_vocabulary(), device=device, seed=0)
    pipe.transformer.float()  # trained: float32 master weights on both sides
    log(f"built the pipeline on {device} in {time.perf_counter() - t0:.1f} s")
    graph = training_graph(pipe, spec)
    RESULT.update(
        benchmark="gpu_train",
        device=args.device,
        gpu=torch.cuda.get_device_name(device) if device.type == "cuda" else None,
        torch=torch.__version__,
        shape={"frames": args.frames, "height": args.height, "width": args.width, "micro_batch": 1},
        baseline="plain PyTorch loop as diffusers' training examples write it (bf16 autocast, AdamW, frozen "
        "text encoder and VAE in bf16; gradient checkpointing only if the step does not fit without it)",
    )
    with tempfile.TemporaryDirectory(prefix="mmpipe-gpu-train-") as tmp:
        budget = args.budget_gb
        cfg = mmpipe_config(spec, args, Path(tmp) / "run", budget)
        pipe.tokenizer.save_pretrained(Path(tmp) / "run" / "pipeline" / "tokenizer")  # what the collator reads
        collate = Collator(graph, Path(tmp) / "run" / "pipeline", spec.text_len)
        data = MovingShapesDataset(num_samples=4, frames=args.frames, height=args.height, width=args.width)
        clips = [data[i] for i in range(len(data))]
        reset_peak(device)
        base = run_baseline(pipe, lambda step: collate([clips[step % len(clips)]]), args, spec.flow_shift)
        RESULT.update(samples_per_s_baseline=[1 / t for t in base], peak_gib_baseline=peak_gib(device))
        with contextlib.suppress(RuntimeError):
            torch.cuda.empty_cache()
        reset_peak(device)
        try:
            mine, policy = run_mmpipe(graph, cfg, args, clips)
        except torch.OutOfMemoryError as err:
            RESULT.update(mmpipe_error=f"out of memory: {str(err).splitlines()[0]}", memory_budget_gb=budget)
            print(json.dumps(RESULT), flush=True)
            return 3
    ratios = [b / m for b, m in zip(base, mine, strict=True)]  # samples/s ratio = time ratio inverted
    flops = dit_model_flops(graph, spec, args)
    mfu = [flops / t / H200_BF16_PEAK for t in mine]
    RESULT.update(
        samples_per_s_mmpipe=[1 / t for t in mine],
        peak_gib_mmpipe=peak_gib(device),
        mmpipe_settings={
            "precision": "bf16" if device.type == "cuda" else "fp32",
            "kernels": "auto",
            "dit_memory": policy,
            "memory_budget_gb": budget,
        },
        ratio=statistics.median(ratios),
        ratio_range=[min(ratios), max(ratios)],
        dit_model_flops_per_step=flops,
        mfu=statistics.median(mfu) if device.type == "cuda" else None,
        mfu_range=[min(mfu), max(mfu)] if device.type == "cuda" else None,
    )
    print(json.dumps(RESULT), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
