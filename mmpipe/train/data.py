"""Training data: which samples a step reads, and samples -> a micro-batch's graph inputs."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from diffusers.pipelines.wan.pipeline_wan import prompt_clean
from transformers import AutoTokenizer

from mmpipe.data.datasets import SizedDataset
from mmpipe.graph import Graph
from mmpipe.models.u2g import vision_pixels
from mmpipe.stages.text import tokenize


def sample_indices(step: int, batch_size: int, n: int, seed: int, *, lanes: int = 1) -> list[int]:
    """The dataset indices of ``step``'s global batch: every sample once an epoch, in an order
    seeded by (seed, epoch).

    ``lanes`` (the micro-batch size) deals the data set once, at random by ``seed``, into that many
    lanes, and row ``j`` of every micro-batch takes lane ``j``'s next sample (each lane its own
    epochs, shuffled each). A sample then sits at the same row of its micro-batch every epoch, so
    the data-parallel replica of a stage that holds that row (a contiguous slice of the rows) is
    always the same one: the replica that computed a frozen stage's output for it in the first epoch
    holds it in its frozen-output cache after. Only samples of different lanes share a micro-batch.
    ``lanes=1`` (and a data set smaller than ``lanes``) is a plain shuffle of the whole set each epoch."""
    if lanes < 1 or batch_size % lanes:
        raise ValueError(f"sample_indices: {lanes} lanes do not divide a batch of {batch_size}")
    if n < lanes:
        lanes = 1
    members = list(range(n))
    if lanes > 1:
        members = torch.randperm(n, generator=torch.Generator().manual_seed(seed * 100_003 - 1)).tolist()
    out = []
    perms: dict[tuple[int, int], list[int]] = {}  # (lane, epoch) -> the lane's order that epoch
    for g in range(step * batch_size, (step + 1) * batch_size):
        lane, q = g % lanes, g // lanes
        epoch, pos = divmod(q, len(range(lane, n, lanes)))
        if (lane, epoch) not in perms:
            lane_members = members[lane::lanes]
            gen = torch.Generator().manual_seed((seed * 100_003 + epoch) * lanes + lane)
            perms[(lane, epoch)] = [lane_members[i] for i in torch.randperm(len(lane_members), generator=gen).tolist()]
        out.append(perms[(lane, epoch)][pos])
    return out


def dropped_captions(step: int, batch_size: int, fraction: float, seed: int) -> list[bool]:
    """Which of ``step``'s samples train with the empty caption (``train.caption_dropout``): a draw
    seeded by (seed, step), so every rank and a resumed run drop the same ones."""
    if fraction <= 0.0:
        return [False] * batch_size
    gen = torch.Generator().manual_seed(seed * 1_000_003 + step + 7)
    return (torch.rand(batch_size, generator=gen) < fraction).tolist()


def without_caption(sample: Mapping[str, Any]) -> dict[str, Any]:
    """``sample`` with the empty caption: what guidance's negative prompt encodes."""
    return {**sample, "caption": ""}


class Collator:
    """Samples -> the graph inputs of a micro-batch: tokens, videos and (u2g) the conditioning image.

    A graph whose ``text`` stage tokenizes for itself (a ``tokenize(prompts, max_length)`` method:
    the text encoder stages, e.g. HunyuanVideo's template and two tokenizers) gets that stage's
    tokens; otherwise the pipeline directory's ``tokenizer`` pads captions to ``text_len``."""

    def __init__(self, graph: Graph, pipe_dir: Path, text_len: int) -> None:
        text = graph.stages.get("text")
        self.stage_tokenize: Callable[[list[str], int], dict[str, torch.Tensor]] | None = getattr(
            text, "tokenize", None
        )
        if self.stage_tokenize is None:
            self.tokenizer = AutoTokenizer.from_pretrained(pipe_dir / "tokenizer")
        self.clean = prompt_clean if text is not None else None
        self.text_len = text_len
        self.image = "pixel_values" in graph.input_specs

    def __call__(self, samples: Sequence[Mapping[str, Any]]) -> dict[str, torch.Tensor]:
        captions = [s["caption"] for s in samples]
        if self.stage_tokenize is not None:
            tokens = self.stage_tokenize(captions, self.text_len)
        else:
            tokens = tokenize(self.tokenizer, captions, max_length=self.text_len, clean=self.clean)
        video_B3THW = torch.stack([s["video"] for s in samples])
        out = {**tokens, "video": video_B3THW}
        if self.image:  # the first frame, at the vision tower's resolution
            out["pixel_values"] = vision_pixels(video_B3THW[:, :, 0])
        return out


def micro_batches(
    dataset: SizedDataset, indices: list[int], n_micro: int, collate: Collator
) -> Iterator[dict[str, torch.Tensor]]:
    """Split ``indices`` into ``n_micro`` equal micro-batches of graph inputs."""
    size = len(indices) // n_micro
    for m in range(n_micro):
        yield collate([dataset[i] for i in indices[m * size : (m + 1) * size]])


def micro_batch_seed(seed: int, step: int, micro: int) -> int:
    """The noise / timestep seed of one micro-batch (``step=-1`` is the validation set)."""
    return (seed * 1_000_003 + step + 1) * 1024 + micro
