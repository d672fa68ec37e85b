"""The fused norm + modulation and 3-D rotary kernels against their PyTorch references, under
Triton's CPU interpreter (``mmpipe.kernels._triton`` turns it on when there is no GPU), and the Wan
DiT with the kernels swapped in against the stock one.

Inputs are fresh random draws every run; the seed is in every assertion message. The kernels write
into NaN-filled outputs, so an element a kernel fails to write fails the comparison (``assert_close``
never passes NaN).
"""

from __future__ import annotations

import copy

import pytest
import torch
from diffusers import WanTransformer3DModel
from diffusers.models.transformers.transformer_wan import WanRotaryPosEmbed

from mmpipe.kernels import _triton, registry
from mmpipe.kernels.norm import (
    gated_norm_modulate,
    gated_norm_modulate_reference,
    norm_modulate,
    norm_modulate_reference,
)
from mmpipe.kernels.registry import KernelChoice, resolve
from mmpipe.kernels.rope import rope3d, rope3d_reference
from mmpipe.stages.wan_kernels import use_kernels

# float64 kernel vs float64 reference: the same arithmetic reassociated (row sums in another
# order), so differences are a few ulps of values of order 1-10; 1e-12 leaves 3 orders of margin.
F64 = {"rtol": 1e-12, "atol": 1e-12}


def _seed() -> int:
    seed = int(torch.randint(0, 2**31 - 1, ()).item())
    torch.manual_seed(seed)
    return seed


def test_the_interpreter_runs_the_kernels_here() -> None:
    assert _triton.AVAILABLE, "triton must be installed for these tests (pip install 'mmpipe[triton]')"
    assert _triton.INTERPRETED or torch.cuda.is_available()


@pytest.mark.parametrize("rms", [False, True], ids=["layernorm", "rmsnorm"])
@pytest.mark.parametrize("per_token", [False, True], ids=["per-sample", "per-token"])
def test_norm_modulate_forward_and_backward_match_the_reference(rms: bool, per_token: bool) -> None:
    seed = _seed()
    B, S, D = 2, 7, 40  # D not a power of two: the kernel's masked tail
    x = (3 * torch.randn(B, S, D, dtype=torch.float64) + 1).requires_grad_()
    mod_shape = (B, S if per_token else 1, D)
    shift = torch.randn(mod_shape, dtype=torch.float64, requires_grad=True)
    scale = torch.randn(mod_shape, dtype=torch.float64, requires_grad=True)
    dy = torch.randn(B, S, D, dtype=torch.float64)
    out = norm_modulate(x, shift, scale, rms=rms, eps=1e-6)
    ref = norm_modulate_reference(x, shift, scale, rms=rms, eps=1e-6)
    torch.testing.assert_close(out, ref, **F64, msg=f"seed {seed}")
    got = torch.autograd.grad(out, (x, shift, scale), dy)
    want = torch.autograd.grad(ref, (x, shift, scale), dy)
    for name, g, w in zip(("dx", "dshift", "dscale"), got, want, strict=True):
        torch.testing.assert_close(g, w, **F64, msg=f"{name}, seed {seed}")


def test_norm_modulate_in_bf16_returns_bf16_computed_in_float32() -> None:
    seed = _seed()
    x = torch.randn(1, 5, 64, dtype=torch.bfloat16)
    shift, scale = torch.randn(1, 1, 64), torch.randn(1, 1, 64)  # Wan's modulation is float32
    out = norm_modulate(x, shift, scale)
    assert out.dtype == torch.bfloat16
    # both compute in float32 and round once to bf16: at most one bf16 ulp apart (2^-7 relative)
    torch.testing.assert_close(out, norm_modulate_reference(x, shift, scale), rtol=2**-7, atol=1e-2, msg=f"seed {seed}")


def test_norm_modulate_rejects_mismatched_modulation() -> None:
    x = torch.randn(2, 3, 8, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"scale must be \(B, 1, D\) or \(B, S, D\)"):
        norm_modulate(x, torch.zeros(2, 1, 8, dtype=torch.float64), torch.zeros(1, 1, 8, dtype=torch.float64))


def test_kernel_outputs_are_poisoned_in_tests_only(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_triton, "INTERPRETED", False)  # as on a GPU
    monkeypatch.delenv(_triton.POISON_ENV, raising=False)
    assert not _triton.poisoning()  # a user's run pays no NaN fill
    monkeypatch.setenv(_triton.POISON_ENV, "1")  # what tests/conftest.py sets
    assert _triton.poisoning() and _triton.output((3,), torch.float32, torch.device("cpu")).isnan().all()
    monkeypatch.setattr(_triton, "INTERPRETED", True)
    monkeypatch.setenv(_triton.POISON_ENV, "0")
    assert _triton.poisoning()  # interpreted: always


