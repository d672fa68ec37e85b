"""The Triton FlashAttention kernels on packed sequences of different lengths (``flash_attn_varlen``).

Against the plain-PyTorch reference (a loop over sequences) and against the uniform op run on each
sequence alone. Without CUDA the kernels run in Triton's interpreter on CPU tensors (tiny shapes);
these tests fail (never skip) when triton is missing. Inputs are fresh random numbers on every run;
each assertion message carries the seed that reproduces it (``torch.manual_seed(seed)``). The ops
return NaN-filled buffers that the kernels overwrite, so an element no program wrote stays NaN: every
result is checked for NaN before it is compared (and ``test_poison_shows_unwritten_rows`` shows that
such a row is caught).

Tolerances (as in ``test_kernel_attention.py``):
- float64 kernel vs float64 reference: rtol = atol = 1e-10; both accumulate in float64 and differ only
  in summation order (~1e-14 here), while any float32 rounding inside the kernel would cost ~1e-7.
- float32 kernel vs float64 reference on the float32 inputs: rtol = atol = 5e-5; float32 accumulation
  over <= 64 keys and 32 dims of O(1) values loses ~1e-6.
- packed vs the uniform op per sequence: bitwise equal. The programs of a sequence run the same tiles
  (sequence-relative rows and columns, the same masks, zeros loaded past its end) in the same order.
"""

from __future__ import annotations

import random
from collections.abc import Iterator

import pytest
import torch
from test_kernel_attention import TUNED_TILES

from mmpipe.kernels import attention as fa

H, D = 2, 32
# Per-sequence (query, key) lengths. CROSS: queries and keys of different lengths (S > T and S < T under
# the top-left causal mask), a sequence of length 1, one without queries, one without keys, lengths not
# multiples of the interpreter's 32 x 16 tiles and several blocks per sequence. SELF: q and k share lengths.
CROSS = ([1, 37, 0, 16, 50, 3], [7, 53, 5, 1, 40, 0])
SELF = ([1, 33, 16, 47], [1, 33, 16, 47])
F64 = dict(rtol=1e-10, atol=1e-10)
F32 = dict(rtol=5e-5, atol=5e-5)
NAMES = ("out", "lse", "dq", "dk", "dv")


@pytest.fixture
def seed() -> Iterator[int]:
    """A fresh seed per test, applied to torch's global generator; quoted in assertion messages."""
    s = random.SystemRandom().randrange(2**31)
    torch.manual_seed(s)
    yield s


def _cu(lengths: list[int]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)


class Batch:
    """Packed random inputs for per-sequence lengths ``lq`` (queries) and ``lk`` (keys)."""

    def __init__(self, lq: list[int], lk: list[int], dtype: torch.dtype = torch.float64, qkv: bool = False) -> None:
        self.lq, self.lk = lq, lk
        self.cu_q, self.cu_k = _cu(lq), _cu(lk)
        self.max_q, self.max_k = max(lq), max(lk)
        P, R = sum(lq), sum(lk)
        if qkv:  # self-attention projections in one (total, 3, H, D) buffer: q, k, v are strided views
            assert P == R
            self.q, self.k, self.v = torch.randn(P, 3, H, D, dtype=torch.float64).to(dtype).unbind(1)
        else:
            self.q = torch.randn(P, H, D, dtype=torch.float64).to(dtype)
            self.k, self.v = (torch.randn(R, H, D, dtype=torch.float64).to(dtype) for _ in range(2))
        self.dout = torch.randn(P, H, D, dtype=torch.float64).to(dtype)

    @property
    def seqs(self) -> tuple[torch.Tensor, torch.Tensor, int, int]:
        return self.cu_q, self.cu_k, self.max_q, self.max_k

    def run(self, causal: bool, scale: float, blocks: tuple[int, int] | None = None) -> tuple[torch.Tensor, ...]:
        """``(out, lse, dq, dk, dv)`` by the ops (or the launchers, to override the tiles)."""
        q, k, v, dout = self.q, self.k, self.v, self.dout
        if blocks is None:
            out, lse = torch.ops.mmpipe.flash_attn_varlen_fwd(q, k, v, *self.seqs, causal, scale)
            grads = torch.ops.mmpipe.flash_attn_varlen_bwd(dout, q, k, v, out, lse, *self.seqs, causal, scale)
        else:
            out, lse = fa._varlen_forward(q, k, v, *self.seqs, causal, scale, blocks=blocks)
            grads = fa._varlen_backward(dout, q, k, v, out, lse, *self.seqs, causal, scale, blocks=blocks)
        return out, lse, *grads

    def reference(self, causal: bool, scale: float) -> tuple[torch.Tensor, ...]:
        """``(out, lse, dq, dk, dv)`` in float64 from the (possibly rounded) inputs."""
        q, k, v, dout = (t.double() for t in (self.q, self.k, self.v, self.dout))
        out, lse = fa.attention_varlen_reference(q, k, v, self.cu_q, self.cu_k, causal, scale)
        grads = fa.attention_varlen_reference_backward(dout, q, k, v, out, lse, self.cu_q, self.cu_k, causal, scale)
        return out, lse, *grads


