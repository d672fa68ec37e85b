"""One rank's training loop: its executor, optimizers, validation, metrics and checkpoints."""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import time
from collections.abc import Callable, Hashable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from tqdm.auto import tqdm

from mmpipe.assemble.placement import kernel_choice, read_plans
from mmpipe.config import RunConfig
from mmpipe.data.datasets import build_datasets, input_keys
from mmpipe.devices import run_devices
from mmpipe.errors import NonFiniteError
from mmpipe.graph import Graph
from mmpipe.report.recording import RankRecording
from mmpipe.rundir import latest_checkpoint, open_metrics, pipeline_dir, write_record
from mmpipe.runtime.checkpoint import load_checkpoint, save_checkpoint
from mmpipe.runtime.events import EventRecorder
from mmpipe.runtime.executor import Executor, OptionsFn
from mmpipe.runtime.mesh import MeshOwner
from mmpipe.runtime.optim import StageOptim, adamw
from mmpipe.train.data import (
    Collator,
    dropped_captions,
    micro_batch_seed,
    micro_batches,
    sample_indices,
    without_caption,
)

logger = logging.getLogger(__name__)


def lr_factor(step: int, *, warmup: int, steps: int, schedule: str) -> float:
    """The learning rate of optimizer step ``step`` (0-based) as a fraction of ``train.lr``: a linear
    warm-up over ``warmup`` steps, then constant or a cosine decay that reaches 0 at ``steps``."""
    if step < warmup:
        return (step + 1) / (warmup + 1)
    if schedule == "constant" or steps <= warmup:
        return 1.0
    done = min(1.0, (step - warmup) / (steps - warmup))
    return 0.5 * (1.0 + math.cos(math.pi * done))


@dataclasses.dataclass
class TrainResult:
    """What a finished ``train`` call returns."""

    run_dir: Path
    steps: int
    first_val_loss: float | None
    last_val_loss: float


