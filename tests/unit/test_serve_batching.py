"""Row-exact batching: every row of a batched DiT forward equals the row computed alone, bitwise, at
the thread counts a server runs with."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from diffusers import WanTransformer3DModel

from mmpipe.serve.batching import make_row_exact

# (batch, latent frames x height x width): the serving shape of test_engine.py, and one token per
# sample, where the batched cross-attention and its projections differ from the row alone at 2
# and 4 threads unless the rows run alone (measured: the old wrapper failed there).
SHAPES = [(6, (3, 8, 8)), (8, (1, 2, 2))]


@pytest.fixture(params=[1, 2, 4], ids=lambda n: f"threads{n}")
def threads(request: pytest.FixtureRequest) -> Iterator[int]:
    """torch's intra-op thread count for the test, restored afterwards."""
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    try:
        yield request.param
    finally:
        torch.set_num_threads(before)


def odd_width_dit() -> WanTransformer3DModel:
    """A Wan DiT whose widths (18, 72) are no multiple of a vector register's floats: each row's
    activations end in a scalar tail when alone but not inside a batch (measured: the old wrapper
    failed here at every thread count)."""
    torch.manual_seed(0)
    return WanTransformer3DModel(
        patch_size=(1, 2, 2),
        num_attention_heads=3,
        attention_head_dim=6,
        in_channels=16,
        out_channels=16,
        text_dim=32,
        freq_dim=64,
        ffn_dim=72,
        num_layers=2,
        cross_attn_norm=True,
        qk_norm="rms_norm_across_heads",
        rope_max_seq_len=64,
    ).eval()


def rows_alone(dit: torch.nn.Module, x: torch.Tensor, ts: torch.Tensor, ctx: torch.Tensor) -> list[torch.Tensor]:
    with torch.no_grad():
        return [dit(x[i : i + 1].clone(), ts[i : i + 1].clone(), ctx[i : i + 1].clone())[0] for i in range(len(x))]


def inputs(batch: int, latent: tuple[int, int, int], text_dim: int) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(batch, 16, *latent, generator=gen)
    ctx = torch.randn(batch, 16, text_dim, generator=gen)
    ts = torch.linspace(999.0, 1.0, batch).round()  # each row at its own timestep
    ts[3] = ts[2]
    return x, ts, ctx


def assert_rows_exact(dit: torch.nn.Module, batch: int, latent: tuple[int, int, int]) -> None:
    x, ts, ctx = inputs(batch, latent, dit.config.text_dim)
    alone = rows_alone(dit, x, ts, ctx)  # the same module: a copy of its weights may be aligned otherwise
    state = {k: v.clone() for k, v in dit.state_dict().items()}
    make_row_exact(dit)
    with torch.no_grad():
        batched = dit(hidden_states=x, timestep=ts, encoder_hidden_states=ctx)[0]
        tupled = dit(x, ts, ctx, return_dict=False)[0]
    again = rows_alone(dit, x, ts, ctx)
    assert batched.shape == x.shape and torch.equal(tupled, batched)
    for i in range(batch):
        assert torch.equal(batched[i : i + 1], alone[i]), f"row {i} of the batch differs from the row alone"
        assert torch.equal(again[i], alone[i]), "wrapping changed the batch-of-one forward"
    assert dit.state_dict().keys() == state.keys() and all(torch.equal(dit.state_dict()[k], state[k]) for k in state)


@pytest.mark.parametrize(("batch", "latent"), SHAPES, ids=["serving", "one_token"])
def test_batched_dit_rows_equal_rows_alone(
    tiny_wan_dir: Path, threads: int, batch: int, latent: tuple[int, int, int]
) -> None:
    dit = WanTransformer3DModel.from_pretrained(tiny_wan_dir / "transformer").eval()
    assert_rows_exact(dit, batch, latent)


def test_odd_width_dit_rows_equal_rows_alone(threads: int) -> None:
    assert_rows_exact(odd_width_dit(), 6, (3, 6, 6))


def test_inputs_are_fresh_aligned_copies_and_wrapping_is_idempotent() -> None:
    seen: list[torch.Tensor] = []

    class Probe(torch.nn.Module):
        def forward(self, x: torch.Tensor, shared: torch.Tensor, flag: bool = True) -> tuple[torch.Tensor, ...]:
            seen.append(x)
            return x * 2, shared.expand(len(x), -1)

    probe = Probe()
    make_row_exact(probe)
    make_row_exact(probe)  # a second call wraps nothing more
    base = torch.arange(40.0).reshape(5, 8)
    shared = torch.ones(1, 3)  # no batch dimension: given whole to each sample
    doubled, expanded = probe(base[1:4], shared)  # rows at an offset of 32 bytes: not aligned
    assert torch.equal(doubled, base[1:4] * 2) and expanded.shape == (3, 3)
    assert len(seen) == 3 and all(t.shape == (1, 8) for t in seen)
    assert all(t.is_contiguous() and t.data_ptr() % 64 == 0 for t in seen)
    seen.clear()
    probe(base[1:2], shared)  # a batch of one at an unaligned offset is copied as well
    assert seen[0].data_ptr() % 64 == 0 and torch.equal(seen[0], base[1:2])
    seen.clear()
    fresh = torch.randn(1, 8)
    probe(fresh, shared)  # an aligned batch of one goes to the forward untouched
    assert seen[0] is fresh