# (batch, tokens, heads, head dim): the tiles of the kernel (a few tokens x 1-16 heads) leave a ragged
# last token tile (2 x 13 tokens), several head tiles (12 heads in 4s, 40 in 8s), and a head dim
# that is not a power of two (96: its channel run is masked)
ROPE_SHAPES = [(2, 60, 3, 64), (2, 60, 3, 128), (2, 13, 40, 64), (1, 47, 12, 96)]


@pytest.mark.parametrize("shape", ROPE_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_rope3d_forward_and_backward_match_the_reference(shape: tuple[int, int, int, int]) -> None:
    seed = _seed()
    grid = (3, 4, 5)
    x = torch.randn(*shape, dtype=torch.float64, requires_grad=True)
    dy = torch.randn_like(x)
    out, ref = rope3d(x, grid), rope3d_reference(x, grid)
    torch.testing.assert_close(out, ref, **F64, msg=f"seed {seed}")
    (got,), (want,) = torch.autograd.grad(out, x, dy), torch.autograd.grad(ref, x, dy)
    torch.testing.assert_close(got, want, **F64, msg=f"seed {seed}")
    # a rotation: norms of channel pairs are kept, and the backward is the inverse rotation
    torch.testing.assert_close(got.norm(), dy.norm(), **F64)


def test_rope3d_equals_diffusers_wan_rotary_and_a_shard_takes_its_offset() -> None:
    seed = _seed()
    head_dim, grid = 64, (3, 4, 5)
    rope = WanRotaryPosEmbed(head_dim, (1, 2, 2), max_seq_len=1024)
    cos, sin = rope(torch.zeros(1, 16, grid[0], 2 * grid[1], 2 * grid[2]))
    x = torch.randn(2, 60, 3, head_dim)
    x1, x2 = x.unflatten(-1, (-1, 2)).unbind(-1)
    stock = torch.stack([x1 * cos[..., 0::2] - x2 * sin[..., 1::2], x1 * sin[..., 1::2] + x2 * cos[..., 0::2]], -1)
    # same float64 angles rounded to float32 cosines and sines, same float32 products
    torch.testing.assert_close(rope3d(x, grid), stock.flatten(-2), rtol=0, atol=0, msg=f"seed {seed}")
    part = rope3d(x[:, 20:40], grid, token_offset=20)  # frame 1 on its own (a sequence-parallel rank)
    torch.testing.assert_close(part, stock.flatten(-2)[:, 20:40], rtol=0, atol=0)
    with pytest.raises(ValueError, match=r"tokens 50..70 exceed the grid \(3, 4, 5\) \(60\)"):
        rope3d(x[:, :20], grid, token_offset=50)


def test_registry_resolves_and_refuses_by_key(monkeypatch: pytest.MonkeyPatch) -> None:
    assert resolve(KernelChoice(rope="auto")).rope == "torch"  # auto takes Triton for CUDA devices only
    assert resolve(KernelChoice(rope="auto"), "cuda").rope == "triton"
    monkeypatch.setattr(registry, "INTERPRETED", True)
    assert resolve(KernelChoice(norm_modulate="triton")).norm_modulate == "triton"  # interpreted on the CPU
    monkeypatch.setattr(registry, "INTERPRETED", False)
    with pytest.raises(ValueError, match=r"model.kernels.norm_modulate=triton: no CUDA device; set TRITON_INTERPRET=1"):
        resolve(KernelChoice(norm_modulate="triton"))
    with pytest.raises(ValueError, match=r"model.kernels.rope='cuda': choose from"):
        resolve(KernelChoice(rope="cuda"))
    with pytest.raises(ValueError, match=r"model.kernels.norm_modulate='xformers'"):
        resolve(KernelChoice(norm_modulate="xformers"))


def _tiny_wan() -> WanTransformer3DModel:
    return WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=4, attention_head_dim=16, in_channels=4, out_channels=4,
        text_dim=32, freq_dim=32, ffn_dim=64, num_layers=2, rope_max_seq_len=64,
    ).double()  # fmt: skip


def test_wan_dit_with_the_kernels_swapped_in_matches_the_stock_model() -> None:
    seed = _seed()
    stock = _tiny_wan()
    fused = copy.deepcopy(stock)
    use_kernels(fused, KernelChoice(attention="triton", norm_modulate="triton", rope="triton"))
    latents = torch.randn(2, 4, 3, 8, 10, dtype=torch.float64)
    t, context = torch.tensor([100.0, 700.0]), torch.randn(2, 6, 32, dtype=torch.float64)
    outs = []
    for model in (stock, fused):
        out = model(hidden_states=latents, timestep=t, encoder_hidden_states=context, return_dict=False)[0]
        out.square().mean().backward()
        outs.append(out)
    # Even in a float64 model, diffusers normalises in float32 (`norm1(x.float())`) and keeps its
    # rotary tables in float32, where the kernels stay in float64: the stock model carries float32
    # rounding (observed ~1.5e-7 on outputs of order 1). 1e-6 is ten times that; a kernel that
    # drops the modulation or rotates a wrong pair is off by O(1).
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-6, atol=1e-6, msg=f"seed {seed}")
    for (name, a), b in zip(stock.named_parameters(), fused.parameters(), strict=True):
        assert a.grad is not None and b.grad is not None, name
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-5, atol=1e-6, msg=f"{name}, seed {seed}")