def _assert_no_nan(seed: int, names: tuple[str, ...], tensors: tuple[torch.Tensor, ...]) -> None:
    for name, t in zip(names, tensors, strict=True):
        assert not torch.isnan(t).any(), f"{name} has NaN (unwritten or 0 * inf) [seed {seed}]"


def _check_all(seed: int, got: tuple[torch.Tensor, ...], ref: tuple[torch.Tensor, ...], **tol: float) -> None:
    _assert_no_nan(seed, NAMES, got)
    for name, g, r in zip(NAMES, got, ref, strict=True):
        torch.testing.assert_close(g.double(), r.double(), **tol, msg=lambda m, n=name: f"{n} [seed {seed}]: {m}")


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("lengths", [CROSS, SELF], ids=["cross", "self"])
def test_float64_matches_reference(seed: int, lengths: tuple[list[int], list[int]], causal: bool) -> None:
    batch = Batch(*lengths, qkv=lengths is SELF)
    scale = 0.7 / D**0.5  # not a power of two: the float32 head + tail split of the scale matters
    got = batch.run(causal, scale)
    assert got[1].shape == (H, sum(batch.lq)) and got[1].dtype == torch.float64
    _check_all(seed, got, batch.reference(causal, scale), **F64)
    if lengths is CROSS:  # the last sequence has no keys: zero output, LSE -inf, zero dq
        rows = slice(int(batch.cu_q[-2]), int(batch.cu_q[-1]))
        assert (got[0][rows] == 0).all() and torch.isneginf(got[1][:, rows]).all() and (got[2][rows] == 0).all()


def test_float64_other_tiles(seed: int) -> None:
    """Key tiles larger than query tiles: the causal start of the dk/dv query loop skips whole blocks."""
    batch = Batch(*CROSS)
    _check_all(seed, batch.run(True, 0.125, blocks=(16, 32)), batch.reference(True, 0.125), **F64)


