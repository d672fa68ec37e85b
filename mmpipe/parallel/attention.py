"""The local attention core: output *and* log-sum-exp (LSE) on every backend, with an explicit backward.

Ring attention computes a query block against one key/value block at a time and merges the partial
outputs with their LSEs; its backward calls the core's backward per block with the *merged* output
and LSE, which is exactly the global softmax restricted to that block (FlashAttention-2's backward).
So every backend a ring may use must return the LSE and accept an external output and LSE in its
backward. Backends are chosen once, by :func:`select_backend` (device and dtype, or a config name).

- ``torch``: ATen's fused flash kernels, ``_scaled_dot_product_flash_attention_for_cpu`` (+
  ``_backward``) on CPU, ``_scaled_dot_product_flash_attention`` (+ ``_backward``) on CUDA for
  fp16 / bf16. Returns the LSE.
- ``math``: explicit softmax in the input dtype; any device and dtype (the float64 reference of the
  tests). Returns the LSE.
- ``sdpa``: ``F.scaled_dot_product_attention``, whichever kernel PyTorch dispatches to; no LSE, so
  it serves Ulysses and unsplit attention and refuses ring mode.
- ``triton``: mmpipe's own FlashAttention kernels (``mmpipe.kernels.attention``, custom ops
  ``mmpipe::flash_attn_fwd`` / ``mmpipe::flash_attn_bwd``) on CUDA, any float dtype, head dims 16 to 128
  (powers of two); on CPU only in Triton's interpreter (tests). Returns the LSE; needs ``triton``.
- ``xformers``: ``xformers.ops.fmha``'s forward with LSE and its backward (FlashAttention-2 or CUTLASS,
  whichever xFormers dispatches to) on CUDA, fp16 / bf16 / fp32. Returns the LSE; needs ``xformers``.

Legend: B batch, H heads, S query length, T key length, D head dim. Layout is ``BHSD`` throughout.
"""

from __future__ import annotations

import dataclasses
import enum
import importlib.util
import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from mmpipe.kernels import _triton
from mmpipe.kernels.reference import math_backward, math_forward

ForwardFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, bool, float], tuple[torch.Tensor, torch.Tensor]]
BackwardFn = Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


class AttentionBackend(enum.StrEnum):
    """Names of the attention backends (config values)."""

    TORCH = "torch"
    MATH = "math"
    SDPA = "sdpa"
    TRITON = "triton"
    XFORMERS = "xformers"


@dataclasses.dataclass(frozen=True)
class AttentionImpl:
    """One backend: ``forward(q, k, v, causal, scale) -> (out, lse)`` and
    ``backward(dout, q, k, v, out, lse, causal, scale) -> (dq, dk, dv)``; ``None`` where it has none."""

    name: AttentionBackend
    forward: ForwardFn | None
    backward: BackwardFn | None

    @property
    def returns_lse(self) -> bool:
        """Whether ring attention can use it."""
        return self.forward is not None and self.backward is not None


def _check_cuda_causal(s: int, t: int, causal: bool) -> None:
    if causal and s != t:  # ATen's SDPA front end refuses the same (check_flash_causal_non_square_seqlens)
        raise ValueError(
            f"attention backend 'torch' on CUDA: causal attention with {s} queries and {t} keys: ATen's flash "
            "kernel aligns the causal mask bottom-right, mmpipe's backends top-left; use backend 'triton' or 'math'"
        )


def _torch_forward(
    q_BHSD: torch.Tensor, k_BHTD: torch.Tensor, v_BHTD: torch.Tensor, causal: bool, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    if q_BHSD.is_cuda:
        _check_cuda_causal(q_BHSD.shape[2], k_BHTD.shape[2], causal)
        out = torch.ops.aten._scaled_dot_product_flash_attention(q_BHSD, k_BHTD, v_BHTD, 0.0, causal, scale=scale)
        return out[0], out[1]
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q_BHSD, k_BHTD, v_BHTD, 0.0, causal, scale=scale
    )
    return out, lse


def _torch_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    causal: bool,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    if q.is_cuda:
        _check_cuda_causal(q.shape[2], k.shape[2], causal)
        # The CUDA flash backward takes its forward's bookkeeping: no cumulative sequence lengths for a
        # dense batch (undefined tensors, None here; a defined one would select the varlen kernel), and
        # a philox state that is unused without dropout.
        zero = torch.zeros((), dtype=torch.int64, device=q.device)
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_backward(
            dout, q, k, v, out, lse, None, None, q.shape[2], k.shape[2], 0.0, causal, zero, zero, scale=scale
        )
        return dq, dk, dv
    dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        dout.contiguous(), q, k, v, out, lse, 0.0, causal, scale=scale
    )
    return dq, dk, dv


