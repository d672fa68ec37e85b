"""The trainable stages' optimizer: fused AdamW where the parameters allow it, stepping as the
per-parameter loop does."""

from __future__ import annotations

import pytest
import torch

from mmpipe.runtime.optim import adamw, fused_adamw_supported


def test_fused_where_supported() -> None:
    assert fused_adamw_supported([torch.zeros(3), torch.zeros(2, 2, dtype=torch.bfloat16)])
    assert not fused_adamw_supported([])
    assert not fused_adamw_supported([torch.zeros(3, device="meta")])
    assert not fused_adamw_supported([torch.zeros(3), torch.zeros(3, dtype=torch.int64)])
    assert adamw([torch.nn.Parameter(torch.zeros(3))], lr=1e-3, weight_decay=0.0).defaults["fused"]
    assert not adamw([torch.nn.Parameter(torch.zeros(3, device="meta"))], lr=1e-3, weight_decay=0.0).defaults["fused"]


@pytest.mark.parametrize("weight_decay", [0.0, 0.01])
def test_fused_steps_as_the_loop_does(weight_decay: float) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 4))
    twin = [torch.nn.Parameter(p.detach().clone()) for p in model.parameters()]
    fused = adamw(list(model.parameters()), lr=3e-3, weight_decay=weight_decay)
    loop = torch.optim.AdamW(twin, lr=3e-3, weight_decay=weight_decay, foreach=False)
    assert fused.defaults["fused"]
    for step in range(20):
        x = torch.randn(8, 16, generator=torch.Generator().manual_seed(step))
        for params, opt in ((list(model.parameters()), fused), (twin, loop)):
            grads = torch.autograd.grad(
                torch.func.functional_call(model, dict(zip(dict(model.named_parameters()), params, strict=True)), (x,))
                .square()
                .mean(),
                params,
            )
            for p, g in zip(params, grads, strict=True):
                p.grad = g
            opt.step()
    for p, q in zip(model.parameters(), twin, strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
