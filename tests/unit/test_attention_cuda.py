"""The CUDA paths of the LSE attention backends that ring attention merges: ``torch`` (ATen's
FlashAttention forward and backward operators) and ``xformers`` (``xformers.ops.fmha``), against the
float64 ``math`` backend on the same inputs. Skipped without CUDA (run by ``benchmarks/gpu_checks.sh``).

Tolerance: bf16 on the GPU against float64 math: a few bf16 ulps (eps 2^-8) on O(1) values, as the
Triton kernels' bf16 tolerance (10 eps); the LSE is kept in float32 by every kernel (1e-5).
"""

from __future__ import annotations

import random

import pytest
import torch

from mmpipe.parallel.attention import attention_backward, attention_with_lse, select_backend

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="the CUDA paths need CUDA")


@pytest.mark.parametrize("backend", ["torch", "xformers"])
@pytest.mark.parametrize(
    ("s", "t", "causal"), [(300, 300, False), (300, 300, True), (200, 333, True)], ids=str
)  # fmt: skip
@pytest.mark.parametrize("merged_out", [False, True], ids=["own-out", "merged-out"])
def test_lse_backends_on_cuda_match_the_float64_reference(
    backend: str, s: int, t: int, causal: bool, merged_out: bool
) -> None:
    """Forward (output and LSE) and backward. Causal with S != T is top-left aligned (as the ``math``
    backend), which xFormers' FlashAttention operator refuses, so that case runs its CUTLASS one;
    ATen's flash operator aligns it bottom-right, so the ``torch`` backend refuses it.
    ``merged-out`` hands the backward a fresh contiguous ``(B, H, S, D)`` output, as a ring merge
    does, instead of the forward's own (strided) one."""
    if backend == "xformers":
        pytest.importorskip("xformers.ops.fmha")
    seed = random.randrange(2**31)
    torch.manual_seed(seed)
    impl, ref = select_backend(backend), select_backend("math")
    q, k, v = (torch.randn(2, 4, n, 128, device="cuda", dtype=torch.bfloat16) for n in (s, t, t))
    dout = torch.randn_like(q)
    scale = 128**-0.5
    if backend == "torch" and causal and s != t:
        with pytest.raises(ValueError, match=rf"causal attention with {s} queries and {t} keys: .* bottom-right"):
            attention_with_lse(impl, q, k, v, causal=causal, scale=scale)
        return
    out, lse = attention_with_lse(impl, q, k, v, causal=causal, scale=scale)
    given = out.contiguous().clone() if merged_out else out
    grads = attention_backward(impl, dout, q, k, v, given, lse, causal=causal, scale=scale)
    q64, k64, v64, do64 = (x.double() for x in (q, k, v, dout))
    out_ref, lse_ref = attention_with_lse(ref, q64, k64, v64, causal=causal, scale=scale)
    want = attention_backward(ref, do64, q64, k64, v64, out_ref, lse_ref, causal=causal, scale=scale)
    tol = 10 * 2**-8
    msg = f"{backend}, seed {seed}"
    torch.testing.assert_close(out.double(), out_ref, rtol=tol, atol=tol, msg=msg)
    torch.testing.assert_close(lse.double(), lse_ref, rtol=1e-5, atol=1e-5, msg=msg)
    for name, g, w in zip("qkv", grads, want, strict=True):
        assert torch.isfinite(g).all(), f"d{name}: {msg}"
        torch.testing.assert_close(g.double(), w, rtol=tol, atol=tol, msg=f"d{name}, {msg}")
