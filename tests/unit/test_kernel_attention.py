"""The Triton FlashAttention kernels (``mmpipe.kernels.attention``) against the plain-PyTorch reference.

On a machine without CUDA they run in Triton's interpreter on CPU tensors (tiny shapes). These tests
*fail* (never skip) when triton is missing. Inputs are fresh random numbers on every run; each
assertion message carries the seed that reproduces it (``torch.manual_seed(seed)``).

Tolerances:
- float64 kernel vs float64 reference: rtol = atol = 1e-10. Both accumulate in float64 and differ only
  in summation order (blocked online softmax vs one logsumexp, per-block matmuls), a few ulps times
  sqrt(T * D) ~ 1e-14 for unit-variance inputs; 1e-10 keeps four orders of margin yet fails on any
  float32 rounding inside the kernel (~1e-7; e.g. ``scale`` passed as a float32 costs ~1e-8).
- float32 kernel vs float64 reference (on the float32 inputs): rtol = atol = 5e-5. float32 accumulation
  over <= 64 keys and D <= 128 dims of O(1) values loses ~1e-6 (observed <= 2e-6), 25x margin.
- float16 / bfloat16 kernel vs float64 reference: rtol = atol = 10 eps of the dtype. As in
  FlashAttention-2 the probabilities and their gradients are rounded to the input dtype before their
  matmuls, and outputs are stored in it: a few ulps on O(1) values (observed <= 1.5 eps).
"""

from __future__ import annotations

import random
from collections.abc import Iterator

import pytest
import torch

import mmpipe.kernels._triton as triton_env
from mmpipe.kernels import attention as fa
from mmpipe.parallel.attention import (
    AttentionBackend,
    attention_backward,
    attention_with_lse,
    local_attention,
    select_backend,
)

B, H = 1, 2
# (S, T, causal, D): several query / key blocks with ragged boundaries (interpreter tiles are 32 x 16),
# T > S and S > T under the top-left causal mask, the largest and smallest head dims, and lengths of 1
# (which Triton specializes as constants).
CASES = [
    (48, 48, True, 64),
    (37, 53, False, 64),
    (37, 53, True, 64),
    (53, 37, True, 64),
    (32, 32, True, 128),
    (1, 7, True, 16),
    (9, 1, False, 32),
]
F64 = dict(rtol=1e-10, atol=1e-10)


@pytest.fixture
def seed() -> Iterator[int]:
    """A fresh seed per test, applied to torch's global generator; quoted in assertion messages."""
    s = random.SystemRandom().randrange(2**31)
    torch.manual_seed(s)
    yield s


def _inputs(S: int, T: int, D: int, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    q = torch.randn(B, H, S, D, dtype=torch.float64).to(dtype)
    k = torch.randn(B, H, T, D, dtype=torch.float64).to(dtype)
    v = torch.randn(B, H, T, D, dtype=torch.float64).to(dtype)
    dout = torch.randn(B, H, S, D, dtype=torch.float64).to(dtype)
    return q, k, v, dout


def _reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dout: torch.Tensor, causal: bool, scale: float
) -> tuple[torch.Tensor, ...]:
    """``(out, lse, dq, dk, dv)`` in float64 from the (possibly rounded) inputs."""
    q, k, v, dout = (t.double() for t in (q, k, v, dout))
    out, lse = fa.attention_reference(q, k, v, causal, scale)
    dq, dk, dv = fa.attention_reference_backward(dout, q, k, v, out, lse, causal, scale)
    return out, lse, dq, dk, dv


def _assert_no_nan(seed: int, **tensors: torch.Tensor) -> None:
    """The kernels' outputs start NaN-poisoned: a NaN left is an element no program wrote."""
    for name, t in tensors.items():
        assert not torch.isnan(t).any(), f"{name} has NaN (unwritten or 0 * inf) [seed {seed}]"


def _close(seed: int, what: str, actual: torch.Tensor, expected: torch.Tensor, **tol: float) -> None:
    torch.testing.assert_close(actual.double(), expected.double(), **tol, msg=lambda m: f"{what} [seed {seed}]: {m}")