def _triton_forward(
    q_BHSD: torch.Tensor, k_BHTD: torch.Tensor, v_BHTD: torch.Tensor, causal: bool, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    from mmpipe.kernels.attention import flash_attn_fwd  # imports triton: only when used

    return flash_attn_fwd(q_BHSD, k_BHTD, v_BHTD, causal, scale)


def _triton_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    causal: bool,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    from mmpipe.kernels.attention import flash_attn_bwd  # the Triton kernels (~1 s to import): only when used

    return flash_attn_bwd(dout, q, k, v, out, lse, causal, scale)


def _xformers_bias(causal: bool) -> Any:
    from xformers.ops import fmha  # imports xformers: only when used

    # LowerTriangularMask is top-left aligned (query i sees keys j <= i) for any S, T, as ATen's kernels
    return fmha.attn_bias.LowerTriangularMask() if causal else None


def _xformers_forward(
    q_BHSD: torch.Tensor, k_BHTD: torch.Tensor, v_BHTD: torch.Tensor, causal: bool, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    from xformers.ops import fmha  # optional dependency (mmpipe[xformers])

    try:  # xFormers' layout is BMHK (B, S, H, D): a transpose of ours, no copy
        out_BSHD, lse_BHS = fmha.memory_efficient_attention_forward_requires_grad(
            q_BHSD.transpose(1, 2),
            k_BHTD.transpose(1, 2),
            v_BHTD.transpose(1, 2),
            attn_bias=_xformers_bias(causal),
            scale=scale,
        )
    except NotImplementedError as e:  # no xFormers operator takes these inputs; its message says why
        raise ValueError(
            f"attention backend 'xformers' has no kernel for {q_BHSD.dtype} inputs of head dim {q_BHSD.shape[-1]} "
            f"on {q_BHSD.device} (it runs fp16 / bf16 / fp32 on CUDA): {e}"
        ) from None
    # CUTLASS pads the LSE's query axis to a multiple of 32; its backward pads a given one itself
    return out_BSHD.transpose(1, 2), lse_BHS[..., : q_BHSD.shape[2]]


def _xformers_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    causal: bool,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    from xformers.ops import fmha  # optional dependency (mmpipe[xformers])

    # Contiguous BSHD `out`: the CUTLASS backward (ATen's, which xFormers dispatches for 16-bit causal
    # S != T) reads it with a row stride of heads x head_dim whatever its strides (`o_strideM()` in
    # kernel_backward.h); the transpose of a ring's merged, contiguous BHSD output has another.
    dq, dk, dv = fmha.memory_efficient_attention_backward(
        dout.transpose(1, 2).contiguous(),
        out.transpose(1, 2).contiguous(),
        lse.contiguous(),
        q.transpose(1, 2),
        k.transpose(1, 2),
        v.transpose(1, 2),
        attn_bias=_xformers_bias(causal),
        scale=scale,
    )
    return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)


_BACKENDS = {
    AttentionBackend.TORCH: AttentionImpl(AttentionBackend.TORCH, _torch_forward, _torch_backward),
    AttentionBackend.MATH: AttentionImpl(AttentionBackend.MATH, math_forward, math_backward),
    AttentionBackend.SDPA: AttentionImpl(AttentionBackend.SDPA, None, None),
    AttentionBackend.TRITON: AttentionImpl(AttentionBackend.TRITON, _triton_forward, _triton_backward),
    AttentionBackend.XFORMERS: AttentionImpl(AttentionBackend.XFORMERS, _xformers_forward, _xformers_backward),
}


def select_backend(name: str | AttentionBackend | None = None, *, device: torch.device | str = "cpu") -> AttentionImpl:
    """The backend named ``name`` (a config value, e.g. ``model.kernels.attention``); ``torch`` for ``None``."""
    if name is None:
        name = AttentionBackend.TORCH
    try:
        backend = AttentionBackend(name)
    except ValueError:
        raise ValueError(
            f"unknown attention backend {name!r} (choose from {[b.value for b in AttentionBackend]})"
        ) from None
    if backend == AttentionBackend.TRITON:
        if not _triton.AVAILABLE:
            raise ValueError(
                "attention backend 'triton' needs the triton package, which is not installed "
                "(pip install mmpipe[triton], Linux only); use 'torch' instead"
            )
    if backend == AttentionBackend.XFORMERS and importlib.util.find_spec("xformers") is None:
        raise ValueError(
            "attention backend 'xformers' needs the xformers package, which is not installed "
            "(pip install mmpipe[xformers]); use 'torch' or 'triton' instead"
        )
    return _BACKENDS[backend]


def masked_attention_with_lse(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias_B11T: torch.Tensor, *, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out, lse)`` of one block with an additive key mask, explicit softmax (for short blocks:
    the padded text keys of a joint text-video attention)."""
    return math_forward(q, k, v, False, scale, bias_B11T)


def masked_attention_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    bias_B11T: torch.Tensor,
    *,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The backward of :func:`masked_attention_with_lse` given the (merged) ``out`` and ``lse``."""
    return math_backward(dout, q, k, v, out, lse, False, scale, bias_B11T)


def _has_fused_kernel(impl: AttentionImpl, q: torch.Tensor) -> bool:
    """ATen's CUDA flash kernel takes fp16 / bf16 only (its CPU one any float dtype)."""
    return not (impl.name == AttentionBackend.TORCH and q.is_cuda and q.dtype not in (torch.float16, torch.bfloat16))


def attention_with_lse(
    impl: AttentionImpl, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out_BHSD, lse_BHS)`` of one block, no autograd (ring attention's building block)."""
    if not _has_fused_kernel(impl, q):
        # Never a silent fallback to the O(S^2)-memory math backend at long sequence lengths.
        raise ValueError(
            f"attention backend 'torch' on CUDA needs float16 or bfloat16 inputs for ring attention, got {q.dtype} "
            "(use bf16, or backend 'math' for small fp32 checks)"
        )
    if impl.forward is None:
        raise ValueError(
            f"attention backend {impl.name.value!r} cannot return the log-sum-exp that ring attention merges "
            f"partial results with; use {AttentionBackend.TORCH.value!r} or {AttentionBackend.MATH.value!r}"
        )
    return impl.forward(q, k, v, causal, scale)


def attention_backward(
    impl: AttentionImpl,
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    *,
    causal: bool,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq, dk, dv)`` of one block given the (possibly merged) ``out`` and ``lse``."""
    assert impl.backward is not None, "attention_with_lse refuses backends without an LSE"
    return impl.backward(dout, q, k, v, out, lse, causal, scale)


class _Attention(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, impl: AttentionImpl, causal: bool, scale: float
    ) -> torch.Tensor:  # type: ignore[override]
        out, lse = attention_with_lse(impl, q, k, v, causal=causal, scale=scale)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.impl, ctx.causal, ctx.scale = impl, causal, scale
        return out

    @staticmethod
    def backward(ctx: Any, dout: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = attention_backward(ctx.impl, dout, q, k, v, out, lse, causal=ctx.causal, scale=ctx.scale)
        return dq, dk, dv, None, None, None


def local_attention(
    q_BHSD: torch.Tensor,
    k_BHTD: torch.Tensor,
    v_BHTD: torch.Tensor,
    *,
    causal: bool = False,
    scale: float | None = None,
    impl: AttentionImpl | None = None,
) -> torch.Tensor:
    """Unsplit attention on this rank's tensors, differentiable, through ``impl`` (default ``torch``)."""
    impl = impl or select_backend(device=q_BHSD.device)
    scale = 1.0 / math.sqrt(q_BHSD.shape[-1]) if scale is None else scale
    if q_BHSD.shape[2] == 0 or k_BHTD.shape[2] == 0:  # the fused CPU kernel crashes on empty sequences
        return q_BHSD.new_zeros((*q_BHSD.shape[:3], v_BHTD.shape[-1])) + 0 * (
            q_BHSD.sum() + k_BHTD.sum() + v_BHTD.sum()
        )
    if impl.forward is None or not _has_fused_kernel(impl, q_BHSD):  # PyTorch's own dispatch (fp32 on CUDA)
        return F.scaled_dot_product_attention(q_BHSD, k_BHTD, v_BHTD, is_causal=causal, scale=scale)
    return _Attention.apply(q_BHSD, k_BHTD, v_BHTD, impl, causal, scale)
