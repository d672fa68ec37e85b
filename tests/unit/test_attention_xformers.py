"""The ``xformers`` attention backend (``xformers.ops.fmha``'s forward with LSE and its backward).

xFormers has no CPU operator, so on CPU its dispatcher is pointed at a reference operator written
against xFormers' own operator interface (:class:`_ReferenceFwOp`, :class:`_ReferenceBwOp`): the real
xFormers entry points then run as on a GPU (input validation, BMHK layout, the causal bias class and
its top-left alignment, ``scale``, the LSE's shape checks and CUTLASS's 32-padding of it), and only the
arithmetic is the reference's. xFormers' own kernels are tested on CUDA in test_attention_cuda.py (``benchmarks/gpu_checks.sh``).

Tolerance: the reference operator and the ``math`` backend both compute in float64 and differ only in
summation order (one matmul against a masked softmax vs ``logsumexp``): rtol = atol = 1e-12.
"""

from __future__ import annotations

import copy
import math
import random

import pytest
import torch

fmha = pytest.importorskip("xformers.ops.fmha")

from xformers.ops.fmha.attn_bias import LowerTriangularMask  # noqa: E402
from xformers.ops.fmha.common import (  # noqa: E402
    AttentionBwOpBase,
    AttentionFwOpBase,
    Context,
    Gradients,
    Inputs,
)

from mmpipe.kernels.registry import KernelChoice, resolve  # noqa: E402
from mmpipe.parallel.attention import (  # noqa: E402
    AttentionBackend,
    attention_backward,
    attention_with_lse,
    local_attention,
    select_backend,
)
from mmpipe.stages.wan_kernels import use_kernels  # noqa: E402

LSE_PAD = 32  # CUTLASS's forward pads the LSE's query axis to this; its backward pads a given one


def _scores_BHST(inp: Inputs) -> torch.Tensor:
    q_BHSD, k_BHTD = inp.query.transpose(1, 2), inp.key.transpose(1, 2)
    s_BHST = (q_BHSD @ k_BHTD.transpose(-1, -2)) * inp.scale_float
    if inp.attn_bias is not None:  # xFormers' own materialisation of the mask (its alignment, not ours)
        s_BHST = s_BHST + inp.attn_bias.materialize(s_BHST.shape, dtype=s_BHST.dtype, device=s_BHST.device)
    return s_BHST


class _ReferenceFwOp(AttentionFwOpBase):
    """Explicit softmax on CPU, returning the LSE padded as CUTLASS's forward does."""

    OPERATOR = _scores_BHST
    NAME = "mmpipe_cpu_reference"
    SUPPORTED_DEVICES = {"cpu"}
    SUPPORTED_DTYPES = {torch.float32, torch.float64}
    SUPPORTED_MAX_K = 256
    SUPPORTED_ATTN_BIAS_TYPES = (type(None), LowerTriangularMask)
    SUPPORTS_DROPOUT = False
    SUPPORTS_CUSTOM_SCALE = True

    @classmethod
    def apply(cls, inp: Inputs, needs_gradient: bool) -> tuple[torch.Tensor, Context | None]:
        s_BHST = _scores_BHST(inp)
        lse_BHS = torch.logsumexp(s_BHST, dim=-1)
        out_BSHD = (torch.softmax(s_BHST, dim=-1) @ inp.value.transpose(1, 2)).transpose(1, 2)
        pad = -lse_BHS.shape[-1] % LSE_PAD
        return out_BSHD, Context(out=out_BSHD, lse=torch.nn.functional.pad(lse_BHS, (0, pad), value=math.inf))


class _ReferenceBwOp(AttentionBwOpBase):
    """FlashAttention-2's backward from the given ``out`` and ``lse``, padding the LSE as CUTLASS's does."""

    OPERATOR = _scores_BHST
    NAME = "mmpipe_cpu_reference"
    SUPPORTED_DEVICES = _ReferenceFwOp.SUPPORTED_DEVICES
    SUPPORTED_DTYPES = _ReferenceFwOp.SUPPORTED_DTYPES
    SUPPORTED_MAX_K = _ReferenceFwOp.SUPPORTED_MAX_K
    SUPPORTED_ATTN_BIAS_TYPES = _ReferenceFwOp.SUPPORTED_ATTN_BIAS_TYPES
    SUPPORTS_DROPOUT = False
    SUPPORTS_CUSTOM_SCALE = True
    VARLEN_LSE_PACKED = False

    @classmethod
    def apply(cls, ctx: Context, inp: Inputs, grad: torch.Tensor) -> Gradients:
        s = inp.query.shape[1]
        lse_BHS1 = ctx.get_padded_lse(LSE_PAD)[..., :s].unsqueeze(-1)
        p_BHST = torch.exp(_scores_BHST(inp) - lse_BHS1)
        do_BHSD, o_BHSD = grad.transpose(1, 2), ctx.out.transpose(1, 2)
        q_BHSD, k_BHTD, v_BHTD = (x.transpose(1, 2) for x in (inp.query, inp.key, inp.value))
        ds_BHST = p_BHST * (do_BHSD @ v_BHTD.transpose(-1, -2) - (do_BHSD * o_BHSD).sum(-1, keepdim=True))
        scale = inp.scale_float
        dq, dk = (ds_BHST @ k_BHTD) * scale, (ds_BHST.transpose(-1, -2) @ q_BHSD) * scale
        dv = p_BHST.transpose(-1, -2) @ do_BHSD
        return Gradients(dq=dq.transpose(1, 2), dk=dk.transpose(1, 2), dv=dv.transpose(1, 2))


