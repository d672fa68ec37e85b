"""Which implementation each hot-path kernel uses: a value, passed to what runs the kernels.

Every kernel has the plain PyTorch path (``torch``, the default: kernels are opt-in) and a Triton
one (``triton``); attention may also name ``xformers`` where it is installed (CUDA only). ``auto`` takes Triton
on CUDA and PyTorch elsewhere. A run resolves its config (``model.kernels``) with :func:`resolve`
before any worker starts (an unavailable choice is an error naming the key); the executor and
``mmpipe generate`` receive the resolved :class:`KernelChoice` and hand it to the stages
(``Stage.use_kernels``, ``Stage.parallelize_sequence``). No module keeps a choice of its own.
"""

from __future__ import annotations

import dataclasses
import importlib.util

import torch

from mmpipe.kernels._triton import AVAILABLE, INTERPRETED

KERNELS = {
    "attention": ("torch", "triton", "xformers"),
    "norm_modulate": ("torch", "triton"),
    "rope": ("torch", "triton"),
}


@dataclasses.dataclass(frozen=True)
class KernelChoice:
    """One backend name per kernel (``torch``, ``triton``, ``xformers`` for attention, or ``auto``)."""

    attention: str = "torch"
    norm_modulate: str = "torch"
    rope: str = "torch"


def resolve(choice: KernelChoice, device: torch.device | str = "cpu", *, prefix: str = "model.kernels") -> KernelChoice:
    """``choice`` with ``auto`` decided for ``device``; raises ``ValueError`` naming the key of a
    backend that is unknown or cannot run here."""
    device = torch.device(device)
    out = {}
    for kernel, names in KERNELS.items():
        name = getattr(choice, kernel)
        if name == "auto":
            name = "triton" if AVAILABLE and device.type == "cuda" else "torch"
        if name not in names:
            raise ValueError(f"{prefix}.{kernel}={name!r}: choose from {[*names, 'auto']}")
        if name == "triton" and not AVAILABLE:
            raise ValueError(f"{prefix}.{kernel}=triton: Triton is not installed (pip install 'mmpipe[triton]')")
        if name == "triton" and device.type != "cuda" and not INTERPRETED:
            raise ValueError(f"{prefix}.{kernel}=triton: no CUDA device; set TRITON_INTERPRET=1 to run it interpreted")
        if name == "xformers" and importlib.util.find_spec("xformers") is None:
            raise ValueError(f"{prefix}.{kernel}=xformers: xformers is not installed")
        if name == "xformers" and device.type != "cuda":
            raise ValueError(f"{prefix}.{kernel}=xformers: xFormers' attention runs on CUDA only, not on {device.type}")
        out[kernel] = name
    return KernelChoice(**out)
