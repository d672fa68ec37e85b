"""``mmpipe train`` on one process: the text-to-video graph trained with flow matching.

Every micro-batch's inputs (which samples, which noise, which timestep) are a pure function of
``(train.seed, step, micro-batch)``, never of a running RNG, so a resumed run and an uninterrupted
run produce bitwise-identical loss trajectories, and the distributed runtime can reproduce the
single-process run exactly.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import logging
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import yaml
from torch.utils.data import Subset
from tqdm.auto import tqdm

from mmpipe.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from mmpipe.config import DataConfig, ModelConfig, RunConfig, from_dict, to_dict
from mmpipe.data import FolderVideoDataset, MovingShapesDataset, caption_vocabulary
from mmpipe.graph import Graph
from mmpipe.pipelines import build_t2v_training_graph
from mmpipe.presets import save_tiny_wan_pipeline
from mmpipe.stages import TextEncoderStage

logger = logging.getLogger(__name__)

SizedDataset = MovingShapesDataset | FolderVideoDataset | Subset

CONFIG_FILE = "config.yaml"
METRICS_FILE = "metrics.jsonl"


# ---- run directory -------------------------------------------------------------------------------
def resolve_run_dir(cfg: RunConfig) -> Path:
    """The run directory: ``cfg.run_dir`` or ``runs/<model>-<timestamp>``; checked against ``resume``."""
    if cfg.run_dir is None:
        if cfg.train.resume:
            raise ValueError("train.resume=true needs run_dir=<the run to continue>")
        stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
        return Path("runs") / f"{cfg.model.name}-{stamp}"
    run_dir = Path(cfg.run_dir)
    if cfg.train.resume and latest_checkpoint(run_dir) is None:
        raise ValueError(f"train.resume=true but run_dir={str(run_dir)!r} has no checkpoint")
    if not cfg.train.resume and latest_checkpoint(run_dir) is not None:
        raise ValueError(f"run_dir={str(run_dir)!r} already has checkpoints: pass train.resume=true or a new run_dir")
    return run_dir


def load_run_config(run_dir: Path) -> RunConfig:
    """The config a run was trained with (``RUN_DIR/config.yaml``)."""
    path = run_dir / CONFIG_FILE
    if not path.is_file():
        raise ValueError(f"{str(run_dir)!r} is not an mmpipe run directory (no {CONFIG_FILE})")
    return from_dict(RunConfig, yaml.safe_load(path.read_text()))


def check_resume_compatible(old: RunConfig, new: RunConfig) -> None:
    """A resumed run may change steps / logging, not the model or the data."""
    for section in ("model", "data"):
        if getattr(old, section) != getattr(new, section):
            raise ValueError(f"train.resume=true: {section} config differs from the checkpointed run's")


def pipeline_dir(model: ModelConfig, run_dir: Path) -> Path:
    """The model's WanPipeline-layout directory: ``model.path``, or the run's tiny preset."""
    return Path(model.path) if model.path is not None else run_dir / "pipeline"


# ---- data ----------------------------------------------------------------------------------------
def build_datasets(data: DataConfig) -> tuple[SizedDataset, SizedDataset]:
    """(train, validation) datasets; moving shapes validation clips come from a different seed."""
    size = {"frames": data.frames, "height": data.height, "width": data.width}
    if data.root is None:
        train = MovingShapesDataset(num_samples=data.num_samples, seed=data.seed, **size)
        val = MovingShapesDataset(num_samples=data.val_samples, seed=data.seed + 7919, **size)
        return train, val
    folder = FolderVideoDataset(root=data.root, captions_file=data.captions_file, **size)
    return folder, Subset(folder, range(min(data.val_samples, len(folder))))


def vocabulary(train_set: SizedDataset) -> list[str]:
    """Texts whose words the tiny preset's tokenizer must know: every caption of the data."""
    if isinstance(train_set, FolderVideoDataset):
        return [entry.caption for entry in train_set.entries]
    return caption_vocabulary()


def sample_indices(step: int, batch_size: int, n: int, seed: int) -> list[int]:
    """The dataset indices of ``step``: epoch-wise permutations seeded by (seed, epoch)."""
    out = []
    for g in range(step * batch_size, (step + 1) * batch_size):
        epoch, pos = divmod(g, n)
        perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed * 100_003 + epoch))
        out.append(int(perm[pos]))
    return out


def collate(text: TextEncoderStage, samples: Sequence[Mapping[str, Any]]) -> dict[str, torch.Tensor]:
    """Graph inputs of a micro-batch: tokenised captions and stacked videos."""
    tokens = text.tokenize([s["caption"] for s in samples])
    return {**tokens, "video": torch.stack([s["video"] for s in samples])}


def micro_batches(
    dataset: SizedDataset, indices: list[int], n_micro: int, text: TextEncoderStage
) -> Iterator[dict[str, torch.Tensor]]:
    """Split ``indices`` into ``n_micro`` equal micro-batches of graph inputs."""
    size = len(indices) // n_micro
    for m in range(n_micro):
        yield collate(text, [dataset[i] for i in indices[m * size : (m + 1) * size]])


def micro_batch_seed(seed: int, step: int, micro: int) -> int:
    """The noise / timestep seed of one micro-batch (``step=-1`` is the validation set)."""
    return (seed * 1_000_003 + step + 1) * 1024 + micro


# ---- the loop ------------------------------------------------------------------------------------
@dataclasses.dataclass
class TrainResult:
    """What a finished ``train`` call returns."""

    run_dir: Path
    steps: int
    first_val_loss: float | None
    last_val_loss: float