def _run(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    dout: torch.Tensor,
    causal: bool,
    scale: float,
    blocks: tuple[int, int] | None = None,
) -> tuple[torch.Tensor, ...]:
    if blocks is None:
        out, lse = torch.ops.mmpipe.flash_attn_fwd(q, k, v, causal, scale)
        dq, dk, dv = torch.ops.mmpipe.flash_attn_bwd(dout, q, k, v, out, lse, causal, scale)
    else:
        out, lse = fa._forward(q, k, v, causal, scale, blocks=blocks)
        dq, dk, dv = fa._backward(dout, q, k, v, out, lse, causal, scale, blocks=blocks)
    return out, lse, dq, dk, dv


def _check_all(seed: int, got: tuple[torch.Tensor, ...], ref: tuple[torch.Tensor, ...], **tol: float) -> None:
    names = ("out", "lse", "dq", "dk", "dv")
    _assert_no_nan(seed, **dict(zip(names, got, strict=True)))
    for name, g, r in zip(names, got, ref, strict=True):
        _close(seed, name, g, r, **tol)


def test_triton_runs_here() -> None:
    assert triton_env.AVAILABLE, "triton is not installed: pip install mmpipe[triton]"
    assert torch.cuda.is_available() or triton_env.INTERPRETED, "no CUDA and TRITON_INTERPRET is not 1"
    assert triton_env.can_run(torch.zeros(1, device="cuda" if torch.cuda.is_available() else "cpu"))


@pytest.mark.parametrize("S,T,causal,D", CASES)
def test_float64_matches_reference(seed: int, S: int, T: int, causal: bool, D: int) -> None:
    q, k, v, dout = _inputs(S, T, D, torch.float64)
    scale = 0.7 / D**0.5  # not a power of two: the float32 head + tail split of the scale matters
    got = _run(q, k, v, dout, causal, scale)
    assert got[0].dtype == torch.float64 and got[1].dtype == torch.float64 and got[1].shape == (B, H, S)
    _check_all(seed, got, _reference(q, k, v, dout, causal, scale), **F64)


@pytest.mark.parametrize("S,T", [(48, 48), (53, 37)])
def test_float64_other_tiles(seed: int, S: int, T: int) -> None:
    """Key tiles larger than query tiles: the causal start of the dk/dv query loop skips whole blocks."""
    q, k, v, dout = _inputs(S, T, 64, torch.float64)
    got = _run(q, k, v, dout, True, 0.125, blocks=(16, 32))
    _check_all(seed, got, _reference(q, k, v, dout, True, 0.125), **F64)


# Every tile the GPU autotuner may pick (fa._TUNE_CONFIGS; each kernel's tiles are independent of
# the others'), at lengths that leave ragged last blocks of the largest tile.
TUNED_TILES = sorted({(m, n) for kernels in fa._TUNE_CONFIGS.values() for c in kernels.values() for m, n, _, _ in c})


