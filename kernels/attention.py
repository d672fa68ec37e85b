"""FlashAttention forward and backward in Triton that return (and take) the log-sum-exp, as ``torch.library`` ops.

- ``mmpipe::flash_attn_fwd(q, k, v, causal, scale) -> (out, lse)``: online softmax over key blocks.
- ``mmpipe::flash_attn_bwd(dout, q, k, v, out, lse, causal, scale) -> (dq, dk, dv)``: FlashAttention-2's
  backward with an *external* ``out`` and ``lse`` (ring attention passes the merged ones, which makes it
  the gradient of the global softmax restricted to this key block): a preprocess ``delta = rowsum(dout *
  out)``, one kernel per key block for ``dk, dv`` (looping over query blocks) and one per query block for
  ``dq`` (looping over key blocks), so no atomics.
- :func:`flash_attention`: the differentiable forward (``register_autograd``), torch.compile-able.
- :func:`attention_reference` and :func:`attention_reference_backward`: the same in plain PyTorch.
- Variable sequence lengths (``flash_attn_varlen_func``'s packed layout): ``mmpipe::flash_attn_varlen_fwd(q,
  k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, scale) -> (out, lse)`` and
  ``mmpipe::flash_attn_varlen_bwd(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
  max_seqlen_k, causal, scale) -> (dq, dk, dv)``, :func:`flash_attn_varlen` (differentiable) and
  :func:`attention_varlen_reference` / :func:`attention_varlen_reference_backward` (a loop over sequences).
  The same kernels run both layouts (a ``VARLEN`` compile-time switch: each program reads its sequence's
  rows from the cumulative lengths instead of a batch stride).

Semantics (those of ``mmpipe.parallel.attention`` and ATen's flash kernels): layout ``BHSD`` for queries,
``BHTD`` for keys and values (``T`` may differ from ``S``); causal masking is top-left aligned (query
``i`` sees keys ``j <= i``) even when ``S != T``; the LSE is the natural-log logsumexp of the scaled
scores, float32 (float64 for float64 inputs); a query that sees no key gets a zero output, an LSE of
``-inf`` and zero gradients. Accumulation is float32 for float16 / bfloat16 / float32 inputs and
float64 for float64 inputs; float32 matmuls are IEEE (no TF32).

Head dims: powers of two from 16 to 128. Without CUDA the kernels run in Triton's interpreter
(:mod:`mmpipe.kernels._triton`), for tests on tiny shapes.

Packed layout: queries ``(total_q, H, D)``, keys and values ``(total_k, H, D)``, sequence ``b`` at rows
``cu_seqlens[b]:cu_seqlens[b + 1]`` (int32, ``(batch + 1,)``); the LSE is ``(H, total_q)`` (the uniform
op's ``(B, H, S)`` with the batch folded into the sequence axis, as ``flash_attn_varlen_func`` returns it).
Masking and causal alignment (top-left) are per sequence, exactly as the uniform op on each sequence.

Legend: B batch, H heads, S query length, T key length, D head dim; packed: P total queries (``total_q``),
R total keys (``total_k``).
"""

from __future__ import annotations

import functools
import math
from typing import Any, Literal, NamedTuple, overload

import torch

from mmpipe.kernels._triton import AVAILABLE, INTERPRETED, can_run, output, output_like
from mmpipe.kernels.reference import math_backward, math_forward

if AVAILABLE:
    import triton
    import triton.language as tl
    import triton.testing