def loss_of(graph: Graph, inputs: dict[str, torch.Tensor], seed: int, bf16: bool) -> torch.Tensor:
    """One micro-batch through the graph; the DiT stage returns the flow-matching loss."""
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        return graph.run(inputs, {"dit": {"seed": seed}})["dit"]["loss"]


def validation_loss(graph: Graph, val_batches: list[dict[str, torch.Tensor]], cfg: RunConfig) -> float:
    """Mean flow-matching loss on the fixed validation set with fixed noise."""
    with torch.no_grad():
        losses = [
            loss_of(graph, b, micro_batch_seed(cfg.train.seed, -1, m), cfg.train.bf16).item()
            for m, b in enumerate(val_batches)
        ]
    return sum(losses) / len(losses)


def train(cfg: RunConfig) -> TrainResult:
    """Train the DiT of the text-to-video graph; returns the run directory and validation losses."""
    run_dir = resolve_run_dir(cfg)
    if cfg.train.resume:
        check_resume_compatible(load_run_config(run_dir), cfg)
    if cfg.train.threads:
        torch.set_num_threads(cfg.train.threads)
    train_set, val_set = build_datasets(cfg.data)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / CONFIG_FILE).write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))
    pipe_dir = pipeline_dir(cfg.model, run_dir)
    if cfg.model.path is None and not (pipe_dir / "model_index.json").is_file():
        save_tiny_wan_pipeline(cfg.model, vocabulary(train_set), pipe_dir, seed=cfg.train.seed)
    graph = build_t2v_training_graph(pipe_dir, text_len=cfg.model.text_len)
    text, model = graph.stages["text"], graph.stages["dit"].module
    assert isinstance(text, TextEncoderStage)
    model.train()
    tc = cfg.train
    optimizer = torch.optim.AdamW(model.parameters(), lr=tc.lr, weight_decay=tc.weight_decay)
    lr_sched = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / (tc.warmup_steps + 1)))
    start = 0
    if tc.resume:
        ckpt = latest_checkpoint(run_dir)
        assert ckpt is not None
        extra = {"lr_sched": lr_sched.state_dict()}
        start = load_checkpoint(ckpt, model, optimizer, extra)
        lr_sched.load_state_dict(extra["lr_sched"])
        logger.info("resumed from %s at step %d", ckpt, start)
    print(graph)
    n_micro = tc.micro_batches
    val_batches = list(micro_batches(val_set, list(range(len(val_set))), min(n_micro, len(val_set)), text))
    metrics = open_metrics(run_dir, keep_until=start)
    first_val = None
    if start == 0:
        first_val = validation_loss(graph, val_batches, cfg)
        _log(metrics, {"step": 0, "val_loss": first_val})
    last_val = first_val
    bar = tqdm(total=tc.steps, initial=start, desc="train", disable=not tc.progress, dynamic_ncols=True)
    t0, window = time.perf_counter(), 0
    for step in range(start, tc.steps):
        indices = sample_indices(step, tc.batch_size, len(train_set), cfg.data.seed)
        total = torch.zeros(())
        for m, inputs in enumerate(micro_batches(train_set, indices, n_micro, text)):
            loss = loss_of(graph, inputs, micro_batch_seed(tc.seed, step, m), tc.bf16)
            (loss / n_micro).backward()
            total += loss.detach() / n_micro
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), tc.grad_clip or float("inf"))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        lr_sched.step()
        window += tc.batch_size
        done = step + 1
        record: dict[str, Any] = {"step": done, "loss": total.item(), "grad_norm": grad_norm.item()}
        record["lr"] = lr_sched.get_last_lr()[0]
        if done % tc.log_every == 0 or done == tc.steps:
            elapsed = time.perf_counter() - t0
            record["samples_per_s"] = window / elapsed
            t0, window = time.perf_counter(), 0
        if done % tc.val_every == 0 or done == tc.steps:
            last_val = record["val_loss"] = validation_loss(graph, val_batches, cfg)
        _log(metrics, record)
        if done % tc.ckpt_every == 0 or done == tc.steps:
            save_checkpoint(run_dir, done, model, optimizer, {"lr_sched": lr_sched.state_dict()})
        bar.set_postfix(loss=f"{record['loss']:.4f}", **_speed(record))
        bar.update(1)
    bar.close()
    metrics.close()
    if last_val is None:  # resumed at the last step: nothing ran
        last_val = validation_loss(graph, val_batches, cfg)
    return TrainResult(run_dir=run_dir, steps=tc.steps, first_val_loss=first_val, last_val_loss=last_val)


def _speed(record: dict[str, Any]) -> dict[str, str]:
    return {"samples/s": f"{record['samples_per_s']:.1f}"} if "samples_per_s" in record else {}


def _log(stream: Any, record: dict[str, Any]) -> None:
    stream.write(json.dumps(record) + "\n")
    stream.flush()


def open_metrics(run_dir: Path, keep_until: int) -> Any:
    """``metrics.jsonl`` for appending, without records past ``keep_until`` (a killed run's tail)."""
    path = run_dir / METRICS_FILE
    kept = [r for r in read_metrics(run_dir) if r["step"] <= keep_until] if keep_until and path.exists() else []
    stream = path.open("w")
    for record in kept:
        _log(stream, record)
    return stream


def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    """The records of ``RUN_DIR/metrics.jsonl``."""
    lines = (run_dir / METRICS_FILE).read_text().splitlines()
    return [json.loads(line) for line in lines if line.strip()]