class TrainLoop:
    """One rank's training loop state: executor, optimizers, data, logging (:func:`start_rank` makes it)."""

    def __init__(self, cfg: RunConfig, graph: Graph, rank: int, world_size: int) -> None:
        assert cfg.run_dir is not None
        self.cfg, self.graph, self.rank = cfg, graph, rank
        self.run_dir = Path(cfg.run_dir)
        self.train_plan, self.val_plan = read_plans(self.run_dir)  # as prepare_run wrote them
        devices = run_devices(cfg, local_ranks=0)  # checked against the GPUs before launch
        self.mesh = MeshOwner(self.train_plan, rank, world_size, device_type=devices.device.value)
        self.micro_size = cfg.train.batch_size // cfg.train.micro_batches
        self.events = EventRecorder(self.run_dir, rank, devices.rank_device())
        self.executor = Executor(
            graph,
            self.train_plan,
            self.mesh,
            batch_size=self.micro_size,
            events=self.events,
            spill_dir=self.run_dir / "spill",
            device=devices.rank_device(),
            precision=devices.precision,
            wire=devices.wire(),
            compile_blocks=cfg.model.compile,
            kernels=kernel_choice(cfg),
            frozen_cache_bytes=int(cfg.train.cache_frozen_gb * 1e9),
        )
        self.executor.optimizers = {s: self._optim(s) for s in self.executor.local if s in self.train_plan.trainable}
        for s in self.executor.optimizers:
            self.executor.modules[s].train()
        self.train_set, val_set = build_datasets(cfg.data, cfg.model.kind)
        self.collate = Collator(graph, pipeline_dir(cfg.model, self.run_dir), cfg.model.text_len)
        n_val = len(val_set) // self.micro_size * self.micro_size
        val_mbs = list(micro_batches(val_set, list(range(n_val)), n_val // self.micro_size, self.collate))
        self.val_batches = val_mbs
        self.trainable = sorted(self.train_plan.trainable)
        self.skipped_in_a_row = self.skipped_total = 0
        self._samples: tuple[int, tuple[list[int], list[bool]]] | None = None  # step_samples' last step

    def _optim(self, stage: str) -> StageOptim:
        tc = self.cfg.train
        params = [p for p in self.executor.modules[stage].parameters() if p.requires_grad]
        opt = adamw(params, lr=tc.lr * (tc.lr_scale or {}).get(stage, 1.0), weight_decay=tc.weight_decay)
        sched = torch.optim.lr_scheduler.LambdaLR(
            opt, lambda s: lr_factor(s, warmup=tc.warmup_steps, steps=tc.steps, schedule=tc.lr_schedule)
        )
        return StageOptim(opt, sched, tc.grad_clip, skip_nonfinite=tc.nonfinite == "skip")

    def options(self, step: int) -> OptionsFn:
        seed = self.cfg.train.seed
        return lambda stage, mb, rows: {"seed": micro_batch_seed(seed, step, mb), "rows": rows}

    def step_samples(self, step: int) -> tuple[list[int], list[bool]]:
        """``step``'s dataset indices and which of them train with the empty caption (drawn once a
        step: the batch and the cache keys both read them)."""
        if self._samples is None or self._samples[0] != step:
            tc = self.cfg.train
            indices = sample_indices(
                step, tc.batch_size, len(self.train_set), self.cfg.data.seed, lanes=self.micro_size
            )
            self._samples = (step, (indices, dropped_captions(step, tc.batch_size, tc.caption_dropout, tc.seed)))
        return self._samples[1]

    def batch_fn(self, step: int) -> Callable[[int], dict[str, torch.Tensor]]:
        """``step``'s micro-batches of graph inputs."""
        indices, drop = self.step_samples(step)
        size = self.micro_size

        def batch(mb: int) -> dict[str, torch.Tensor]:
            rows = range(mb * size, (mb + 1) * size)
            return self.collate(
                [without_caption(self.train_set[indices[j]]) if drop[j] else self.train_set[indices[j]] for j in rows]
            )

        return batch

    def keys_fn(self, step: int) -> Callable[[int], list[dict[str, Hashable]]]:
        """The input keys of ``step``'s micro-batches (:func:`~mmpipe.data.datasets.input_keys`): the
        dataset index, and for the caption's inputs whether it was dropped."""
        indices, drop = self.step_samples(step)
        size, ports = self.micro_size, list(self.graph.input_specs)
        return lambda mb: [input_keys(ports, "train", indices[j], drop[j]) for j in range(mb * size, (mb + 1) * size)]

    def reduce(self, local: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
        """Sum a metrics vector over ranks (each value is owned by one rank, the others add 0)."""
        if self.mesh.distributed:
            dist.all_reduce(local, group=group)
        return local

    @property
    def lead(self) -> bool:
        """The rank that logs: the first rank holding a trainable stage."""
        return self.rank == self.mesh.metrics_ranks[0]

    def train_step(self, step: int) -> dict[str, Any] | None:
        """One optimizer step of this rank's actions; the metrics record on ranks that report them."""
        self.events.step, self.events.phase = step + 1, "train"
        reporting = self.rank in self.mesh.metrics_ranks
        actions = self.train_plan.actions[self.rank]
        out = self.executor.run(
            actions, self.batch_fn(step), self.options(step), flush=reporting, step=step, keys_fn=self.keys_fn(step)
        )
        if not reporting:
            return None
        group = self.mesh.metrics_group
        owned = [self._owns_norm(s) for s in self.trainable]
        norms = [out["grad_norm"].get(s, 0.0) if own else 0.0 for s, own in zip(self.trainable, owned, strict=True)]
        lrs = [
            self.executor.optimizers[s].lr_scheduler.get_last_lr()[0] if own else 0.0
            for s, own in zip(self.trainable, owned, strict=True)
        ]
        spilled = float(self.executor.spill.stats.offloaded_bytes) if self.executor.spill is not None else 0.0
        skipped = float(len(out["skipped"]))
        cache = self.executor.frozen_cache
        hits = float(cache.hits) if cache is not None else 0.0
        # one all-reduce a step: the loss rides in float64 (each rank's float32 share summed exactly,
        # then rounded to float32 as one rank's float32 sum of two shares is)
        loss = out["loss"].detach().cpu().double().reshape(1)
        values = torch.tensor([spilled, skipped, hits, *norms, *lrs], dtype=torch.float64)
        vec = self.reduce(torch.cat([values, loss]), group)
        record: dict[str, Any] = {"step": step + 1, "loss": vec[-1].float().item()}
        if vec[0] > 0:  # activations offloaded so far (all ranks), by the file tier
            record["offloaded_bytes"] = int(vec[0])
        self._count_skipped(step, int(vec[1]), record)
        if vec[2] > 0:  # rows the frozen-output cache served so far (the metrics ranks'; events have every rank's)
            record["frozen_cache_hits"] = int(vec[2])
        k = len(self.trainable)
        for s, norm, lr in zip(self.trainable, vec[3 : 3 + k].tolist(), vec[3 + k : 3 + 2 * k].tolist(), strict=True):
            suffix = "" if k == 1 else f"/{s}"
            record[f"grad_norm{suffix}"], record[f"lr{suffix}"] = norm, lr
        return record

    def _count_skipped(self, step: int, skipped: int, record: dict[str, Any]) -> None:
        """``train.nonfinite=skip``: count the step's dropped updates; stop after ``max_skipped`` in a row."""
        self.skipped_in_a_row = self.skipped_in_a_row + 1 if skipped else 0
        if not skipped:
            return
        self.skipped_total += 1
        record["skipped_updates"], record["skipped_steps"] = skipped, self.skipped_total
        logger.warning("step %d: non-finite gradients, %d stage update(s) skipped", step + 1, skipped)
        if self.skipped_in_a_row >= self.cfg.train.max_skipped:
            raise NonFiniteError(
                f"training step {step + 1}: {self.skipped_in_a_row} steps in a row had non-finite gradients "
                f"(train.max_skipped={self.cfg.train.max_skipped}); the last checkpoint is the last good state"
            )

    def _owns_norm(self, stage: str) -> bool:
        return self.train_plan.groups[stage].ranks[0] == self.rank

    def validation_loss(self) -> float:
        """Mean flow-matching loss on the fixed validation set with fixed noise (forward-only plan)."""
        self.executor.flush()
        n_micro, seed = self.cfg.train.micro_batches, self.cfg.train.seed
        chunks = [self.val_batches[i : i + n_micro] for i in range(0, len(self.val_batches) - n_micro + 1, n_micro)]
        total, self.events.phase = torch.zeros(()), "val"
        ports = list(self.graph.input_specs)
        for c, mbs in enumerate(chunks):

            def options(stage: str, mb: int, rows: tuple[int, int, int], c: int = c) -> dict[str, Any]:
                return {"seed": micro_batch_seed(seed, -1, c * n_micro + mb), "rows": rows}

            def keys(mb: int, c: int = c) -> list[dict[str, Hashable]]:
                first = (c * n_micro + mb) * self.micro_size
                return [input_keys(ports, "val", i, False) for i in range(first, first + self.micro_size)]

            with torch.no_grad():
                out = self.executor.run(self.val_plan.actions[self.rank], mbs.__getitem__, options, keys_fn=keys)
            total += out["loss"].cpu()
        return self.reduce(total.reshape(1))[0].item() / len(chunks)


def start_rank(cfg: RunConfig, graph: Graph, *, rank: int, world_size: int) -> TrainLoop:
    """This process's threads and GPU set for the run, and its rank's loop built (its
    stages on its device, the optimizers of its trainable stages); ``run_rank`` drives it."""
    if cfg.train.threads:
        torch.set_num_threads(cfg.train.threads)
    device = run_devices(cfg, local_ranks=0).rank_device()
    if device.type == "cuda":
        torch.cuda.set_device(device)
    return TrainLoop(cfg, graph, rank, world_size)


def run_rank(cfg: RunConfig, graph: Graph, *, rank: int, world_size: int) -> TrainResult:
    """The training loop of one rank (all ranks run it; rank 0 logs and shows progress); the
    process's torch threads are as before when it returns (``train`` in-process)."""
    threads = torch.get_num_threads()
    try:
        return _run_rank(cfg, graph, rank=rank, world_size=world_size)
    finally:
        torch.set_num_threads(threads)


def _run_rank(cfg: RunConfig, graph: Graph, *, rank: int, world_size: int) -> TrainResult:
    tc = cfg.train
    loop = start_rank(cfg, graph, rank=rank, world_size=world_size)
    run_dir, lead = loop.run_dir, loop.lead
    start = 0
    ckpt = latest_checkpoint(run_dir)
    if ckpt is not None and (tc.resume or _restarted()):
        local_trainable = {s: loop.executor.modules[s] for s in loop.executor.optimizers}
        start = load_checkpoint(ckpt, local_trainable, loop.executor.optimizers)
        logger.info("rank %d resumed from %s at step %d", rank, ckpt, start)
    if lead:
        print(graph)
    metrics = open_metrics(run_dir, keep_until=start) if lead else None
    recording = RankRecording(cfg.profile, run_dir, rank, lambda: loop.events.step)  # memory, profiler window
    first_val = last_val = None
    if start == 0:
        first_val = last_val = loop.validation_loss()
        write_record(metrics, {"step": 0, "val_loss": first_val})
    bar = tqdm(total=tc.steps, initial=start, desc="train", disable=not (tc.progress and lead), dynamic_ncols=True)
    t0, window = time.perf_counter(), 0
    for step in range(start, tc.steps):
        record = loop.train_step(step) or {}
        recording.step()
        window += tc.batch_size
        done = step + 1
        if done % tc.log_every == 0 or done == tc.steps:
            record["samples_per_s"] = window / (time.perf_counter() - t0)
            t0, window = time.perf_counter(), 0
        if done % tc.val_every == 0 or done == tc.steps:
            last_val = record["val_loss"] = loop.validation_loss()
        if lead:
            write_record(metrics, record)
            bar.set_postfix(loss=f"{record['loss']:.4f}", **_speed(record))
        loop.events.flush()
        if done % tc.ckpt_every == 0 or done == tc.steps:
            loop.executor.flush()
            save_checkpoint(run_dir, done, loop.executor.modules, loop.executor.optimizers)
        bar.update(1)
    bar.close()
    loop.executor.flush()
    cache = loop.executor.frozen_cache
    if cache is not None and (cache.hits or cache.misses):
        logger.info(
            "rank %d frozen-output cache: %d rows served, %d computed, %d kept (%.1f MB)",
            loop.rank,
            cache.hits,
            cache.misses,
            len(cache),
            cache.bytes / 1e6,
        )
    recording.close()
    loop.events.close()
    if metrics is not None:
        metrics.close()
    if last_val is None:  # resumed at the last step: nothing ran
        last_val = loop.validation_loss()
    return TrainResult(run_dir=run_dir, steps=tc.steps, first_val_loss=first_val, last_val_loss=last_val)


def _restarted() -> bool:
    """Whether the elastic agent restarted this worker group (then it resumes from the last checkpoint)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0


def _speed(record: dict[str, Any]) -> dict[str, str]:
    return {"samples/s": f"{record['samples_per_s']:.1f}"} if "samples_per_s" in record else {}