@pytest.mark.parametrize("blocks", TUNED_TILES, ids=[f"{m}x{n}" for m, n in TUNED_TILES])
def test_float64_autotuner_tiles(seed: int, blocks: tuple[int, int]) -> None:
    """Every tile the GPU autotuner may pick, on sequences longer than one tile and shorter than one."""
    m, n = blocks
    batch = Batch([3 * m // 2 + 3, 0, m // 2 + 5, 5 * m // 2 + 1], [5 * n // 2 + 1, 5, n // 2 + 3, 3 * n // 2 + 3])
    _check_all(seed, batch.run(True, 0.125, blocks=blocks), batch.reference(True, 0.125), **F64)


def test_float32_matches_float64_reference(seed: int) -> None:
    batch = Batch(*CROSS, dtype=torch.float32)
    got = batch.run(True, D**-0.5)
    assert all(g.dtype == torch.float32 for g in got)
    ref = list(batch.reference(True, D**-0.5))
    # The gradients against float64 given the kernel's own (rounded) out, from which its delta is formed.
    q, k, v, dout = (t.double() for t in (batch.q, batch.k, batch.v, batch.dout))
    ref[2:] = fa.attention_varlen_reference_backward(
        dout, q, k, v, got[0].double(), got[1].double(), batch.cu_q, batch.cu_k, True, D**-0.5
    )
    _check_all(seed, got, tuple(ref), **F32)


@pytest.mark.parametrize("causal", [False, True])
def test_equals_uniform_op_per_sequence(seed: int, causal: bool) -> None:
    """Packed == ``flash_attn_fwd`` / ``flash_attn_bwd`` on each sequence alone (BHSD, batch 1), bitwise."""
    batch = Batch(*CROSS)
    got = batch.run(causal, 0.2)
    _assert_no_nan(seed, NAMES, got)
    out, lse, dq, dk, dv = got
    spans = zip(fa._spans(batch.cu_q), fa._spans(batch.cu_k), strict=True)
    for i, (rows_q, rows_k) in enumerate(spans):
        q, dout = (fa._as_1HSD(t[rows_q]) for t in (batch.q, batch.dout))
        k, v = (fa._as_1HSD(t[rows_k]) for t in (batch.k, batch.v))
        o1, l1 = fa.flash_attn_fwd(q, k, v, causal, 0.2)
        g1 = fa.flash_attn_bwd(dout, q, k, v, o1, l1, causal, 0.2)
        packed = (out[rows_q], lse[:, rows_q], dq[rows_q], dk[rows_k], dv[rows_k])
        alone = (o1[0].transpose(0, 1), l1[0], *(g[0].transpose(0, 1) for g in g1))
        for name, p, a in zip(NAMES, packed, alone, strict=True):
            assert torch.equal(p, a), f"sequence {i} {name}: packed != alone [seed {seed}]"


def test_no_queries_at_all(seed: int) -> None:
    """total_q = 0: empty out and lse, zero dk / dv (no query sees the keys)."""
    batch = Batch([0, 0], [3, 2])
    out, lse, dq, dk, dv = batch.run(False, 0.2)
    assert out.shape == (0, H, D) and lse.shape == (H, 0) and dq.shape == (0, H, D)
    assert (dk == 0).all() and (dv == 0).all(), f"[seed {seed}]"


@pytest.mark.parametrize("return_lse", [False, True])
def test_autograd(seed: int, return_lse: bool) -> None:
    batch = Batch(*SELF)
    leaves = [t.clone().requires_grad_() for t in (batch.q, batch.k, batch.v)]
    res = fa.flash_attn_varlen(*leaves, *batch.seqs, causal=True, return_lse=return_lse)
    out, lse = res if isinstance(res, tuple) else (res, None)
    out.backward(batch.dout)
    ref = batch.reference(True, D**-0.5)  # softmax_scale defaults to 1 / sqrt(D)
    got = (out.detach(), ref[1] if lse is None else lse, *(leaf.grad for leaf in leaves))
    assert all(g is not None for g in got)
    _check_all(seed, got, ref, **F64)  # type: ignore[arg-type]


def test_compile_aot_eager(seed: int) -> None:
    """The ops trace through their fake implementations and autograd registration (no graph break)."""
    batch = Batch(*CROSS)
    leaves = [t.clone().requires_grad_() for t in (batch.q, batch.k, batch.v)]
    compiled = torch.compile(fa.flash_attn_varlen, backend="aot_eager", fullgraph=True)
    out = compiled(*leaves, *batch.seqs, causal=True, softmax_scale=0.2)
    out.backward(batch.dout)
    ref = batch.reference(True, 0.2)
    got = (out.detach(), ref[1], *(leaf.grad for leaf in leaves))
    _check_all(seed, got, ref, **F64)  # type: ignore[arg-type]


def test_opcheck(seed: int) -> None:
    batch = Batch([5, 0, 9], [4, 6, 11])
    out, lse = fa.flash_attn_varlen_fwd(batch.q, batch.k, batch.v, *batch.seqs, True, 0.2)
    leaves = [t.clone().requires_grad_() for t in (batch.q, batch.k, batch.v)]
    torch.library.opcheck(torch.ops.mmpipe.flash_attn_varlen_fwd.default, (*leaves, *batch.seqs, True, 0.2))
    args = (batch.dout, batch.q, batch.k, batch.v, out, lse, *batch.seqs, True, 0.2)
    torch.library.opcheck(torch.ops.mmpipe.flash_attn_varlen_bwd.default, args)


def test_fake_shapes() -> None:
    with torch.device("meta"):
        q, k = torch.empty(12, 3, 64), torch.empty(20, 3, 64)
        cu = torch.empty(4, dtype=torch.int32)
        out, lse = fa.flash_attn_varlen_fwd(q, k, k, cu, cu, 8, 9, False, 0.1)
        assert out.shape == q.shape and out.dtype == q.dtype
        assert lse.shape == (3, 12) and lse.dtype == torch.float32
        o64, l64 = fa.flash_attn_varlen_fwd(q.double(), k.double(), k.double(), cu, cu, 8, 9, False, 0.1)
        assert o64.dtype == l64.dtype == torch.float64
        dq, dk, dv = fa.flash_attn_varlen_bwd(q, q, k, k, out, lse, cu, cu, 8, 9, True, 0.1)
        assert (dq.shape, dk.shape, dv.shape) == (q.shape, k.shape, k.shape)


def _bad(**change: object) -> dict[str, object]:
    """Valid arguments of two sequences (3 + 4 queries, 5 + 2 keys) with ``change`` applied."""
    args: dict[str, object] = dict(
        q=torch.zeros(7, 1, 16),
        k=torch.zeros(7, 1, 16),
        v=torch.zeros(7, 1, 16),
        cu_seqlens_q=torch.tensor([0, 3, 7], dtype=torch.int32),
        cu_seqlens_k=torch.tensor([0, 5, 7], dtype=torch.int32),
        max_seqlen_q=4,
        max_seqlen_k=5,
    )
    return args | change


@pytest.mark.parametrize(
    "args,match",
    [
        (
            _bad(cu_seqlens_q=torch.tensor([0, 8, 7], dtype=torch.int32), max_seqlen_q=8),
            "cu_seqlens_q must not decrease, got 8 then 7",
        ),
        (_bad(cu_seqlens_k=torch.tensor([1, 5, 7], dtype=torch.int32)), "cu_seqlens_k must start at 0, got 1"),
        (_bad(cu_seqlens_q=torch.tensor([0, 3, 6], dtype=torch.int32)), "cu_seqlens_q ends at 6 but .* 7 rows"),
        (_bad(max_seqlen_k=4), "cu_seqlens_k: sequence 0 has 5 rows, more than max_seqlen 4"),
        (_bad(cu_seqlens_q=torch.tensor([0, 3, 7])), "cu_seqlens_q must be a 1-D int32 tensor.*torch.int64"),
        (_bad(cu_seqlens_k=torch.tensor([0, 5, 7], dtype=torch.int32, device="meta")), "one device.*meta"),
        (_bad(cu_seqlens_k=torch.tensor([0, 7], dtype=torch.int32)), "as many sequences, got 2 and 1"),
        (_bad(cu_seqlens_q=torch.tensor([0], dtype=torch.int32)), "batch \\+ 1 >= 2"),
        (_bad(q=torch.zeros(7, 1, 24), k=torch.zeros(7, 1, 24), v=torch.zeros(7, 1, 24)), "head dims .* got 24"),
        (_bad(k=torch.zeros(7, 2, 16), v=torch.zeros(7, 2, 16)), "k and v of shape \\(total_k, H, D\\)"),
        (_bad(q=torch.zeros(1, 7, 1, 16)), "packed \\(total, H, D\\) tensors"),
        (_bad(v=torch.zeros(7, 1, 16, dtype=torch.float64)), "one dtype"),
        (_bad(max_seqlen_q=-1), "max_seqlen_q and max_seqlen_k must be >= 0"),
    ],
)
def test_invalid_inputs(args: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        fa.flash_attn_varlen(**args)  # type: ignore[arg-type]


def test_backward_shapes_are_checked() -> None:
    batch = Batch([3, 4], [5, 2])
    out, lse = fa.flash_attn_varlen_fwd(batch.q, batch.k, batch.v, *batch.seqs, False, 0.2)
    with pytest.raises(ValueError, match="lse like \\(2, 7\\)"):
        fa.flash_attn_varlen_bwd(batch.dout, batch.q, batch.k, batch.v, out, lse.T, *batch.seqs, False, 0.2)


def test_poison_shows_unwritten_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    """With the offsets' check off, a max_seqlen_q below the longest sequence launches too few query
    blocks: the rows past it stay NaN (what the NaN checks above would catch), and only those."""
    monkeypatch.setattr(fa, "_check_cu_seqlens", lambda *args: None)
    batch = Batch([40, 8], [40, 8])
    out, lse = fa._varlen_forward(batch.q, batch.k, batch.v, batch.cu_q, batch.cu_k, 32, 40, False, 0.2)
    unwritten = torch.zeros(48, dtype=torch.bool)
    unwritten[32:40] = True
    assert torch.isnan(out[unwritten]).all() and torch.isnan(lse[:, unwritten]).all()
    assert not torch.isnan(out[~unwritten]).any() and not torch.isnan(lse[:, ~unwritten]).any()