__all__ = [
    "attention_reference",
    "attention_reference_backward",
    "attention_varlen_reference",
    "attention_varlen_reference_backward",
    "flash_attention",
    "flash_attn_bwd",
    "flash_attn_fwd",
    "flash_attn_varlen",
    "flash_attn_varlen_bwd",
    "flash_attn_varlen_fwd",
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
    acc = _acc_dtype(q_BHSD.dtype)
    out_BHSD, lse_BHS = math_forward(q_BHSD.to(acc), k_BHTD.to(acc), v_BHTD.to(acc), causal, scale)
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
    acc = _acc_dtype(q_BHSD.dtype)
    # exp(s - lse) with lse = -inf is inf (or NaN for a masked s); +inf makes it exp(-inf) = 0 instead.
    lse_BHS = torch.where(torch.isneginf(lse_BHS), float("inf"), lse_BHS.to(acc))
    dq, dk, dv = math_backward(
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


def _spans(cu_seqlens: torch.Tensor) -> list[slice]:
    offsets = cu_seqlens.tolist()
    return [slice(a, b) for a, b in zip(offsets, offsets[1:], strict=False)]


def _as_1HSD(x_SHD: torch.Tensor) -> torch.Tensor:
    return x_SHD.transpose(0, 1).unsqueeze(0)


def attention_varlen_reference(
    q_PHD: torch.Tensor,
    k_RHD: torch.Tensor,
    v_RHD: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    causal: bool,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out_PHD, lse_HP)`` of packed sequences: :func:`attention_reference` on each sequence in turn."""
    outs, lses = [], []
    for rows_q, rows_k in zip(_spans(cu_seqlens_q), _spans(cu_seqlens_k), strict=True):
        out_1HSD, lse_1HS = attention_reference(
            _as_1HSD(q_PHD[rows_q]), _as_1HSD(k_RHD[rows_k]), _as_1HSD(v_RHD[rows_k]), causal, scale
        )
        outs.append(out_1HSD[0].transpose(0, 1))
        lses.append(lse_1HS[0])
    return torch.cat(outs, 0), torch.cat(lses, 1)


def attention_varlen_reference_backward(
    dout_PHD: torch.Tensor,
    q_PHD: torch.Tensor,
    k_RHD: torch.Tensor,
    v_RHD: torch.Tensor,
    out_PHD: torch.Tensor,
    lse_HP: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    causal: bool,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq_PHD, dk_RHD, dv_RHD)`` of packed sequences: :func:`attention_reference_backward` on each."""
    dqs, dks, dvs = [], [], []
    for rows_q, rows_k in zip(_spans(cu_seqlens_q), _spans(cu_seqlens_k), strict=True):
        dq, dk, dv = attention_reference_backward(
            _as_1HSD(dout_PHD[rows_q]),
            _as_1HSD(q_PHD[rows_q]),
            _as_1HSD(k_RHD[rows_k]),
            _as_1HSD(v_RHD[rows_k]),
            _as_1HSD(out_PHD[rows_q]),
            lse_HP[:, rows_q].unsqueeze(0),
            causal,
            scale,
        )
        dqs.append(dq[0].transpose(0, 1))
        dks.append(dk[0].transpose(0, 1))
        dvs.append(dv[0].transpose(0, 1))
    return torch.cat(dqs, 0), torch.cat(dks, 0), torch.cat(dvs, 0)


# ---------------------------------------------------------------------------------------------------------------
# Triton kernels
# ---------------------------------------------------------------------------------------------------------------

# Every kernel serves both layouts. Uniform (VARLEN false): program (block, b * H + h) works on batch entry b,
# found through the batch strides, whose sequences are S_max queries and T_max keys long. Packed (VARLEN): the
# batch strides are 0 and sequence b is rows CuQ[b]:CuQ[b + 1] (queries) and CuK[b]:CuK[b + 1] (keys) of the
# sequence axis; the grid covers the longest sequence (S_max, T_max) and blocks past a shorter one's end exit.
# Sequence-relative row / column indices are the same in both, so are the causal mask and the tiles.

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

    # Scores live in base 2 (FlashAttention-2's trick: ``exp2`` of ``qk * scale * log2(e)`` costs one
    # multiply per score, ``exp`` of a separately scaled score three) except for float64, which keeps
    # natural exponents and the scale's float32 tail (a float32 log2(e) would cost it 1e-8).

    @triton.jit
    def _scores(qk, scale_hi, scale_lo, ACC: tl.constexpr):
        """``qk * scale`` in the kernels' exponent base."""
        if ACC == tl.float64:
            return qk * scale_hi + qk * scale_lo
        else:
            return qk * (scale_hi * 1.4426950408889634)

    @triton.jit
    def _exp(x, ACC: tl.constexpr):
        """The exponential in the kernels' base."""
        if ACC == tl.float64:
            return tl.exp(x)
        else:
            return tl.exp2(x)

    @triton.jit
    def _natural_lse(m, total, ACC: tl.constexpr):
        """The natural-log logsumexp of a row from its running maximum ``m`` and sum ``total`` (base units)."""
        if ACC == tl.float64:
            return m + tl.log(total)
        else:
            return (m + tl.log2(total)) * 0.6931471805599453

    @triton.jit
    def _to_base(lse, ACC: tl.constexpr):
        """A natural-log LSE in the kernels' base (``-inf`` stays ``-inf``)."""
        if ACC == tl.float64:
            return lse
        else:
            return lse * 1.4426950408889634

    @triton.jit
    def _seq_span(Cu, b, n, VARLEN: tl.constexpr):
        """``(start, length)`` of sequence ``b`` on the sequence axis: rows ``Cu[b]:Cu[b + 1]`` of a packed
        batch (VARLEN), else rows ``0:n`` of batch entry ``b`` (which the batch stride places)."""
        if VARLEN:
            start = tl.load(Cu + b)
            length = tl.load(Cu + b + 1) - start
            start = start.to(tl.int64)
        else:
            start = b * 0
            length = n
        return start, length

    @triton.jit
    def _fwd_kernel(
        Q,
        K,
        V,
        Out,
        Lse,
        CuQ,
        CuK,
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
        S_max,
        T_max,
        scale_hi,
        scale_lo,
        CAUSAL: tl.constexpr,
        VARLEN: tl.constexpr,
        HEAD_D: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        ACC: tl.constexpr,
        UPCAST: tl.constexpr,
        PREC: tl.constexpr,
    ):
        """One program: BLOCK_M queries of one (sequence, head) against all (visible) keys, online softmax."""
        pid_m = tl.program_id(0)
        bh = tl.program_id(1)
        b = (bh // H).to(tl.int64)
        h = (bh % H).to(tl.int64)
        q0, S = _seq_span(CuQ, b, S_max, VARLEN)
        k0, T = _seq_span(CuK, b, T_max, VARLEN)
        start_m = pid_m * BLOCK_M
        if start_m >= S:
            return
        offs_m = tl.arange(0, BLOCK_M)
        offs_n = tl.arange(0, BLOCK_N)
        offs_d = tl.arange(0, HEAD_D)
        rows_M = start_m + offs_m
        row_ok_M = rows_M < S

        # 64-bit base offsets (batch, head, block start); tile offsets stay small.
        m64 = q0 + start_m
        q_ptrs = Q + b * sqb + h * sqh + m64 * sqs + offs_m[:, None] * sqs + offs_d[None, :] * sqd
        q_MD = tl.load(q_ptrs, mask=row_ok_M[:, None], other=0.0)
        kt_ptrs = K + b * skb + h * skh + k0 * skt + offs_n[None, :] * skt + offs_d[:, None] * skd  # [D, N]
        v_ptrs = V + b * svb + h * svh + k0 * svt + offs_n[:, None] * svt + offs_d[None, :] * svd  # [N, D]

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
            s_MN = _scores(qk_MN, scale_hi, scale_lo, ACC)
            keep_MN = col_ok_N[None, :]
            if CAUSAL:
                keep_MN = keep_MN & (cols_N[None, :] <= rows_M[:, None])
            s_MN = tl.where(keep_MN, s_MN, float("-inf"))
            m_new_M = tl.maximum(m_M, tl.max(s_MN, 1))
            # A row that has seen no key yet keeps m = -inf; 0 stands in so that no inf - inf is formed.
            m_ref_M = tl.where(m_new_M == float("-inf"), 0.0, m_new_M)
            p_MN = _exp(s_MN - m_ref_M[:, None], ACC)
            alpha_M = _exp(m_M - m_ref_M, ACC)
            l_M = l_M * alpha_M + tl.sum(p_MN, 1)
            v_ND = tl.load(v_ptrs, mask=col_ok_N[:, None], other=0.0)
            acc_MD = acc_MD * alpha_M[:, None] + _dot(p_MN.to(v_ND.dtype), v_ND, ACC, UPCAST, PREC)
            m_M = m_new_M
            kt_ptrs += BLOCK_N * skt
            v_ptrs += BLOCK_N * svt

        seen_M = l_M > 0.0
        out_MD = acc_MD / tl.where(seen_M, l_M, 1.0)[:, None]
        lse_M = tl.where(seen_M, _natural_lse(m_M, tl.where(seen_M, l_M, 1.0), ACC), float("-inf"))
        o_ptrs = Out + b * sob + h * soh + m64 * sos + offs_m[:, None] * sos + offs_d[None, :] * sod
        tl.store(o_ptrs, out_MD.to(Out.dtype.element_ty), mask=row_ok_M[:, None])
        tl.store(Lse + b * slb + h * slh + m64 * sls + offs_m * sls, lse_M.to(Lse.dtype.element_ty), mask=row_ok_M)

    @triton.jit
    def _bwd_preprocess_kernel(
        Out,
        DOut,
        Delta,
        CuQ,
        sob,
        soh,
        sos,
        sod,
        sdb,
        sdh,
        sds,
        sdd,
        sxb,
        sxh,
        sxs,
        H,
        S_max,
        VARLEN: tl.constexpr,
        HEAD_D: tl.constexpr,
        BLOCK_M: tl.constexpr,
        ACC: tl.constexpr,
    ):
        """``delta = rowsum(dout * out)`` into ``Delta`` (laid out like the LSE) of the accumulation dtype."""
        pid_m = tl.program_id(0)
        bh = tl.program_id(1)
        b = (bh // H).to(tl.int64)
        h = (bh % H).to(tl.int64)
        q0, S = _seq_span(CuQ, b, S_max, VARLEN)
        start_m = pid_m * BLOCK_M
        if start_m >= S:
            return
        m64 = q0 + start_m
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
        tl.store(Delta + b * sxb + h * sxh + m64 * sxs + offs_m * sxs, delta_M, mask=row_ok_M)

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
        CuQ,
        CuK,
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
        sxb,
        sxh,
        sxs,
        sdkb,
        sdkh,
        sdkt,
        sdkd,
        sdvb,
        sdvh,
        sdvt,
        sdvd,
        H,
        S_max,
        T_max,
        scale_hi,
        scale_lo,
        CAUSAL: tl.constexpr,
        VARLEN: tl.constexpr,
        HEAD_D: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        ACC: tl.constexpr,
        UPCAST: tl.constexpr,
        PREC: tl.constexpr,
    ):
        """One program: ``dk, dv`` of BLOCK_N keys, looping over the query blocks that see them (none for a
        sequence without queries: zeros).

        Works on transposed scores (keys x queries) so that no probability tile needs a transpose."""
        pid_n = tl.program_id(0)
        bh = tl.program_id(1)
        b = (bh // H).to(tl.int64)
        h = (bh % H).to(tl.int64)
        q0, S = _seq_span(CuQ, b, S_max, VARLEN)
        k0, T = _seq_span(CuK, b, T_max, VARLEN)
        start_n = pid_n * BLOCK_N
        if start_n >= T:
            return
        n64 = k0 + start_n
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
        lo64 = q0 + lo
        qt_ptrs = Q + b * sqb + h * sqh + lo64 * sqs + offs_m[None, :] * sqs + offs_d[:, None] * sqd  # [D, M]
        do_ptrs = DOut + b * sdb + h * sdh + lo64 * sds + offs_m[:, None] * sds + offs_d[None, :] * sdd  # [M, D]
        lse_ptrs = Lse + b * slb + h * slh + lo64 * sls + offs_m * sls
        delta_ptrs = Delta + b * sxb + h * sxh + lo64 * sxs + offs_m * sxs
        for start_m in range(lo, S, BLOCK_M):
            rows_M = start_m + offs_m
            row_ok_M = rows_M < S
            qt_DM = tl.load(qt_ptrs, mask=row_ok_M[None, :], other=0.0)
            do_MD = tl.load(do_ptrs, mask=row_ok_M[:, None], other=0.0)
            lse_M = tl.load(lse_ptrs, mask=row_ok_M, other=0.0).to(ACC)
            delta_M = tl.load(delta_ptrs, mask=row_ok_M, other=0.0)
            qk_NM = _dot(k_ND, qt_DM, ACC, UPCAST, PREC)
            s_NM = _scores(qk_NM, scale_hi, scale_lo, ACC)
            # A row with LSE -inf (no visible key in the merged softmax) has p = 0.
            keep_NM = col_ok_N[:, None] & (row_ok_M & (lse_M != float("-inf")))[None, :]
            if CAUSAL:
                keep_NM = keep_NM & (cols_N[:, None] <= rows_M[None, :])
            p_NM = tl.where(keep_NM, _exp(tl.where(keep_NM, s_NM - _to_base(lse_M, ACC)[None, :], 0.0), ACC), 0.0)
            dv_ND += _dot(p_NM.to(do_MD.dtype), do_MD, ACC, UPCAST, PREC)
            dp_NM = _dot(v_ND, tl.trans(do_MD), ACC, UPCAST, PREC)
            ds_NM = p_NM * (dp_NM - delta_M[None, :])
            dk_ND += _dot(ds_NM.to(qt_DM.dtype), tl.trans(qt_DM), ACC, UPCAST, PREC)
            qt_ptrs += BLOCK_M * sqs
            do_ptrs += BLOCK_M * sds
            lse_ptrs += BLOCK_M * sls
            delta_ptrs += BLOCK_M * sxs

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
        CuQ,
        CuK,
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
        sxb,
        sxh,
        sxs,
        sdqb,
        sdqh,
        sdqs,
        sdqd,
        H,
        S_max,
        T_max,
        scale_hi,
        scale_lo,
        CAUSAL: tl.constexpr,
        VARLEN: tl.constexpr,
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
        q0, S = _seq_span(CuQ, b, S_max, VARLEN)
        k0, T = _seq_span(CuK, b, T_max, VARLEN)
        start_m = pid_m * BLOCK_M
        if start_m >= S:
            return
        m64 = q0 + start_m
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
        delta_M = tl.load(Delta + b * sxb + h * sxh + m64 * sxs + offs_m * sxs, mask=row_ok_M, other=0.0)
        row_live_M = row_ok_M & (lse_M != float("-inf"))
        lse_b_M = _to_base(lse_M, ACC)
        k_ptrs = K + b * skb + h * skh + k0 * skt + offs_n[:, None] * skt + offs_d[None, :] * skd  # [N, D]
        vt_ptrs = V + b * svb + h * svh + k0 * svt + offs_n[None, :] * svt + offs_d[:, None] * svd  # [D, N]
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
            s_MN = _scores(qk_MN, scale_hi, scale_lo, ACC)
            keep_MN = row_live_M[:, None] & col_ok_N[None, :]
            if CAUSAL:
                keep_MN = keep_MN & (cols_N[None, :] <= rows_M[:, None])
            p_MN = tl.where(keep_MN, _exp(tl.where(keep_MN, s_MN - lse_b_M[:, None], 0.0), ACC), 0.0)
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


def _check_head_dim_and_dtype(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    D = q.shape[-1]
    if D < 16 or D > 128 or D & (D - 1):
        raise ValueError(f"flash attention supports head dims 16, 32, 64 and 128 (a power of two <= 128), got {D}")
    if q.dtype not in _DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(
            f"flash attention needs q, k, v of one dtype among {[str(d) for d in _DTYPES]}, got "
            f"{q.dtype}, {k.dtype}, {v.dtype}"
        )


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
    _check_head_dim_and_dtype(q_BHSD, k_BHTD, v_BHTD)


def _check_varlen_inputs(
    q_PHD: torch.Tensor,
    k_RHD: torch.Tensor,
    v_RHD: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
) -> None:
    """Shapes, dtypes and devices of the packed inputs (real and fake implementations; the values of the
    cumulative lengths are :func:`_check_cu_seqlens`'s)."""
    if q_PHD.dim() != 3 or k_RHD.dim() != 3 or v_RHD.dim() != 3:
        raise ValueError(
            f"flash_attn_varlen takes packed (total, H, D) tensors, got q {tuple(q_PHD.shape)}, "
            f"k {tuple(k_RHD.shape)}, v {tuple(v_RHD.shape)}"
        )
    if k_RHD.shape != v_RHD.shape or k_RHD.shape[1:] != q_PHD.shape[1:]:
        raise ValueError(
            f"flash_attn_varlen needs k and v of shape (total_k, H, D) matching q {tuple(q_PHD.shape)}, got "
            f"k {tuple(k_RHD.shape)}, v {tuple(v_RHD.shape)}"
        )
    _check_head_dim_and_dtype(q_PHD, k_RHD, v_RHD)
    for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        if cu.dtype != torch.int32 or cu.dim() != 1 or cu.numel() < 2:
            raise ValueError(
                f"{name} must be a 1-D int32 tensor of batch + 1 >= 2 cumulative lengths, got {cu.dtype} of "
                f"shape {tuple(cu.shape)}"
            )
        if cu.device != q_PHD.device or k_RHD.device != q_PHD.device or v_RHD.device != q_PHD.device:
            raise ValueError(
                f"flash_attn_varlen needs q, k, v and {name} on one device, got q {q_PHD.device}, "
                f"k {k_RHD.device}, v {v_RHD.device}, {name} {cu.device}"
            )
    if cu_seqlens_q.numel() != cu_seqlens_k.numel():
        raise ValueError(
            f"cu_seqlens_q and cu_seqlens_k must describe as many sequences, got {cu_seqlens_q.numel() - 1} "
            f"and {cu_seqlens_k.numel() - 1}"
        )
    if max_seqlen_q < 0 or max_seqlen_k < 0:
        raise ValueError(f"max_seqlen_q and max_seqlen_k must be >= 0, got {max_seqlen_q} and {max_seqlen_k}")


def _check_cu_seqlens(cu_seqlens: torch.Tensor, total: int, max_seqlen: int, name: str) -> None:
    """``cu_seqlens`` starts at 0, never decreases, ends at ``total`` and has no sequence longer than
    ``max_seqlen`` (the grid's extent: a longer one would be cut short). Reads the offsets on the host:
    one device sync per call."""
    offsets = cu_seqlens.tolist()
    if offsets[0] != 0:
        raise ValueError(f"{name} must start at 0, got {offsets[0]}")
    lengths = [end - start for start, end in zip(offsets, offsets[1:], strict=False)]
    for i, n in enumerate(lengths):
        if n < 0:
            raise ValueError(f"{name} must not decrease, got {offsets[i]} then {offsets[i + 1]} at index {i}")
        if n > max_seqlen:
            raise ValueError(f"{name}: sequence {i} has {n} rows, more than max_seqlen {max_seqlen}")
    if offsets[-1] != total:
        raise ValueError(f"{name} ends at {offsets[-1]} but the packed tensor has {total} rows")


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


# What the autotuner tries on a GPU, per input dtype and kernel: ``(BLOCK_M, BLOCK_N, num_warps,
# num_stages)``, M query rows and N key rows per tile. Chosen with ``python -m mmpipe.kernels.aot``
# (sm_90, D = 64 and 128, Triton 3.6 and 3.9), which prints shared memory, registers and spills:
# - 16-bit: every config compiles to Hopper's warpgroup MMA, fits in shared memory and does not spill;
#   left out are the tiles that spill (dk/dv with 4 warps or 128-row query tiles, dq at 128 x 128) or
#   lose the warpgroup MMA (query tiles of 32 rows in the forward and dq).
# - float32 (IEEE products, no tensor cores) and float64: the matmuls are FMA loops whose register
#   needs change between Triton releases; each list holds tiles that do not spill on at least one of
#   the two, so the tuner always has a fast one.
_TUNE_CONFIGS: dict[str, dict[str, tuple[tuple[int, int, int, int], ...]]] = {
    "16-bit": {
        "fwd": ((64, 64, 4, 2), (64, 64, 8, 3), (128, 64, 8, 2), (128, 64, 8, 3), (64, 128, 8, 2), (128, 128, 8, 2)),
        "dkdv": ((64, 64, 8, 2), (64, 64, 8, 3), (32, 128, 8, 2), (32, 128, 8, 3), (32, 64, 4, 3)),
        "dq": ((64, 64, 8, 2), (128, 64, 8, 2), (128, 64, 8, 3), (128, 32, 8, 3)),
    },
    "float32": {
        "fwd": ((64, 32, 8, 2), (32, 32, 4, 2), (16, 32, 4, 2), (16, 16, 4, 2)),
        "dkdv": ((16, 32, 4, 2), (16, 16, 4, 2), (32, 32, 4, 2)),
        "dq": ((64, 32, 8, 2), (32, 32, 4, 2), (16, 32, 4, 2)),
    },
    "float64": {
        "fwd": ((32, 32, 4, 1), (16, 32, 4, 1)),
        "dkdv": ((16, 16, 4, 1), (16, 32, 4, 1)),
        "dq": ((16, 32, 4, 2), (16, 16, 4, 1)),
    },
}
_tuners: dict[tuple[str, str, int, int], Any] = {}
_TUNE_MAX_LEN = 2**14  # the longest length bucket (see _tuned)


def _dtype_class(dtype: torch.dtype) -> str:
    return str(dtype)[6:] if dtype in (torch.float32, torch.float64) else "16-bit"


def _blocks(dtype: torch.dtype) -> tuple[int, int, int, int]:
    """``(BLOCK_M, BLOCK_N, num_warps, num_stages)`` of a launch that does not autotune.

    The interpreter gets small, unequal blocks (several blocks and boundary tiles on test shapes, both
    causal loop bounds exercised); a GPU launch with tiles fixed by a test takes the warps and stages
    of the dtype's first forward config."""
    if INTERPRETED:
        return 32, 16, 1, 1
    return _TUNE_CONFIGS[_dtype_class(dtype)]["fwd"][0]


def _jit(kernel: str) -> Any:
    """The Triton kernel ``fwd``, ``dkdv`` or ``dq``."""
    return {"fwd": _fwd_kernel, "dkdv": _bwd_dkdv_kernel, "dq": _bwd_dq_kernel}[kernel]


def _tuned(kernel: str, dtype: torch.dtype, s_max: int, t_max: int) -> Any:
    """The autotuned ``kernel`` (``fwd``, ``dkdv`` or ``dq``) for ``dtype`` inputs and sequences of about
    these lengths.

    One autotuner per power-of-two bucket of the query and key lengths, each keyed by head dim,
    masking and layout: a long-video self-attention and a text cross-attention tune apart, and a
    varlen batch whose longest sequence changes does not re-tune every step. Lengths from 16k up
    share one bucket: there every launch has >= 128 tiles a head along the tiled axis and a loop
    of >= 128 tiles along the other, so the grid fills the GPU many times over and the choice should
    not move with the length (an expectation, not a measurement: the kernel benchmark's ``autotuned``
    list shows the 4k and 16k choices), while a tuning pass at 64k (8 timed calls a config, 15
    configs, 0.3-1.5 s a call) costs over a minute."""
    group = _dtype_class(dtype)
    bucket = (
        kernel,
        group,
        triton.next_power_of_2(min(max(s_max, 1), _TUNE_MAX_LEN)),
        triton.next_power_of_2(min(max(t_max, 1), _TUNE_MAX_LEN)),
    )
    if bucket not in _tuners:
        fn = _jit(kernel)
        configs = [
            triton.Config({"BLOCK_M": m, "BLOCK_N": n}, num_warps=w, num_stages=st)
            for m, n, w, st in _TUNE_CONFIGS[group][kernel]
        ]
        # Short timing windows: at 16k tokens one call takes ~20-100 ms, and the 25 ms / 100 ms
        # defaults would spend seconds per config; config differences are tens of percent.
        bench = functools.partial(triton.testing.do_bench, warmup=5, rep=25)
        _tuners[bucket] = triton.autotune(configs, key=["HEAD_D", "CAUSAL", "VARLEN"], do_bench=bench)(fn)
    return _tuners[bucket]


def _tunes(blocks: tuple[int, int] | None) -> bool:
    """Whether a launch autotunes its tiles: on a GPU, unless a test fixes the tiles."""
    return blocks is None and not INTERPRETED


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


class _Layout(NamedTuple):
    """Where the kernels find ``n_seqs`` sequences of ``heads`` heads.

    Uniform (``cu_q`` is None): BHSD tensors, every sequence ``s_max`` queries and ``t_max`` keys long.
    Packed: sequence ``b`` is rows ``cu_q[b]:cu_q[b + 1]`` of ``(total_q, H, D)`` queries (LSE
    ``(H, total_q)``) and ``cu_k[b]:cu_k[b + 1]`` of ``(total_k, H, D)`` keys, at most ``s_max`` / ``t_max``
    long (the grid's extent)."""

    n_seqs: int
    heads: int
    s_max: int
    t_max: int
    cu_q: torch.Tensor | None = None
    cu_k: torch.Tensor | None = None

    @property
    def varlen(self) -> bool:
        return self.cu_q is not None

    def strides(self, t: torch.Tensor) -> tuple[int, ...]:
        """``t``'s strides in the kernels' (batch, head, sequence[, dim]) order. Packed tensors have no
        batch axis: its stride is 0 and the kernels add each sequence's start row instead."""
        if not self.varlen:
            return tuple(t.stride())
        if t.dim() == 3:  # (total, H, D)
            return (0, t.stride(1), t.stride(0), t.stride(2))
        return (0, *t.stride())  # LSE / delta (H, total)


_MAX_GRID_Y = 65535  # CUDA's limit on a grid's second axis, which carries the (sequence, head) pairs


def _layout(
    n_seqs: int,
    heads: int,
    s_max: int,
    t_max: int,
    cu_q: torch.Tensor | None = None,
    cu_k: torch.Tensor | None = None,
) -> _Layout:
    """The layout, refused (before any launch) when its (sequence, head) pairs overflow the grid."""
    if n_seqs * heads > _MAX_GRID_Y:
        raise ValueError(
            f"flash attention: {n_seqs} sequences x {heads} heads = {n_seqs * heads} (sequence, head) pairs, more "
            f"than a launch grid holds ({_MAX_GRID_Y}); split the batch"
        )
    return _Layout(n_seqs, heads, s_max, t_max, cu_q, cu_k)


def _meta(dtype: torch.dtype, D: int, causal: bool, varlen: bool, blocks: tuple[int, int] | None) -> dict[str, Any]:
    """The kernels' compile-time arguments; ``blocks`` (``BLOCK_M``, ``BLOCK_N``) overrides the tiles (tests).
    Where the launch autotunes (:func:`_tunes`) the tiles, warps and stages are left to the tuner."""
    meta = dict(
        CAUSAL=causal, VARLEN=varlen, HEAD_D=D, ACC=_tl_acc(dtype), UPCAST=_upcast(dtype), PREC=_precision(dtype)
    )
    if _tunes(blocks):
        return meta
    block_m, block_n, warps, stages = _blocks(dtype)
    if blocks is not None:
        block_m, block_n = blocks
    return meta | dict(BLOCK_M=block_m, BLOCK_N=block_n, num_warps=warps, num_stages=stages)


def _kernel(kernel: str, meta: dict[str, Any], layout: _Layout, rows: int, dtype: torch.dtype) -> Any:
    """``kernel`` (``fwd``, ``dkdv`` or ``dq``) launched over its grid: one program per query tile
    (``fwd``, ``dq``) or key tile (``dkdv``) of each (sequence, head) ``rows``; autotuned or with
    ``meta``'s tiles."""
    length, tile = (layout.t_max, "BLOCK_N") if kernel == "dkdv" else (layout.s_max, "BLOCK_M")

    def grid(m: dict[str, Any]) -> tuple[int, int]:
        return triton.cdiv(length, m[tile]), rows

    if tile in meta:
        return _jit(kernel)[grid]
    return _tuned(kernel, dtype, layout.s_max, layout.t_max)[grid]


def _launch_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    layout: _Layout,
    causal: bool,
    scale: float,
    blocks: tuple[int, int] | None,
) -> None:
    """Run the forward kernel into ``out`` and ``lse`` (either layout)."""
    meta = _meta(q.dtype, q.shape[-1], causal, layout.varlen, blocks)
    _kernel("fwd", meta, layout, layout.n_seqs * layout.heads, q.dtype)(
        q,
        k,
        v,
        out,
        lse,
        layout.cu_q,
        layout.cu_k,
        *layout.strides(q),
        *layout.strides(k),
        *layout.strides(v),
        *layout.strides(out),
        *layout.strides(lse),
        layout.heads,
        layout.s_max,
        layout.t_max,
        *_split_scale(scale),
        **meta,
    )


def _launch_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    grads: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    layout: _Layout,
    causal: bool,
    scale: float,
    blocks: tuple[int, int] | None,
) -> None:
    """Run the three backward kernels into ``grads = (dq, dk, dv)`` (either layout; at least one query)."""
    dq, dk, dv = grads
    meta = _meta(q.dtype, q.shape[-1], causal, layout.varlen, blocks)
    rows = layout.n_seqs * layout.heads
    delta = output(lse.shape, _acc_dtype(q.dtype), q.device)  # laid out like the LSE, contiguous
    pre_m = meta.get("BLOCK_M", 64)  # a row sum: its tile is independent of the others'
    _bwd_preprocess_kernel[(triton.cdiv(layout.s_max, pre_m), rows)](
        out,
        dout,
        delta,
        layout.cu_q,
        *layout.strides(out),
        *layout.strides(dout),
        *layout.strides(delta),
        layout.heads,
        layout.s_max,
        VARLEN=layout.varlen,
        HEAD_D=q.shape[-1],
        BLOCK_M=pre_m,
        ACC=meta["ACC"],
        num_warps=meta.get("num_warps", 4),
    )
    common = (
        layout.cu_q,
        layout.cu_k,
        *layout.strides(q),
        *layout.strides(k),
        *layout.strides(v),
        *layout.strides(dout),
        *layout.strides(lse),
        *layout.strides(delta),
    )
    sizes = (layout.heads, layout.s_max, layout.t_max, *_split_scale(scale))
    if layout.t_max > 0:
        _kernel("dkdv", meta, layout, rows, q.dtype)(
            q, k, v, dout, lse, delta, dk, dv, *common, *layout.strides(dk), *layout.strides(dv), *sizes, **meta
        )
    _kernel("dq", meta, layout, rows, q.dtype)(
        q, k, v, dout, lse, delta, dq, *common, *layout.strides(dq), *sizes, **meta
    )


def _forward(
    q_BHSD: torch.Tensor,
    k_BHTD: torch.Tensor,
    v_BHTD: torch.Tensor,
    causal: bool,
    scale: float,
    blocks: tuple[int, int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out_BHSD, lse_BHS)`` by the forward kernel; ``blocks`` (``BLOCK_M``, ``BLOCK_N``) overrides the
    tile sizes (tests)."""
    _check_inputs(q_BHSD, k_BHTD, v_BHTD)
    _check_runnable(q_BHSD, k_BHTD, v_BHTD)
    B, H, S, _ = q_BHSD.shape
    out_BHSD = output(q_BHSD.shape, q_BHSD.dtype, q_BHSD.device)
    lse_BHS = output((B, H, S), _acc_dtype(q_BHSD.dtype), q_BHSD.device)
    if B * H * S > 0:
        layout = _layout(B, H, S, k_BHTD.shape[2])
        _launch_forward(q_BHSD, k_BHTD, v_BHTD, out_BHSD, lse_BHS, layout, causal, scale, blocks)
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
    """``(dq, dk, dv)`` by the three backward kernels; ``blocks`` (``BLOCK_M``, ``BLOCK_N``) overrides the
    tile sizes."""
    _check_inputs(q_BHSD, k_BHTD, v_BHTD)
    if dout_BHSD.shape != q_BHSD.shape or out_BHSD.shape != q_BHSD.shape or lse_BHS.shape != q_BHSD.shape[:3]:
        raise ValueError(
            f"flash attention backward needs dout and out shaped like q {tuple(q_BHSD.shape)} and lse like "
            f"{tuple(q_BHSD.shape[:3])}, got dout {tuple(dout_BHSD.shape)}, out {tuple(out_BHSD.shape)}, "
            f"lse {tuple(lse_BHS.shape)}"
        )
    _check_runnable(dout_BHSD, q_BHSD, k_BHTD, v_BHTD, out_BHSD, lse_BHS)
    dout_BHSD = dout_BHSD.to(q_BHSD.dtype)  # the matmul operands share one dtype
    B, H, S, _ = q_BHSD.shape
    grads = output_like(q_BHSD), output_like(k_BHTD), output_like(v_BHTD)
    dq_BHSD, dk_BHTD, dv_BHTD = grads
    if B * H == 0:
        return dq_BHSD, dk_BHTD, dv_BHTD
    if S == 0:  # no query: no gradient reaches the keys
        return dq_BHSD, dk_BHTD.zero_(), dv_BHTD.zero_()
    layout = _layout(B, H, S, k_BHTD.shape[2])
    _launch_backward(dout_BHSD, q_BHSD, k_BHTD, v_BHTD, out_BHSD, lse_BHS, grads, layout, causal, scale, blocks)
    return dq_BHSD, dk_BHTD, dv_BHTD


def _varlen_layout(
    q_PHD: torch.Tensor,
    k_RHD: torch.Tensor,
    v_RHD: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
) -> _Layout:
    """The checked packed layout (shapes, dtypes, devices and the offsets' values)."""
    _check_varlen_inputs(q_PHD, k_RHD, v_RHD, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    _check_cu_seqlens(cu_seqlens_q, q_PHD.shape[0], max_seqlen_q, "cu_seqlens_q")
    _check_cu_seqlens(cu_seqlens_k, k_RHD.shape[0], max_seqlen_k, "cu_seqlens_k")
    _check_runnable(q_PHD, k_RHD, v_RHD, cu_seqlens_q, cu_seqlens_k)
    n_seqs = cu_seqlens_q.numel() - 1
    return _layout(n_seqs, q_PHD.shape[1], max_seqlen_q, max_seqlen_k, cu_seqlens_q, cu_seqlens_k)


def _varlen_forward(
    q_PHD: torch.Tensor,
    k_RHD: torch.Tensor,
    v_RHD: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    causal: bool,
    scale: float,
    blocks: tuple[int, int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out_PHD, lse_HP)`` of packed sequences by the forward kernel."""
    layout = _varlen_layout(q_PHD, k_RHD, v_RHD, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    P, H, _ = q_PHD.shape
    out_PHD = output(q_PHD.shape, q_PHD.dtype, q_PHD.device)
    lse_HP = output((H, P), _acc_dtype(q_PHD.dtype), q_PHD.device)
    if P * H > 0:
        _launch_forward(q_PHD, k_RHD, v_RHD, out_PHD, lse_HP, layout, causal, scale, blocks)
    return out_PHD, lse_HP


def _varlen_backward(
    dout_PHD: torch.Tensor,
    q_PHD: torch.Tensor,
    k_RHD: torch.Tensor,
    v_RHD: torch.Tensor,
    out_PHD: torch.Tensor,
    lse_HP: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    causal: bool,
    scale: float,
    blocks: tuple[int, int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq_PHD, dk_RHD, dv_RHD)`` of packed sequences by the three backward kernels."""
    layout = _varlen_layout(q_PHD, k_RHD, v_RHD, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    _check_varlen_grad_inputs(dout_PHD, q_PHD, out_PHD, lse_HP)
    _check_runnable(dout_PHD, q_PHD, out_PHD, lse_HP)
    dout_PHD = dout_PHD.to(q_PHD.dtype)  # the matmul operands share one dtype
    grads = output_like(q_PHD), output_like(k_RHD), output_like(v_RHD)
    dq_PHD, dk_RHD, dv_RHD = grads
    P, H, _ = q_PHD.shape
    if H == 0:
        return dq_PHD, dk_RHD, dv_RHD
    if P == 0:  # no query: no gradient reaches the keys
        return dq_PHD, dk_RHD.zero_(), dv_RHD.zero_()
    _launch_backward(dout_PHD, q_PHD, k_RHD, v_RHD, out_PHD, lse_HP, grads, layout, causal, scale, blocks)
    return dq_PHD, dk_RHD, dv_RHD


def _check_varlen_grad_inputs(
    dout_PHD: torch.Tensor, q_PHD: torch.Tensor, out_PHD: torch.Tensor, lse_HP: torch.Tensor
) -> None:
    P, H, _ = q_PHD.shape
    if dout_PHD.shape != q_PHD.shape or out_PHD.shape != q_PHD.shape or lse_HP.shape != (H, P):
        raise ValueError(
            f"flash_attn_varlen backward needs dout and out shaped like q {tuple(q_PHD.shape)} and lse like "
            f"{(H, P)}, got dout {tuple(dout_PHD.shape)}, out {tuple(out_PHD.shape)}, lse {tuple(lse_HP.shape)}"
        )


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


# ---------------------------------------------------------------------------------------------------------------
# Custom ops: packed sequences of different lengths (varlen)
# ---------------------------------------------------------------------------------------------------------------


@torch.library.custom_op("mmpipe::flash_attn_varlen_fwd", mutates_args=())
def flash_attn_varlen_fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    causal: bool,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out_PHD, lse_HP)`` of each packed sequence of ``q_PHD`` over its own keys in ``k_RHD, v_RHD``."""
    return _varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, scale)


@flash_attn_varlen_fwd.register_fake
def _flash_attn_varlen_fwd_fake(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    causal: bool,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    _check_varlen_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    return q.new_empty(q.shape), q.new_empty((q.shape[1], q.shape[0]), dtype=_acc_dtype(q.dtype))


@torch.library.custom_op("mmpipe::flash_attn_varlen_bwd", mutates_args=())
def flash_attn_varlen_bwd(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    causal: bool,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq_PHD, dk_RHD, dv_RHD)`` given the (possibly merged, external) ``out_PHD`` and ``lse_HP``."""
    return _varlen_backward(
        dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, scale
    )


@flash_attn_varlen_bwd.register_fake
def _flash_attn_varlen_bwd_fake(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    causal: bool,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    _check_varlen_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    _check_varlen_grad_inputs(dout, q, out, lse)
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _varlen_setup_context(ctx: Any, inputs: tuple[Any, ...], output: tuple[torch.Tensor, torch.Tensor]) -> None:
    q, k, v, cu_q, cu_k, max_q, max_k, causal, scale = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, cu_q, cu_k)
    ctx.max_q, ctx.max_k, ctx.causal, ctx.scale = max_q, max_k, causal, scale
    ctx.mark_non_differentiable(lse)  # as for the uniform op: for merges, no gradient through it


def _varlen_backward_autograd(ctx: Any, dout: torch.Tensor, dlse: torch.Tensor | None) -> tuple[Any, ...]:
    q, k, v, out, lse, cu_q, cu_k = ctx.saved_tensors
    dq, dk, dv = flash_attn_varlen_bwd(dout, q, k, v, out, lse, cu_q, cu_k, ctx.max_q, ctx.max_k, ctx.causal, ctx.scale)
    return dq, dk, dv, None, None, None, None, None, None


flash_attn_varlen_fwd.register_autograd(_varlen_backward_autograd, setup_context=_varlen_setup_context)


@overload
def flash_attn_varlen(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    *,
    causal: bool = ...,
    softmax_scale: float | None = ...,
    return_lse: Literal[False] = ...,
) -> torch.Tensor: ...


@overload
def flash_attn_varlen(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    *,
    causal: bool = ...,
    softmax_scale: float | None = ...,
    return_lse: Literal[True],
) -> tuple[torch.Tensor, torch.Tensor]: ...


def flash_attn_varlen(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    *,
    causal: bool = False,
    softmax_scale: float | None = None,
    return_lse: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Differentiable attention of packed sequences of different lengths (``flash_attn_varlen_func``'s layout).

    Sequence ``b`` is rows ``cu_seqlens_q[b]:cu_seqlens_q[b + 1]`` of ``q`` (``(total_q, H, D)``) and attends
    to rows ``cu_seqlens_k[b]:cu_seqlens_k[b + 1]`` of ``k, v`` (``(total_k, H, D)``) only; the offsets are
    int32 ``(batch + 1,)``, starting at 0, and ``max_seqlen_*`` bound the lengths. Causal
    masking is top-left aligned per sequence (as :func:`flash_attention`; ``flash_attn`` >= 2.1 aligns
    bottom-right when a sequence has more keys than queries). ``softmax_scale`` defaults to ``1 / sqrt(D)``.
    Returns ``out_PHD``, with ``return_lse`` also ``lse_HP`` (``(H, total_q)``, float32, float64 for float64
    inputs; not differentiable). Zero-length sequences are allowed; a query without keys gets a zero output
    and an LSE of ``-inf``. The offsets are checked on the host (one device sync per call)."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if softmax_scale is None else softmax_scale
    out_PHD, lse_HP = flash_attn_varlen_fwd(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, scale
    )
    return (out_PHD, lse_HP) if return_lse else out_PHD