@pytest.fixture
def cpu_xformers(monkeypatch: pytest.MonkeyPatch) -> None:
    """xFormers' dispatchers pick the reference operators (their CUDA ones refuse CPU tensors)."""
    monkeypatch.setattr(fmha, "_dispatch_fw", lambda inp, needs_gradient: _ReferenceFwOp)
    monkeypatch.setattr(fmha, "_dispatch_bw", lambda inp, varlen_lse_packed: _ReferenceBwOp)


def _seed() -> int:
    seed = random.randrange(2**31)
    torch.manual_seed(seed)
    return seed


@pytest.mark.parametrize(
    ("s", "t", "causal"), [(37, 37, True), (20, 45, True), (45, 20, True), (33, 50, False)], ids=str
)
@pytest.mark.usefixtures("cpu_xformers")
def test_xformers_forward_and_backward_match_the_math_backend(s: int, t: int, causal: bool) -> None:
    seed = _seed()
    xf, ref = select_backend("xformers"), select_backend("math")
    scale = 0.3  # not 1 / sqrt(D): the custom scale must reach xFormers
    q, k, v = (torch.randn(2, 3, n, 16, dtype=torch.float64) for n in (s, t, t))
    out, lse = attention_with_lse(xf, q, k, v, causal=causal, scale=scale)
    out_ref, lse_ref = attention_with_lse(ref, q, k, v, causal=causal, scale=scale)
    assert out.shape == out_ref.shape and lse.shape == lse_ref.shape == (2, 3, s)  # the LSE's padding cut
    torch.testing.assert_close(out, out_ref, rtol=1e-12, atol=1e-12, msg=f"seed {seed}")
    torch.testing.assert_close(lse, lse_ref, rtol=1e-12, atol=1e-12, msg=f"seed {seed}")
    # An external (as a ring merges it) output and LSE: a shifted LSE scales every probability,
    # so a backward that recomputed its own softmax instead of taking this one would not match.
    dout, lse_ext = torch.randn_like(out), lse_ref + 0.25
    got = attention_backward(xf, dout, q, k, v, out_ref, lse_ext, causal=causal, scale=scale)
    want = attention_backward(ref, dout, q, k, v, out_ref, lse_ext, causal=causal, scale=scale)
    for name, g, w in zip("qkv", got, want, strict=True):
        assert g.shape == w.shape
        torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-12, msg=f"d{name}, seed {seed}")


@pytest.mark.usefixtures("cpu_xformers")
def test_wan_dit_with_xformers_attention_matches_the_stock_model() -> None:
    from test_kernels import _tiny_wan  # the Triton kernels' DiT test model

    seed = _seed()
    stock = _tiny_wan()
    swapped = copy.deepcopy(stock)
    use_kernels(swapped, KernelChoice(attention="xformers"))
    latents = torch.randn(1, 4, 2, 8, 6, dtype=torch.float64)
    t, context = torch.tensor([300.0]), torch.randn(1, 5, 32, dtype=torch.float64)
    outs = []
    for model in (stock, swapped):
        out = model(hidden_states=latents, timestep=t, encoder_hidden_states=context, return_dict=False)[0]
        out.square().mean().backward()
        outs.append(out)
    # float64 throughout; the stock model's float32 norms and rotary tables are the same in both
    # models (only the attention core differs), so outputs and gradients agree to float64 rounding.
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-10, atol=1e-12, msg=f"seed {seed}")
    for (name, a), b in zip(stock.named_parameters(), swapped.parameters(), strict=True):
        assert b.grad is not None and torch.isfinite(b.grad).all(), name
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-9, atol=1e-12, msg=f"{name}, seed {seed}")


def test_xformers_refusals_name_the_value() -> None:
    # the config path refuses it before any worker starts: the runtime's ranks are CPU processes
    with pytest.raises(ValueError, match=r"model.kernels.attention=xformers: xFormers' attention runs on CUDA only"):
        resolve(KernelChoice(attention="xformers"), "cpu")
    assert select_backend("xformers").name == AttentionBackend.XFORMERS
    # xFormers' own dispatch (no CPU operator): a ValueError naming dtype and device, with its reasons
    q = torch.randn(1, 2, 8, 16)
    with pytest.raises(ValueError, match=r"(?s)'xformers' has no kernel for torch.float32 .* on cpu .*device=cpu"):
        local_attention(q, q, q, impl=select_backend("xformers"))
