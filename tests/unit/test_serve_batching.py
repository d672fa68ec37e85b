"""Row-exact batching: every row of a batched DiT forward equals the row computed alone, bitwise."""

from __future__ import annotations

from pathlib import Path

import torch
from diffusers import WanTransformer3DModel

from mmpipe.serve.batching import make_row_exact


def test_batched_dit_rows_equal_rows_alone(tiny_wan_dir: Path) -> None:
    dit = WanTransformer3DModel.from_pretrained(tiny_wan_dir / "transformer").eval()
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(6, 16, 3, 8, 8, generator=gen)
    ctx = torch.randn(6, 16, dit.config.text_dim, generator=gen)
    ts = torch.tensor([999.0, 951.0, 500.0, 500.0, 17.0, 1.0])  # each row at its own timestep
    with torch.no_grad():
        alone = [
            dit(hidden_states=x[i : i + 1], timestep=ts[i : i + 1], encoder_hidden_states=ctx[i : i + 1])[0]
            for i in range(6)
        ]
        state = {k: v.clone() for k, v in dit.state_dict().items()}
        wrapped = make_row_exact(dit)
        assert wrapped > 0
        batched = dit(hidden_states=x, timestep=ts, encoder_hidden_states=ctx)[0]
        again = [
            dit(hidden_states=x[i : i + 1], timestep=ts[i : i + 1], encoder_hidden_states=ctx[i : i + 1])[0]
            for i in range(6)
        ]
    for i in range(6):
        assert torch.equal(batched[i : i + 1], alone[i]), f"row {i} of the batch differs from the row alone"
        assert torch.equal(again[i], alone[i]), "wrapping changed the batch-of-one forward"
    # The parameters are shared, not copied: the wrapped module's weights are the same tensors.
    names = {k.replace(".inner", ""): v for k, v in dit.state_dict().items()}
    assert names.keys() == state.keys() and all(torch.equal(names[k], state[k]) for k in state)
