"""Row-exact batching: a batched forward whose every row is bitwise the row computed alone.

Batching requests must not change their outputs: the same seed gives the same video whether a
request ran alone (``graph.generate``) or with others. Most of a DiT is row-independent in exact
arithmetic, but two kinds of kernels pick a different reduction order by batch size (measured
with torch 2.13 on x86 CPUs): convolutions (oneDNN chooses its algorithm by shape) and GEMMs with
a handful of rows (BLAS takes a small-M path below ~16 rows). :func:`make_row_exact` runs exactly
those per sample, so every kernel sees the shapes it sees at batch size one, and the big GEMMs and
attention (row-exact at every batch size measured) keep the batch. A test checks the property on
the serving stages.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

SMALL_M = 16  # GEMMs with fewer rows per sample than this run per sample


def _per_sample(forward: Any, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    return torch.cat([forward(x[i : i + 1], *args, **kwargs) for i in range(x.shape[0])])


class _RowExactConv(nn.Module):
    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        if x.shape[0] == 1:
            return self.inner(x, *args, **kwargs)
        return _per_sample(self.inner, x, *args, **kwargs)


class _RowExactLinear(nn.Module):
    def __init__(self, inner: nn.Linear) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows_per_sample = x[0].numel() // x.shape[-1] if x.dim() > 1 else x.numel()
        if x.dim() < 2 or x.shape[0] == 1 or rows_per_sample >= SMALL_M:
            return self.inner(x)
        return _per_sample(self.inner, x)


def make_row_exact(module: nn.Module) -> int:
    """Wrap, in place, the convolutions and linears of ``module`` that batching would change;
    returns how many were wrapped. Parameters are shared, so weights and state dicts are untouched
    (the wrappers add one ``inner.`` level to the parameter names of wrapped modules)."""
    targets = [
        (parent, name, child)
        for parent in module.modules()
        for name, child in parent.named_children()
        if isinstance(child, nn.Conv1d | nn.Conv2d | nn.Conv3d | nn.Linear)
    ]
    for parent, name, child in targets:
        wrapper = _RowExactLinear(child) if isinstance(child, nn.Linear) else _RowExactConv(child)
        setattr(parent, name, wrapper)
    return len(targets)
