"""FlashAttention forward and backward in Triton that return (and take) the log-sum-exp, as ``torch.library`` ops.

- ``mmpipe::flash_attn_fwd(q, k, v, causal, scale) -> (out, lse)``: online softmax over key blocks.
- ``mmpipe::flash_attn_bwd(dout, q, k, v, out, lse, causal, scale) -> (dq, dk, dv)``: FlashAttention-2's
  backward with an *external* ``out`` and ``lse`` (ring attention passes the merged ones, which makes it
  the gradient of the global softmax restricted to this key block): a preprocess ``delta = rowsum(dout *
  out)``, one kernel per key block for ``dk, dv`` (looping over query blocks) and one per query block for
  ``dq`` (looping over key blocks), so no atomics.
- :func:`flash_attention`: the differentiable forward (``register_autograd``), torch.compile-able.
- :func:`attention_reference` and :func:`attention_reference_backward`: the same in plain PyTorch.

Semantics (those of ``mmpipe.parallel.attention`` and ATen's flash kernels): layout ``BHSD`` for queries,
``BHTD`` for keys and values (``T`` may differ from ``S``); causal masking is top-left aligned (query
``i`` sees keys ``j <= i``) even when ``S != T``; the LSE is the natural-log logsumexp of the scaled
scores, float32 (float64 for float64 inputs); a query that sees no key gets a zero output, an LSE of
``-inf`` and zero gradients. Accumulation is float32 for float16 / bfloat16 / float32 inputs and
float64 for float64 inputs; float32 matmuls are IEEE (no TF32).

Head dims: powers of two from 16 to 128. Without CUDA the kernels run in Triton's interpreter
(:mod:`mmpipe.kernels._triton`), for tests on tiny shapes.

Legend: B batch, H heads, S query length, T key length, D head dim.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from mmpipe.kernels._triton import AVAILABLE, INTERPRETED, can_run

if AVAILABLE:
    import triton
    import triton.language as tl

__all__ = [
    "attention_reference",
    "attention_reference_backward",
    "flash_attention",
    "flash_attn_bwd",
    "flash_attn_fwd",
]

_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """The accumulation (and LSE) dtype of inputs of ``dtype``."""
    return torch.float64 if dtype == torch.float64 else torch.float32


# ---------------------------------------------------------------------------------------------------------------
# Reference (plain PyTorch)
# ---------------------------------------------------------------------------------------------------------------


def attention_reference(
    q_BHSD: torch.Tensor, k_BHTD: torch.Tensor, v_BHTD: torch.Tensor, causal: bool, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out_BHSD, lse_BHS)`` by explicit softmax in the accumulation dtype (output in the input dtype)."""
    from mmpipe.parallel.attention import _math_forward

    acc = _acc_dtype(q_BHSD.dtype)
    out_BHSD, lse_BHS = _math_forward(q_BHSD.to(acc), k_BHTD.to(acc), v_BHTD.to(acc), causal, scale)
    return out_BHSD.to(q_BHSD.dtype), lse_BHS


