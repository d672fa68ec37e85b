"""Whether Triton kernels can run here, and how.

On a machine without an NVIDIA GPU the kernels run in Triton's interpreter (``TRITON_INTERPRET=1``,
numpy on the CPU: slow, for tests and tiny shapes only). The switch has to be set before ``triton``
is first imported (its own library functions are decorated then); ``mmpipe/__init__.py`` sets it.
"""

from __future__ import annotations

import importlib.util
import os

import torch

AVAILABLE = importlib.util.find_spec("triton") is not None
"""Whether the ``triton`` package is installed (``pip install mmpipe[triton]``)."""

INTERPRETED = False
"""Kernels run in Triton's CPU interpreter (no GPU): correct but slow."""
if AVAILABLE:
    import triton

    INTERPRETED = bool(triton.knobs.runtime.interpret)


def can_run(*tensors: torch.Tensor) -> bool:
    """Whether the Triton kernels can take these tensors: CUDA tensors with Triton installed, or CPU
    tensors under the interpreter."""
    if not AVAILABLE:
        return False
    return all(t.is_cuda for t in tensors) or (INTERPRETED and all(t.device.type == "cpu" for t in tensors))


def row_warps(block: int) -> int:
    """Warps for a program that holds ``block`` elements of each of its vectors in registers (a
    normalised row, a token's heads): Liger-Kernel's ``calculate_settings`` rule, which keeps a
    thread at no more than 32 elements of a vector up to ``block`` 16384. At Triton's default of
    four warps a 5120-channel row (``block`` 8192) costs the gated norm's backward all 255 registers
    a thread may have; at sixteen, about 100 (``python -m mmpipe.kernels.aot`` prints them)."""
    if block >= 32768:
        return 32
    if block >= 8192:
        return 16
    if block >= 2048:
        return 8
    return 4


POISON_ENV = "MMPIPE_KERNEL_POISON"


def poisoning() -> bool:
    """Whether the kernels' output buffers start NaN-filled, so that an element a kernel fails to write
    shows up as NaN: under the interpreter (the CPU tests), or with ``MMPIPE_KERNEL_POISON=1`` (the
    test suite sets it for the CUDA tests too). Off on a GPU otherwise: filling costs a full write of
    every output (at 64k tokens x 5120 channels, a fifth of the fused norm's forward and backward)."""
    return INTERPRETED or os.environ.get(POISON_ENV) == "1"


def output(shape: torch.Size | tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A kernel's output buffer: uninitialised, or NaN-filled while :func:`poisoning`."""
    if poisoning():
        return torch.full(shape, float("nan"), dtype=dtype, device=device)
    return torch.empty(shape, dtype=dtype, device=device)


def output_like(t: torch.Tensor) -> torch.Tensor:
    """:func:`output` of ``t``'s shape, dtype and device."""
    return output(t.shape, t.dtype, t.device)