@pytest.mark.parametrize("blocks", TUNED_TILES, ids=[f"{m}x{n}" for m, n in TUNED_TILES])
@pytest.mark.parametrize("causal", [True, False])
def test_float64_autotuner_tiles(seed: int, blocks: tuple[int, int], causal: bool) -> None:
    """Lengths of one and a half to two and a half tiles: whole and ragged blocks on both axes, S > T
    causal and S < T not (the interpreter's cost grows with the number of tiles, not their size)."""
    m, n = blocks
    S, T = (5 * m // 2 + 1, 3 * n // 2 + 3) if causal else (3 * m // 2 + 3, 5 * n // 2 + 1)
    q, k, v, dout = _inputs(S, T, 32, torch.float64)
    got = _run(q, k, v, dout, causal, 0.3, blocks=blocks)
    _check_all(seed, got, _reference(q, k, v, dout, causal, 0.3), **F64)


@pytest.mark.parametrize(
    "dtype,tol",
    [
        (torch.float32, dict(rtol=5e-5, atol=5e-5)),
        (torch.float16, dict(rtol=10 * torch.finfo(torch.float16).eps, atol=10 * torch.finfo(torch.float16).eps)),
        (torch.bfloat16, dict(rtol=10 * torch.finfo(torch.bfloat16).eps, atol=10 * torch.finfo(torch.bfloat16).eps)),
    ],
)
@pytest.mark.parametrize("S,T,causal,D", [(53, 37, True, 64), (32, 32, True, 128)])
def test_low_precision_vs_float64_reference(
    seed: int, dtype: torch.dtype, tol: dict[str, float], S: int, T: int, causal: bool, D: int
) -> None:
    q, k, v, dout = _inputs(S, T, D, dtype)
    scale = 1.0 / D**0.5
    got = _run(q, k, v, dout, causal, scale)
    assert got[0].dtype == dtype and got[1].dtype == torch.float32
    assert all(g.dtype == dtype for g in got[2:])
    ref = list(_reference(q, k, v, dout, causal, scale))
    # out and lse are compared against float64 from the rounded inputs; the gradients against float64
    # given the kernel's own (rounded) out, as the kernel's delta is formed from it.
    ref[2:] = fa.attention_reference_backward(
        dout.double(), q.double(), k.double(), v.double(), got[0].double(), got[1].double(), causal, scale
    )
    _check_all(seed, got, tuple(ref), **tol)


def test_no_keys_gives_zero_and_minus_inf(seed: int) -> None:
    """T = 0: every query sees no key -> out 0, lse -inf, dq 0, empty dk / dv, no NaN."""
    q, k, v, dout = _inputs(20, 0, 64, torch.float64)
    out, lse, dq, dk, dv = _run(q, k, v, dout, True, 0.125)
    _assert_no_nan(seed, out=out, lse=lse, dq=dq)
    assert (out == 0).all() and torch.isneginf(lse).all() and (dq == 0).all()
    assert dk.shape == k.shape and dv.shape == v.shape


def test_backward_rows_with_minus_inf_lse(seed: int) -> None:
    """Rows whose (merged) LSE is -inf saw no key anywhere: zero gradient, never NaN, the rest exact."""
    q, k, v, dout = _inputs(37, 53, 64, torch.float64)
    out, lse = fa.flash_attn_fwd(q, k, v, False, 0.125)
    dead = torch.zeros(37, dtype=torch.bool)
    dead[[0, 5, 36]] = True
    out = out.masked_fill(dead[:, None], 0.0)
    lse = lse.masked_fill(dead, float("-inf"))
    dq, dk, dv = fa.flash_attn_bwd(dout, q, k, v, out, lse, False, 0.125)
    _assert_no_nan(seed, dq=dq, dk=dk, dv=dv)
    assert (dq[:, :, dead] == 0).all()
    ref = fa.attention_reference_backward(dout, q, k, v, out, lse, False, 0.125)
    for name, g, r in zip(("dq", "dk", "dv"), (dq, dk, dv), ref, strict=True):
        _close(seed, name, g, r, **F64)


def test_strided_inputs(seed: int) -> None:
    """BSHD memory viewed as BHSD (non-contiguous): the kernels follow the strides."""
    q, k, v, dout = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in _inputs(37, 53, 64, torch.float64))
    assert not q.is_contiguous()
    _check_all(seed, _run(q, k, v, dout, True, 0.125), _reference(q, k, v, dout, True, 0.125), **F64)


@pytest.mark.parametrize("causal", [False, True])
def test_autograd(seed: int, causal: bool) -> None:
    q, k, v, dout = _inputs(37, 53, 64, torch.float64)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = fa.flash_attention(*leaves, causal=causal)
    out.backward(dout)
    ref = _reference(q, k, v, dout, causal, 1 / 8)
    _close(seed, "out", out.detach(), ref[0], **F64)
    for name, leaf, r in zip(("dq", "dk", "dv"), leaves, ref[2:], strict=True):
        assert leaf.grad is not None
        _close(seed, name, leaf.grad, r, **F64)