def attention_reference_backward(
    dout_BHSD: torch.Tensor,
    q_BHSD: torch.Tensor,
    k_BHTD: torch.Tensor,
    v_BHTD: torch.Tensor,
    out_BHSD: torch.Tensor,
    lse_BHS: torch.Tensor,
    causal: bool,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq, dk, dv)`` given an external ``out`` and ``lse``; rows with an LSE of ``-inf`` get no gradient."""
    from mmpipe.parallel.attention import _math_backward

    acc = _acc_dtype(q_BHSD.dtype)
    # exp(s - lse) with lse = -inf is inf (or NaN for a masked s); +inf makes it exp(-inf) = 0 instead.
    lse_BHS = torch.where(torch.isneginf(lse_BHS), float("inf"), lse_BHS.to(acc))
    dq, dk, dv = _math_backward(
        dout_BHSD.to(acc),
        q_BHSD.to(acc),
        k_BHTD.to(acc),
        v_BHTD.to(acc),
        out_BHSD.to(acc),
        lse_BHS,
        causal,
        scale,
    )
    return dq.to(q_BHSD.dtype), dk.to(k_BHTD.dtype), dv.to(v_BHTD.dtype)


# ---------------------------------------------------------------------------------------------------------------
# Triton kernels
# ---------------------------------------------------------------------------------------------------------------

if AVAILABLE:

    @triton.jit
    def _dot(a, b, ACC: tl.constexpr, UPCAST: tl.constexpr, PREC: tl.constexpr):
        """``a @ b`` accumulated in ``ACC``; ``PREC`` is ``"ieee"`` for float32 / float64 operands (no TF32).
        ``UPCAST`` multiplies in ``ACC``: the interpreter of Triton 3.9 multiplies the raw bits of
        bfloat16 operands (it stores them as uint16)."""
        if UPCAST:
            a = a.to(ACC)
            b = b.to(ACC)
        return tl.dot(a, b, input_precision=PREC, out_dtype=ACC)

    @triton.jit
    def _fwd_kernel(
        Q,
        K,
        V,
        Out,
        Lse,
        sqb,
        sqh,
        sqs,
        sqd,
        skb,
        skh,
        skt,
        skd,
        svb,
        svh,
        svt,
        svd,
        sob,
        soh,
        sos,
        sod,
        slb,
        slh,
        sls,
        H,
        S,
        T,
        scale_hi,
        scale_lo,
        CAUSAL: tl.constexpr,
        HEAD_D: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        ACC: tl.constexpr,
        UPCAST: tl.constexpr,
        PREC: tl.constexpr,
    ):
        """One program: BLOCK_M queries of one (batch, head) against all (visible) keys, online softmax."""
        pid_m = tl.program_id(0)
        bh = tl.program_id(1)
        b = (bh // H).to(tl.int64)
        h = (bh % H).to(tl.int64)
        start_m = pid_m * BLOCK_M
        offs_m = tl.arange(0, BLOCK_M)
        offs_n = tl.arange(0, BLOCK_N)
        offs_d = tl.arange(0, HEAD_D)
        rows_M = start_m + offs_m
        row_ok_M = rows_M < S

        # 64-bit base offsets (batch, head, block start); tile offsets stay small.
        m64 = start_m.to(tl.int64)
        q_ptrs = Q + b * sqb + h * sqh + m64 * sqs + offs_m[:, None] * sqs + offs_d[None, :] * sqd
        q_MD = tl.load(q_ptrs, mask=row_ok_M[:, None], other=0.0)
        kt_ptrs = K + b * skb + h * skh + offs_n[None, :] * skt + offs_d[:, None] * skd  # [D, N]
        v_ptrs = V + b * svb + h * svh + offs_n[:, None] * svt + offs_d[None, :] * svd  # [N, D]

        m_M = tl.full([BLOCK_M], float("-inf"), ACC)
        l_M = tl.zeros([BLOCK_M], ACC)
        acc_MD = tl.zeros([BLOCK_M, HEAD_D], ACC)
        if CAUSAL:  # top-left aligned: the last query of the block sees keys < start_m + BLOCK_M
            hi = tl.minimum(T, start_m + BLOCK_M)
        else:
            hi = T
        for start_n in range(0, hi, BLOCK_N):
            cols_N = start_n + offs_n
            col_ok_N = cols_N < T
            kt_DN = tl.load(kt_ptrs, mask=col_ok_N[None, :], other=0.0)
            qk_MN = _dot(q_MD, kt_DN, ACC, UPCAST, PREC)
            s_MN = qk_MN * scale_hi + qk_MN * scale_lo
            keep_MN = col_ok_N[None, :]
            if CAUSAL:
                keep_MN = keep_MN & (cols_N[None, :] <= rows_M[:, None])
            s_MN = tl.where(keep_MN, s_MN, float("-inf"))
            m_new_M = tl.maximum(m_M, tl.max(s_MN, 1))
            # A row that has seen no key yet keeps m = -inf; 0 stands in so that no inf - inf is formed.
            m_ref_M = tl.where(m_new_M == float("-inf"), 0.0, m_new_M)
            p_MN = tl.exp(s_MN - m_ref_M[:, None])
            alpha_M = tl.exp(m_M - m_ref_M)
            l_M = l_M * alpha_M + tl.sum(p_MN, 1)
            v_ND = tl.load(v_ptrs, mask=col_ok_N[:, None], other=0.0)
            acc_MD = acc_MD * alpha_M[:, None] + _dot(p_MN.to(v_ND.dtype), v_ND, ACC, UPCAST, PREC)
            m_M = m_new_M
            kt_ptrs += BLOCK_N * skt
            v_ptrs += BLOCK_N * svt

        seen_M = l_M > 0.0
        out_MD = acc_MD / tl.where(seen_M, l_M, 1.0)[:, None]
        lse_M = tl.where(seen_M, m_M + tl.log(tl.where(seen_M, l_M, 1.0)), float("-inf"))
        o_ptrs = Out + b * sob + h * soh + m64 * sos + offs_m[:, None] * sos + offs_d[None, :] * sod
        tl.store(o_ptrs, out_MD.to(Out.dtype.element_ty), mask=row_ok_M[:, None])
        tl.store(Lse + b * slb + h * slh + m64 * sls + offs_m * sls, lse_M.to(Lse.dtype.element_ty), mask=row_ok_M)

    @triton.jit
    def _bwd_preprocess_kernel(
        Out,
        DOut,
        Delta,
        sob,
        soh,
        sos,
        sod,
        sdb,
        sdh,
        sds,
        sdd,
        H,
        S,
        HEAD_D: tl.constexpr,
        BLOCK_M: tl.constexpr,
        ACC: tl.constexpr,
    ):
        """``delta = rowsum(dout * out)`` into a contiguous ``Delta_BHS`` of the accumulation dtype."""
        pid_m = tl.program_id(0)
        bh = tl.program_id(1)
        b = (bh // H).to(tl.int64)
        h = (bh % H).to(tl.int64)
        start_m = pid_m * BLOCK_M
        m64 = start_m.to(tl.int64)
        offs_m = tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, HEAD_D)
        row_ok_M = start_m + offs_m < S
        o_MD = tl.load(
            Out + b * sob + h * soh + m64 * sos + offs_m[:, None] * sos + offs_d[None, :] * sod,
            mask=row_ok_M[:, None],
            other=0.0,
        ).to(ACC)
        do_MD = tl.load(
            DOut + b * sdb + h * sdh + m64 * sds + offs_m[:, None] * sds + offs_d[None, :] * sdd,
            mask=row_ok_M[:, None],
            other=0.0,
        ).to(ACC)
        delta_M = tl.sum(o_MD * do_MD, 1)
        tl.store(Delta + bh.to(tl.int64) * S + m64 + offs_m, delta_M, mask=row_ok_M)

    @triton.jit
    def _bwd_dkdv_kernel(
        Q,
        K,
        V,
        DOut,
        Lse,
        Delta,
        DK,
        DV,
        sqb,
        sqh,
        sqs,
        sqd,
        skb,
        skh,
        skt,
        skd,
        svb,
        svh,
        svt,
        svd,
        sdb,
        sdh,
        sds,
        sdd,
        slb,
        slh,
        sls,
        sdkb,
        sdkh,
        sdkt,
        sdkd,
        sdvb,
        sdvh,
        sdvt,
        sdvd,
        H,
        S,
        T,
        scale_hi,
        scale_lo,
        CAUSAL: tl.constexpr,
        HEAD_D: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        ACC: tl.constexpr,
        UPCAST: tl.constexpr,
        PREC: tl.constexpr,
    ):
        """One program: ``dk, dv`` of BLOCK_N keys, looping over the query blocks that see them.

        Works on transposed scores (keys x queries) so that no probability tile needs a transpose."""
        pid_n = tl.program_id(0)
        bh = tl.program_id(1)
        b = (bh // H).to(tl.int64)
        h = (bh % H).to(tl.int64)
        start_n = pid_n * BLOCK_N
        n64 = start_n.to(tl.int64)
        offs_m = tl.arange(0, BLOCK_M)
        offs_n = tl.arange(0, BLOCK_N)
        offs_d = tl.arange(0, HEAD_D)
        cols_N = start_n + offs_n
        col_ok_N = cols_N < T

        k_ND = tl.load(
            K + b * skb + h * skh + n64 * skt + offs_n[:, None] * skt + offs_d[None, :] * skd,
            mask=col_ok_N[:, None],
            other=0.0,
        )
        v_ND = tl.load(
            V + b * svb + h * svh + n64 * svt + offs_n[:, None] * svt + offs_d[None, :] * svd,
            mask=col_ok_N[:, None],
            other=0.0,
        )
        dk_ND = tl.zeros([BLOCK_N, HEAD_D], ACC)
        dv_ND = tl.zeros([BLOCK_N, HEAD_D], ACC)

        if CAUSAL:  # queries before start_n see none of these keys
            lo = (start_n // BLOCK_M) * BLOCK_M
        else:
            lo = start_n * 0
        lo64 = lo.to(tl.int64)
        qt_ptrs = Q + b * sqb + h * sqh + lo64 * sqs + offs_m[None, :] * sqs + offs_d[:, None] * sqd  # [D, M]
        do_ptrs = DOut + b * sdb + h * sdh + lo64 * sds + offs_m[:, None] * sds + offs_d[None, :] * sdd  # [M, D]
        lse_ptrs = Lse + b * slb + h * slh + lo64 * sls + offs_m * sls
        delta_ptrs = Delta + bh.to(tl.int64) * S + lo64 + offs_m
        for start_m in range(lo, S, BLOCK_M):
            rows_M = start_m + offs_m
            row_ok_M = rows_M < S
            qt_DM = tl.load(qt_ptrs, mask=row_ok_M[None, :], other=0.0)
            do_MD = tl.load(do_ptrs, mask=row_ok_M[:, None], other=0.0)
            lse_M = tl.load(lse_ptrs, mask=row_ok_M, other=0.0).to(ACC)
            delta_M = tl.load(delta_ptrs, mask=row_ok_M, other=0.0)
            qk_NM = _dot(k_ND, qt_DM, ACC, UPCAST, PREC)
            s_NM = qk_NM * scale_hi + qk_NM * scale_lo
            # A row with LSE -inf (no visible key in the merged softmax) has p = 0.
            keep_NM = col_ok_N[:, None] & (row_ok_M & (lse_M != float("-inf")))[None, :]
            if CAUSAL:
                keep_NM = keep_NM & (cols_N[:, None] <= rows_M[None, :])
            p_NM = tl.where(keep_NM, tl.exp(tl.where(keep_NM, s_NM - lse_M[None, :], 0.0)), 0.0)
            dv_ND += _dot(p_NM.to(do_MD.dtype), do_MD, ACC, UPCAST, PREC)
            dp_NM = _dot(v_ND, tl.trans(do_MD), ACC, UPCAST, PREC)
            ds_NM = p_NM * (dp_NM - delta_M[None, :])
            dk_ND += _dot(ds_NM.to(qt_DM.dtype), tl.trans(qt_DM), ACC, UPCAST, PREC)
            qt_ptrs += BLOCK_M * sqs
            do_ptrs += BLOCK_M * sds
            lse_ptrs += BLOCK_M * sls
            delta_ptrs += BLOCK_M

        dk_ND = dk_ND * scale_hi + dk_ND * scale_lo
        tl.store(
            DK + b * sdkb + h * sdkh + n64 * sdkt + offs_n[:, None] * sdkt + offs_d[None, :] * sdkd,
            dk_ND.to(DK.dtype.element_ty),
            mask=col_ok_N[:, None],
        )
        tl.store(
            DV + b * sdvb + h * sdvh + n64 * sdvt + offs_n[:, None] * sdvt + offs_d[None, :] * sdvd,
            dv_ND.to(DV.dtype.element_ty),
            mask=col_ok_N[:, None],
        )

    @triton.jit
    def _bwd_dq_kernel(
        Q,
        K,
        V,
        DOut,
        Lse,
        Delta,
        DQ,
        sqb,
        sqh,
        sqs,
        sqd,
        skb,
        skh,
        skt,
        skd,
        svb,
        svh,
        svt,
        svd,
        sdb,
        sdh,
        sds,
        sdd,
        slb,
        slh,
        sls,
        sdqb,
        sdqh,
        sdqs,
        sdqd,
        H,
        S,
        T,
        scale_hi,
        scale_lo,
        CAUSAL: tl.constexpr,
        HEAD_D: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        ACC: tl.constexpr,
        UPCAST: tl.constexpr,
        PREC: tl.constexpr,
    ):
        """One program: ``dq`` of BLOCK_M queries, looping over the key blocks they see."""
        pid_m = tl.program_id(0)
        bh = tl.program_id(1)
        b = (bh // H).to(tl.int64)
        h = (bh % H).to(tl.int64)
        start_m = pid_m * BLOCK_M
        m64 = start_m.to(tl.int64)
        offs_m = tl.arange(0, BLOCK_M)
        offs_n = tl.arange(0, BLOCK_N)
        offs_d = tl.arange(0, HEAD_D)
        rows_M = start_m + offs_m
        row_ok_M = rows_M < S

        q_MD = tl.load(
            Q + b * sqb + h * sqh + m64 * sqs + offs_m[:, None] * sqs + offs_d[None, :] * sqd,
            mask=row_ok_M[:, None],
            other=0.0,
        )
        do_MD = tl.load(
            DOut + b * sdb + h * sdh + m64 * sds + offs_m[:, None] * sds + offs_d[None, :] * sdd,
            mask=row_ok_M[:, None],
            other=0.0,
        )
        lse_M = tl.load(Lse + b * slb + h * slh + m64 * sls + offs_m * sls, mask=row_ok_M, other=0.0).to(ACC)
        delta_M = tl.load(Delta + bh.to(tl.int64) * S + m64 + offs_m, mask=row_ok_M, other=0.0)
        row_live_M = row_ok_M & (lse_M != float("-inf"))
        k_ptrs = K + b * skb + h * skh + offs_n[:, None] * skt + offs_d[None, :] * skd  # [N, D]
        vt_ptrs = V + b * svb + h * svh + offs_n[None, :] * svt + offs_d[:, None] * svd  # [D, N]
        dq_MD = tl.zeros([BLOCK_M, HEAD_D], ACC)

        if CAUSAL:
            hi = tl.minimum(T, start_m + BLOCK_M)
        else:
            hi = T
        for start_n in range(0, hi, BLOCK_N):
            cols_N = start_n + offs_n
            col_ok_N = cols_N < T
            k_ND = tl.load(k_ptrs, mask=col_ok_N[:, None], other=0.0)
            vt_DN = tl.load(vt_ptrs, mask=col_ok_N[None, :], other=0.0)
            qk_MN = _dot(q_MD, tl.trans(k_ND), ACC, UPCAST, PREC)
            s_MN = qk_MN * scale_hi + qk_MN * scale_lo
            keep_MN = row_live_M[:, None] & col_ok_N[None, :]
            if CAUSAL:
                keep_MN = keep_MN & (cols_N[None, :] <= rows_M[:, None])
            p_MN = tl.where(keep_MN, tl.exp(tl.where(keep_MN, s_MN - lse_M[:, None], 0.0)), 0.0)
            dp_MN = _dot(do_MD, vt_DN, ACC, UPCAST, PREC)
            ds_MN = p_MN * (dp_MN - delta_M[:, None])
            dq_MD += _dot(ds_MN.to(k_ND.dtype), k_ND, ACC, UPCAST, PREC)
            k_ptrs += BLOCK_N * skt
            vt_ptrs += BLOCK_N * svt

        dq_MD = dq_MD * scale_hi + dq_MD * scale_lo
        tl.store(
            DQ + b * sdqb + h * sdqh + m64 * sdqs + offs_m[:, None] * sdqs + offs_d[None, :] * sdqd,
            dq_MD.to(DQ.dtype.element_ty),
            mask=row_ok_M[:, None],
        )


# ---------------------------------------------------------------------------------------------------------------
# Launchers
# ---------------------------------------------------------------------------------------------------------------


def _check_inputs(q_BHSD: torch.Tensor, k_BHTD: torch.Tensor, v_BHTD: torch.Tensor) -> None:
    """Shapes, dtypes and head dim the kernels take (shared by the real and the fake implementations)."""
    if q_BHSD.dim() != 4 or k_BHTD.dim() != 4 or v_BHTD.dim() != 4:
        raise ValueError(
            f"flash attention takes BHSD tensors, got q {tuple(q_BHSD.shape)}, k {tuple(k_BHTD.shape)}, "
            f"v {tuple(v_BHTD.shape)}"
        )
    B, H, _, D = q_BHSD.shape
    if k_BHTD.shape != v_BHTD.shape or k_BHTD.shape[:2] != (B, H) or k_BHTD.shape[3] != D:
        raise ValueError(
            f"flash attention needs k and v of shape (B, H, T, D) matching q {tuple(q_BHSD.shape)}, got "
            f"k {tuple(k_BHTD.shape)}, v {tuple(v_BHTD.shape)}"
        )
    if D < 16 or D > 128 or D & (D - 1):
        raise ValueError(f"flash attention supports head dims 16, 32, 64 and 128 (a power of two <= 128), got {D}")
    if q_BHSD.dtype not in _DTYPES or k_BHTD.dtype != q_BHSD.dtype or v_BHTD.dtype != q_BHSD.dtype:
        raise ValueError(
            f"flash attention needs q, k, v of one dtype among {[str(d) for d in _DTYPES]}, got "
            f"{q_BHSD.dtype}, {k_BHTD.dtype}, {v_BHTD.dtype}"
        )


def _check_runnable(*tensors: torch.Tensor) -> None:
    if can_run(*tensors):
        return
    if not AVAILABLE:
        why = "Triton is not installed (pip install mmpipe[triton])"
    elif len({t.device for t in tensors}) > 1:
        why = f"the tensors are on different devices {sorted({str(t.device) for t in tensors})}"
    elif INTERPRETED:
        why = f"the interpreter (TRITON_INTERPRET=1) takes CPU tensors only, got {tensors[0].device}"
    else:
        why = (
            f"Triton compiles for CUDA tensors, got {tensors[0].device} (CPU tensors run only in the interpreter: "
            "TRITON_INTERPRET=1, set before triton is imported)"
        )
    raise RuntimeError(f"the Triton flash attention kernels cannot run here: {why}")


def _blocks(D: int, dtype: torch.dtype) -> tuple[int, int, int, int]:
    """``(BLOCK_M, BLOCK_N, num_warps, num_stages)``: M query rows, N key rows per tile.

    The interpreter gets small, unequal blocks (several blocks and boundary tiles on test shapes, both
    causal loop bounds exercised). GPU sizes are conservative for shared memory at D = 128."""
    if INTERPRETED:
        return 32, 16, 1, 1
    if dtype == torch.float64:
        return 32, 32, 4, 1
    if dtype == torch.float32:
        return (64, 32, 4, 2) if D > 64 else (64, 64, 4, 2)
    return 64, 64, 4, 2


def _split_scale(scale: float) -> tuple[float, float]:
    """``scale`` as a float32 head plus a float32 tail: Triton passes Python floats as float32, which
    would cost a float64 kernel ~1e-8 relative accuracy; ``s * hi + s * lo`` keeps ~1e-14."""
    hi = float(torch.tensor(scale, dtype=torch.float32))
    return hi, scale - hi


def _tl_acc(dtype: torch.dtype) -> Any:
    return tl.float64 if dtype == torch.float64 else tl.float32


def _upcast(dtype: torch.dtype) -> bool:
    """Whether the kernels' matmuls take their operands in the accumulation dtype (see ``_dot``)."""
    return INTERPRETED and dtype == torch.bfloat16


