"""Attention by explicit softmax, in plain PyTorch: the reference every backend is tested against,
the ``math`` backend of :mod:`mmpipe.parallel.attention`, and its masked short blocks."""

from __future__ import annotations

import torch


def math_scores(
    q: torch.Tensor, k: torch.Tensor, causal: bool, scale: float, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """The scaled scores ``q k^T * scale`` with an additive ``bias`` and the top-left causal mask."""
    s_BHST = (q @ k.transpose(-1, -2)) * scale
    if bias is not None:  # additive: 0 keeps a key, -inf drops it
        s_BHST = s_BHST + bias
    if causal:  # top-left aligned, as ATen's kernels
        keep = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool, device=q.device).tril()
        s_BHST = s_BHST.masked_fill(~keep, float("-inf"))
    return s_BHST


def math_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float, bias: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out, lse)`` by explicit softmax in the inputs' dtype."""
    s_BHST = math_scores(q, k, causal, scale, bias)
    lse_BHS = torch.logsumexp(s_BHST, dim=-1)
    # A query whose keys are all dropped gets a zero output and an LSE of -inf (no weight in a merge).
    finite_BHS1 = torch.where(torch.isinf(lse_BHS), 0.0, lse_BHS).unsqueeze(-1)
    return torch.exp(s_BHST - finite_BHS1) @ v, lse_BHS


def math_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    causal: bool,
    scale: float,
    bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq, dk, dv)`` of :func:`math_forward` given its ``out`` and ``lse``."""
    p_BHST = torch.exp(math_scores(q, k, causal, scale, bias) - lse.unsqueeze(-1))
    dv = p_BHST.transpose(-1, -2) @ dout
    dp_BHST = dout @ v.transpose(-1, -2)
    delta_BHS1 = (dout * out).sum(-1, keepdim=True)
    ds_BHST = p_BHST * (dp_BHST - delta_BHS1)
    return (ds_BHST @ k) * scale, (ds_BHST.transpose(-1, -2) @ q) * scale, dv