def test_compile_aot_eager(seed: int) -> None:
    """The ops trace through their fake implementations and autograd registration (no graph break)."""
    q, k, v, dout = _inputs(37, 53, 64, torch.float64)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    compiled = torch.compile(fa.flash_attention, backend="aot_eager", fullgraph=True)
    out = compiled(*leaves, causal=True)
    out.backward(dout)
    ref = _reference(q, k, v, dout, True, 1 / 8)
    _close(seed, "out", out.detach(), ref[0], **F64)
    for name, leaf, r in zip(("dq", "dk", "dv"), leaves, ref[2:], strict=True):
        assert leaf.grad is not None
        _close(seed, name, leaf.grad, r, **F64)


def test_opcheck(seed: int) -> None:
    q, k, v, dout = _inputs(20, 24, 32, torch.float64)
    out, lse = fa.flash_attn_fwd(q, k, v, True, 0.2)
    grad_args = [t.clone().requires_grad_() for t in (q, k, v)]
    torch.library.opcheck(torch.ops.mmpipe.flash_attn_fwd.default, (*grad_args, True, 0.2))
    torch.library.opcheck(torch.ops.mmpipe.flash_attn_bwd.default, (dout, q, k, v, out, lse, True, 0.2))


def test_fake_shapes() -> None:
    with torch.device("meta"):
        q, k, v = torch.empty(2, 3, 5, 64), torch.empty(2, 3, 7, 64), torch.empty(2, 3, 7, 64)
        out, lse = fa.flash_attn_fwd(q, k, v, False, 0.1)
        assert out.shape == q.shape and out.dtype == q.dtype
        assert lse.shape == (2, 3, 5) and lse.dtype == torch.float32
        o64, l64 = fa.flash_attn_fwd(q.double(), k.double(), v.double(), False, 0.1)
        assert o64.dtype == l64.dtype == torch.float64
        dq, dk, dv = fa.flash_attn_bwd(q, q, k, v, out, lse, True, 0.1)
        assert (dq.shape, dk.shape, dv.shape) == (q.shape, k.shape, v.shape)


@pytest.mark.parametrize("D", [8, 48, 256])
def test_head_dim_is_checked(D: int) -> None:
    q = torch.zeros(1, 1, 4, D)
    with pytest.raises(ValueError, match=f"head dim.*got {D}"):
        fa.flash_attn_fwd(q, q, q, False, 1.0)


def test_too_many_sequence_head_pairs_are_refused_before_a_launch() -> None:
    # CUDA grids hold 65535 programs on their second axis, which carries the (sequence, head) pairs
    q = torch.zeros(32768, 2, 1, 16)
    with pytest.raises(ValueError, match=r"32768 sequences x 2 heads = 65536 .* \(65535\); split the batch"):
        fa.flash_attn_fwd(q, q, q, False, 1.0)
    lse = torch.zeros(32768, 2, 1)
    with pytest.raises(ValueError, match="65536 .* pairs"):
        fa.flash_attn_bwd(q, q, q, q, q, lse, False, 1.0)
    cu = torch.arange(32769, dtype=torch.int32)
    with pytest.raises(ValueError, match="32768 sequences x 2 heads"):
        fa.flash_attn_varlen(q[:, :, 0], q[:, :, 0], q[:, :, 0], cu, cu, 1, 1)


def test_cannot_run_names_why(monkeypatch: pytest.MonkeyPatch) -> None:
    q = torch.zeros(1, 1, 4, 16)
    monkeypatch.setattr(fa, "can_run", lambda *t: False)
    monkeypatch.setattr(fa, "INTERPRETED", False)
    with pytest.raises(RuntimeError, match="CUDA tensors.*TRITON_INTERPRET=1"):
        fa.flash_attn_fwd(q, q, q, False, 1.0)
    monkeypatch.setattr(fa, "AVAILABLE", False)
    with pytest.raises(RuntimeError, match="Triton is not installed"):
        fa.flash_attn_fwd(q, q, q, False, 1.0)


