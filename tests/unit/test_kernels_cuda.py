"""The compiled (CUDA) Triton kernels of the norm + modulation and the 3-D rotary embedding against
their PyTorch references; the interpreter tests (``test_kernels.py``) check the same arithmetic on the
CPU, these the code the GPU compiler makes of it (the rotary kernel's reshape / split / join of channel
pairs and its vector loads, the norm's multi-row backward). Skipped without CUDA (run by
``benchmarks/gpu_checks.sh``); outputs start NaN-filled (``MMPIPE_KERNEL_POISON``, set by conftest).

Tolerances: float64 as in the interpreter tests (a few ulps, reassociated sums); bf16 rounds the
float32 result once, so one bf16 ulp (2^-7 relative) of values of order 1-10.
"""

from __future__ import annotations

import random

import pytest
import torch

from mmpipe.kernels import _triton
from mmpipe.kernels.norm import norm_modulate, norm_modulate_reference
from mmpipe.kernels.rope import rope3d, rope3d_reference

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="the compiled kernels need CUDA")

F64 = {"rtol": 1e-12, "atol": 1e-12}
BF16 = {"rtol": 2**-7, "atol": 2e-2}


def test_outputs_are_poisoned_here() -> None:
    assert _triton.poisoning(), "conftest sets MMPIPE_KERNEL_POISON=1: an unwritten element must show"


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape", [(2, 13, 40, 128), (1, 47, 12, 96), (2, 60, 3, 64)], ids=str)
def test_rope3d_on_cuda_matches_the_reference(shape: tuple[int, int, int, int], dtype: torch.dtype) -> None:
    seed = random.randrange(2**31)
    torch.manual_seed(seed)
    grid = (3, 4, 5)
    x = torch.randn(*shape, device="cuda", dtype=dtype, requires_grad=True)
    dy = torch.randn_like(x)
    out, ref = rope3d(x, grid), rope3d_reference(x, grid)
    tol = F64 if dtype == torch.float64 else BF16
    torch.testing.assert_close(out, ref, **tol, msg=f"seed {seed}")
    (got,), (want,) = torch.autograd.grad(out, x, dy), torch.autograd.grad(ref, x, dy)
    torch.testing.assert_close(got, want, **tol, msg=f"seed {seed}")


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16], ids=str)
def test_norm_modulate_on_cuda_matches_the_reference(dtype: torch.dtype) -> None:
    seed = random.randrange(2**31)
    torch.manual_seed(seed)
    x = torch.randn(2, 37, 320, device="cuda", dtype=dtype, requires_grad=True)
    mod = [torch.randn(2, 1, 320, device="cuda", dtype=torch.float64 if dtype == torch.float64 else torch.float32,
                       requires_grad=True) for _ in range(2)]  # fmt: skip
    dy = torch.randn_like(x)
    out, ref = norm_modulate(x, *mod), norm_modulate_reference(x, *mod)
    tol = F64 if dtype == torch.float64 else BF16
    torch.testing.assert_close(out, ref, **tol, msg=f"seed {seed}")
    got, want = torch.autograd.grad(out, (x, *mod), dy), torch.autograd.grad(ref, (x, *mod), dy)
    for name, g, w in zip(("dx", "dshift", "dscale"), got, want, strict=True):
        # the modulation gradients sum 37 rows of bf16 products: float32 sums in another order
        torch.testing.assert_close(g, w, **(tol if name == "dx" or dtype == torch.float64 else {"rtol": 1e-2, "atol": 1e-1}),
                                   msg=f"{name}, seed {seed}")  # fmt: skip