def test_custom_ops_pass_opcheck_and_compile() -> None:
    """Schemas, fake (meta) implementations and autograd registrations are consistent
    (``torch.library.opcheck``), and the ops trace whole under ``torch.compile``."""
    x = torch.randn(2, 3, 16, dtype=torch.float64, requires_grad=True)
    mod = [torch.randn(2, 1, 16, dtype=torch.float64, requires_grad=True) for _ in range(2)]
    torch.library.opcheck(torch.ops.mmpipe.norm_modulate_fwd.default, (x, *mod, False, 1e-6))
    y = torch.randn_like(x, requires_grad=True)
    gate = torch.randn_like(mod[0], requires_grad=True)
    torch.library.opcheck(torch.ops.mmpipe.gated_norm_modulate_fwd.default, (x, y, gate, *mod, True, 1e-6))
    q = torch.randn(1, 6, 2, 16, dtype=torch.float64, requires_grad=True)
    torch.library.opcheck(torch.ops.mmpipe.rope3d.default, (q, 2, 3, 0, 10000.0, False))

    def block(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
        return norm_modulate(x, shift, scale).sum() + rope3d(q, (1, 2, 3)).square().sum()

    compiled = torch.compile(block, backend="aot_eager", fullgraph=True)
    got = torch.autograd.grad(compiled(x, *mod, q), (x, *mod, q))
    want = torch.autograd.grad(block(x, *mod, q), (x, *mod, q))
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, **F64)


@pytest.mark.parametrize("S", [1, 2, 3, 4, 10])
def test_backward_partial_sums_cover_every_row(S: int) -> None:
    """A backward program takes 3 rows here (``_rows_per_program`` interpreted) and sums the per-sample
    modulation gradients over them: sequences shorter than, equal to and not a multiple of that, over
    3 samples, for both kernels. A row left out or counted twice, or a partial never written (its
    buffer is NaN-poisoned), fails against the reference."""
    seed = _seed()
    B, D = 3, 24
    x, y = (torch.randn(B, S, D, dtype=torch.float64, requires_grad=True) for _ in range(2))
    gate, shift, scale = (torch.randn(B, 1, D, dtype=torch.float64, requires_grad=True) for _ in range(3))
    dh, dout = torch.randn(B, S, D, dtype=torch.float64), torch.randn(B, S, D, dtype=torch.float64)
    got = torch.autograd.grad(norm_modulate(x, shift, scale), (x, shift, scale), dout)
    want = torch.autograd.grad(norm_modulate_reference(x, shift, scale), (x, shift, scale), dout)
    for name, g, w in zip(("dx", "dshift", "dscale"), got, want, strict=True):
        torch.testing.assert_close(g, w, **F64, msg=f"norm {name}, S {S}, seed {seed}")
    ins = (x, y, gate, shift, scale)
    got = torch.autograd.grad(gated_norm_modulate(*ins), ins, (dh, dout))
    want = torch.autograd.grad(gated_norm_modulate_reference(*ins), ins, (dh, dout))
    for name, g, w in zip(("dx", "dy", "dgate", "dshift", "dscale"), got, want, strict=True):
        torch.testing.assert_close(g, w, **F64, msg=f"gated {name}, S {S}, seed {seed}")


@pytest.mark.parametrize("per_token", [False, True], ids=["per-sample", "per-token"])
def test_gated_residual_norm_modulate_matches_the_reference(per_token: bool) -> None:
    """``h = x + y * gate`` and ``norm(h) * (1 + scale) + shift`` fused: both outputs and all five
    input gradients (the residual stream's gradient from later uses plus the norm's)."""
    seed = _seed()
    B, S, D = 2, 6, 40
    x, y = (torch.randn(B, S, D, dtype=torch.float64, requires_grad=True) for _ in range(2))
    mods = [torch.randn(B, S if per_token else 1, D, dtype=torch.float64, requires_grad=True) for _ in range(3)]
    dh, dout = torch.randn(B, S, D, dtype=torch.float64), torch.randn(B, S, D, dtype=torch.float64)
    got = gated_norm_modulate(x, y, *mods)
    want = gated_norm_modulate_reference(x, y, *mods)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, **F64, msg=f"seed {seed}")
    grads = torch.autograd.grad(got, (x, y, *mods), (dh, dout))
    ref = torch.autograd.grad(want, (x, y, *mods), (dh, dout))
    for name, g, w in zip(("dx", "dy", "dgate", "dshift", "dscale"), grads, ref, strict=True):
        torch.testing.assert_close(g, w, **F64, msg=f"{name}, seed {seed}")