def test_select_backend_needs_triton(monkeypatch: pytest.MonkeyPatch) -> None:
    assert select_backend("triton").name == AttentionBackend.TRITON
    assert select_backend(AttentionBackend.TRITON).returns_lse
    monkeypatch.setattr(triton_env, "AVAILABLE", False)
    with pytest.raises(ValueError, match="'triton' needs the triton package"):
        select_backend("triton")


@pytest.mark.parametrize("causal", [False, True])
def test_backend_matches_math(seed: int, causal: bool) -> None:
    """mmpipe's single-process attention core: backend ``triton`` == backend ``math`` (float64)."""
    q, k, v, dout = _inputs(37, 53, 64, torch.float64)
    tri, math_ = select_backend("triton"), select_backend("math")
    got = attention_with_lse(tri, q, k, v, causal=causal, scale=0.125)
    ref = attention_with_lse(math_, q, k, v, causal=causal, scale=0.125)
    for name, g, r in zip(("out", "lse"), got, ref, strict=True):
        _close(seed, name, g, r, **F64)
    grads = attention_backward(tri, dout, q, k, v, *ref, causal=causal, scale=0.125)
    ref_grads = attention_backward(math_, dout, q, k, v, *ref, causal=causal, scale=0.125)
    for name, g, r in zip(("dq", "dk", "dv"), grads, ref_grads, strict=True):
        _close(seed, name, g, r, **F64)

    results = []
    for impl in (tri, math_):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = local_attention(*leaves, causal=causal, impl=impl)
        out.backward(dout)
        results.append((out.detach(), *(leaf.grad for leaf in leaves)))
    for name, g, r in zip(("out", "dq", "dk", "dv"), *results, strict=True):
        assert g is not None and r is not None
        _close(seed, f"local_attention {name}", g, r, **F64)


@pytest.mark.parametrize("causal", [False, True])
def test_ring_merge(seed: int, causal: bool) -> None:
    """Keys in two halves, merged by LSE == full attention; the backward of each half given the merged
    out and LSE sums to the full gradients (what ring attention does).

    Causal: the top-left mask holds for the first half against all queries; the second half is seen only
    by the queries at or after it, top-left aligned against them (a zig-zag ring's diagonal block)."""
    S = T = 48 if causal else 53
    if not causal:
        S = 37
    q, k, v, dout = _inputs(S, T, 64, torch.float64)
    scale = 0.125
    h = T // 2 + (0 if causal else 1)
    k1, v1, k2, v2 = k[:, :, :h], v[:, :, :h], k[:, :, h:], v[:, :, h:]
    q2 = q[:, :, h:] if causal else q  # queries that see the second half
    rows2 = slice(h, S) if causal else slice(0, S)

    o1, l1 = fa.flash_attn_fwd(q, k1, v1, causal, scale)
    o2, l2 = fa.flash_attn_fwd(q2.contiguous(), k2, v2, causal, scale)
    o2_full = torch.zeros_like(o1)
    l2_full = torch.full_like(l1, float("-inf"))
    o2_full[:, :, rows2], l2_full[:, :, rows2] = o2, l2
    lse = torch.logaddexp(l1, l2_full)
    out = o1 * torch.exp(l1 - lse)[..., None] + o2_full * torch.exp(l2_full - lse)[..., None]

    ref = _reference(q, k, v, dout, causal, scale)
    _close(seed, "merged out", out, ref[0], **F64)
    _close(seed, "merged lse", lse, ref[1], **F64)

    dq1, dk1, dv1 = fa.flash_attn_bwd(dout, q, k1, v1, out, lse, causal, scale)
    dq2, dk2, dv2 = fa.flash_attn_bwd(
        dout[:, :, rows2].contiguous(),
        q2.contiguous(),
        k2,
        v2,
        out[:, :, rows2].contiguous(),
        lse[:, :, rows2].contiguous(),
        causal,
        scale,
    )
    dq = dq1.clone()
    dq[:, :, rows2] += dq2
    _close(seed, "ring dq", dq, ref[2], **F64)
    _close(seed, "ring dk", torch.cat([dk1, dk2], 2), ref[3], **F64)
    _close(seed, "ring dv", torch.cat([dv1, dv2], 2), ref[4], **F64)
