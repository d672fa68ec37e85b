"""Outputs of a training graph's frozen prefix (the VAE encoder, the text encoder), kept per sample.

A frozen stage fed only by the data (:meth:`mmpipe.graph.Graph.frozen_prefix`) computes the same
output for a sample every epoch, so after the first epoch it is wasted work: on the tiny preset the
frozen VAE's encode is two thirds of a step. This is what video trainers do offline (diffusers'
and FastVideo's latent pre-computation, VeOmni's and Open-Sora's cached latents), done inside the
run: the rank that runs a stage's forward keeps each row's outputs under the sample's key (the
training loop's ``(split, dataset index, caption dropped)``); a micro-batch whose rows are all kept
is served from memory and its inputs are never loaded. Rows live on the host, up to
``train.cache_frozen_gb`` per rank; past the cap, new rows are computed and not kept.

The cache assumes a sample's data is the same every time it is read: a dataset that augments at
random must run with ``train.cache_frozen_gb=0``.
"""

from __future__ import annotations

import logging
from collections.abc import Hashable, Mapping, Sequence

import torch

logger = logging.getLogger(__name__)


class FrozenOutputCache:
    """``(stage, sample key) -> {port: row}`` in host memory, bounded by ``max_bytes``."""

    def __init__(self, max_bytes: int) -> None:
        if max_bytes <= 0:
            raise ValueError(f"a frozen-output cache needs a positive byte budget, got {max_bytes}")
        self.max_bytes = max_bytes
        self.bytes = 0
        self.hits = self.misses = 0  # micro-batch rows served / computed
        self._rows: dict[tuple[str, Hashable], dict[str, torch.Tensor]] = {}
        self._full_logged = False

    def __len__(self) -> int:
        return len(self._rows)

    def get(self, stage: str, keys: Sequence[Hashable], device: torch.device) -> dict[str, torch.Tensor] | None:
        """The stage's outputs for ``keys`` stacked as a micro-batch on ``device``, or ``None`` unless
        every key is kept (a partial hit recomputes the whole micro-batch)."""
        rows = [self._rows.get((stage, k)) for k in keys]
        if not keys or any(r is None for r in rows):
            self.misses += len(keys)
            return None
        self.hits += len(keys)
        kept = [r for r in rows if r is not None]
        return {port: torch.stack([r[port] for r in kept]).to(device, non_blocking=True) for port in kept[0]}

    def put(self, stage: str, keys: Sequence[Hashable], outputs: Mapping[str, object]) -> None:
        """Keep each row of ``outputs`` (tensors with one row per key; anything else is not kept)."""
        tensors = {p: v for p, v in outputs.items() if isinstance(v, torch.Tensor)}
        if len(tensors) != len(outputs) or any(t.dim() == 0 or t.shape[0] != len(keys) for t in tensors.values()):
            return
        for i, key in enumerate(keys):
            if (stage, key) in self._rows:
                continue
            row = {p: t[i].detach().to("cpu", copy=True) for p, t in tensors.items()}
            size = sum(t.numel() * t.element_size() for t in row.values())
            if self.bytes + size > self.max_bytes:
                if not self._full_logged:
                    logger.info("frozen-output cache full (%.2f GB): later samples are recomputed", self.bytes / 1e9)
                    self._full_logged = True
                return
            self._rows[(stage, key)] = row
            self.bytes += size