def _precision(dtype: torch.dtype) -> str:
    """``tl.dot``'s input precision: IEEE for float32 (Triton's default would be TF32) and float64; the
    default for 16-bit operands, which it does not affect."""
    return "ieee" if dtype in (torch.float32, torch.float64) or _upcast(dtype) else "tf32"


def _strides(t: torch.Tensor) -> tuple[int, ...]:
    return tuple(t.stride())


def _forward(
    q_BHSD: torch.Tensor,
    k_BHTD: torch.Tensor,
    v_BHTD: torch.Tensor,
    causal: bool,
    scale: float,
    blocks: tuple[int, int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch the forward kernel; ``blocks`` (``BLOCK_M``, ``BLOCK_N``) overrides the tile sizes (tests)."""
    _check_inputs(q_BHSD, k_BHTD, v_BHTD)
    _check_runnable(q_BHSD, k_BHTD, v_BHTD)
    B, H, S, D = q_BHSD.shape
    T = k_BHTD.shape[2]
    acc = _acc_dtype(q_BHSD.dtype)
    # NaN-poisoned: an element the kernel fails to write shows up.
    out_BHSD = torch.full((B, H, S, D), float("nan"), dtype=q_BHSD.dtype, device=q_BHSD.device)
    lse_BHS = torch.full((B, H, S), float("nan"), dtype=acc, device=q_BHSD.device)
    if B * H * S == 0:
        return out_BHSD, lse_BHS
    block_m, block_n, warps, stages = _blocks(D, q_BHSD.dtype)
    if blocks is not None:
        block_m, block_n = blocks
    hi, lo = _split_scale(scale)
    grid = (triton.cdiv(S, block_m), B * H)
    _fwd_kernel[grid](
        q_BHSD,
        k_BHTD,
        v_BHTD,
        out_BHSD,
        lse_BHS,
        *_strides(q_BHSD),
        *_strides(k_BHTD),
        *_strides(v_BHTD),
        *_strides(out_BHSD),
        *_strides(lse_BHS),
        H,
        S,
        T,
        hi,
        lo,
        CAUSAL=causal,
        HEAD_D=D,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        ACC=_tl_acc(q_BHSD.dtype),
        UPCAST=_upcast(q_BHSD.dtype),
        PREC=_precision(q_BHSD.dtype),
        num_warps=warps,
        num_stages=stages,
    )
    return out_BHSD, lse_BHS


def _backward(
    dout_BHSD: torch.Tensor,
    q_BHSD: torch.Tensor,
    k_BHTD: torch.Tensor,
    v_BHTD: torch.Tensor,
    out_BHSD: torch.Tensor,
    lse_BHS: torch.Tensor,
    causal: bool,
    scale: float,
    blocks: tuple[int, int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Launch the three backward kernels; ``blocks`` (``BLOCK_M``, ``BLOCK_N``) overrides the tile sizes."""
    _check_inputs(q_BHSD, k_BHTD, v_BHTD)
    if dout_BHSD.shape != q_BHSD.shape or out_BHSD.shape != q_BHSD.shape or lse_BHS.shape != q_BHSD.shape[:3]:
        raise ValueError(
            f"flash attention backward needs dout and out shaped like q {tuple(q_BHSD.shape)} and lse like "
            f"{tuple(q_BHSD.shape[:3])}, got dout {tuple(dout_BHSD.shape)}, out {tuple(out_BHSD.shape)}, "
            f"lse {tuple(lse_BHS.shape)}"
        )
    _check_runnable(dout_BHSD, q_BHSD, k_BHTD, v_BHTD, out_BHSD, lse_BHS)
    dout_BHSD = dout_BHSD.to(q_BHSD.dtype)  # the matmul operands share one dtype
    B, H, S, D = q_BHSD.shape
    T = k_BHTD.shape[2]
    acc = _acc_dtype(q_BHSD.dtype)
    dev = q_BHSD.device
    dq_BHSD = torch.full(q_BHSD.shape, float("nan"), dtype=q_BHSD.dtype, device=dev)
    dk_BHTD = torch.full(k_BHTD.shape, float("nan"), dtype=k_BHTD.dtype, device=dev)
    dv_BHTD = torch.full(v_BHTD.shape, float("nan"), dtype=v_BHTD.dtype, device=dev)
    if B * H == 0:
        return dq_BHSD, dk_BHTD, dv_BHTD
    if S == 0:  # no query: no gradient reaches the keys
        return dq_BHSD, dk_BHTD.zero_(), dv_BHTD.zero_()
    block_m, block_n, warps, stages = _blocks(D, q_BHSD.dtype)
    if blocks is not None:
        block_m, block_n = blocks
    hi, lo = _split_scale(scale)
    acc_tl = _tl_acc(q_BHSD.dtype)

    delta_BHS = torch.full((B, H, S), float("nan"), dtype=acc, device=dev)
    _bwd_preprocess_kernel[(triton.cdiv(S, block_m), B * H)](
        out_BHSD,
        dout_BHSD,
        delta_BHS,
        *_strides(out_BHSD),
        *_strides(dout_BHSD),
        H,
        S,
        HEAD_D=D,
        BLOCK_M=block_m,
        ACC=acc_tl,
        num_warps=warps,
    )
    common = (
        *_strides(q_BHSD),
        *_strides(k_BHTD),
        *_strides(v_BHTD),
        *_strides(dout_BHSD),
        *_strides(lse_BHS),
    )
    meta: dict[str, Any] = dict(
        CAUSAL=causal,
        HEAD_D=D,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        ACC=acc_tl,
        UPCAST=_upcast(q_BHSD.dtype),
        PREC=_precision(q_BHSD.dtype),
        num_warps=warps,
        num_stages=stages,
    )
    if T > 0:
        _bwd_dkdv_kernel[(triton.cdiv(T, block_n), B * H)](
            q_BHSD,
            k_BHTD,
            v_BHTD,
            dout_BHSD,
            lse_BHS,
            delta_BHS,
            dk_BHTD,
            dv_BHTD,
            *common,
            *_strides(dk_BHTD),
            *_strides(dv_BHTD),
            H,
            S,
            T,
            hi,
            lo,
            **meta,
        )
    _bwd_dq_kernel[(triton.cdiv(S, block_m), B * H)](
        q_BHSD,
        k_BHTD,
        v_BHTD,
        dout_BHSD,
        lse_BHS,
        delta_BHS,
        dq_BHSD,
        *common,
        *_strides(dq_BHSD),
        H,
        S,
        T,
        hi,
        lo,
        **meta,
    )
    return dq_BHSD, dk_BHTD, dv_BHTD


# ---------------------------------------------------------------------------------------------------------------
# Custom ops
# ---------------------------------------------------------------------------------------------------------------


@torch.library.custom_op("mmpipe::flash_attn_fwd", mutates_args=())
def flash_attn_fwd(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out_BHSD, lse_BHS)`` of attention of ``q_BHSD`` over ``k_BHTD, v_BHTD`` (see the module docstring)."""
    return _forward(q, k, v, causal, scale)


@flash_attn_fwd.register_fake
def _flash_attn_fwd_fake(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    _check_inputs(q, k, v)
    return q.new_empty(q.shape), q.new_empty(q.shape[:3], dtype=_acc_dtype(q.dtype))


@torch.library.custom_op("mmpipe::flash_attn_bwd", mutates_args=())
def flash_attn_bwd(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    causal: bool,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq, dk, dv)`` given the (possibly merged, external) ``out_BHSD`` and ``lse_BHS``."""
    return _backward(dout, q, k, v, out, lse, causal, scale)


@flash_attn_bwd.register_fake
def _flash_attn_bwd_fake(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    causal: bool,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    _check_inputs(q, k, v)
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _setup_context(ctx: Any, inputs: tuple[Any, ...], output: tuple[torch.Tensor, torch.Tensor]) -> None:
    q, k, v, causal, scale = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse)
    ctx.causal, ctx.scale = causal, scale
    # The LSE is returned for merging partial results (ring attention has its own backward); no
    # gradient flows back through it.
    ctx.mark_non_differentiable(lse)


def _backward_autograd(ctx: Any, dout: torch.Tensor, dlse: torch.Tensor | None) -> tuple[Any, ...]:
    q, k, v, out, lse = ctx.saved_tensors
    dq, dk, dv = flash_attn_bwd(dout, q, k, v, out, lse, ctx.causal, ctx.scale)
    return dq, dk, dv, None, None


flash_attn_fwd.register_autograd(_backward_autograd, setup_context=_setup_context)


def flash_attention(
    q_BHSD: torch.Tensor,
    k_BHTD: torch.Tensor,
    v_BHTD: torch.Tensor,
    causal: bool = False,
    scale: float | None = None,
) -> torch.Tensor:
    """Differentiable attention output ``out_BHSD`` through the Triton kernels (``scale`` defaults to
    ``1 / sqrt(D)``)."""
    scale = 1.0 / math.sqrt(q_BHSD.shape[-1]) if scale is None else scale
    out_BHSD, _ = flash_attn_fwd(q_BHSD, k_BHTD, v_BHTD, causal, scale)
    return out_BHSD
