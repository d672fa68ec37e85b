"""Point-to-point transport of edge tensors between ranks, with a shape / dtype handshake.

A message is a list of tensors. The sender first sends a fixed-size int64 header (count, then per
tensor: dtype code, ndim, dims), then each tensor; the receiver allocates from the header and
checks it against what its plan expects. Messages of one edge bundle use one tag, so two edges
between the same pair of ranks never interleave.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

HEADER_LEN = 128
_DTYPES = [
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.float64,
    torch.int64,
    torch.int32,
    torch.bool,
    torch.uint8,
]


def _header(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    fields = [len(tensors)]
    for t in tensors:
        fields += [_DTYPES.index(t.dtype), t.dim(), *t.shape]
    if len(fields) > HEADER_LEN:
        raise ValueError(f"message header of {len(fields)} fields exceeds {HEADER_LEN}")
    return torch.tensor(fields + [0] * (HEADER_LEN - len(fields)), dtype=torch.int64)


def parse_header(header: torch.Tensor) -> list[tuple[torch.dtype, tuple[int, ...]]]:
    h = header.tolist()
    out, i = [], 1
    for _ in range(h[0]):
        dtype, ndim = _DTYPES[h[i]], h[i + 1]
        out.append((dtype, tuple(h[i + 2 : i + 2 + ndim])))
        i += 2 + ndim
    return out


def isend_tensors(
    tensors: Sequence[torch.Tensor], dst: int, tag: int, group: dist.ProcessGroup | None = None
) -> list[dist.Work]:
    """Start sending ``tensors`` to global rank ``dst``; the caller keeps them alive until the works finish."""
    # Empty tensors travel in the header only (gloo cannot send zero bytes).
    payload = [_header(tensors)] + [t.detach().contiguous() for t in tensors if t.numel()]
    works = []
    for t in payload:
        work = dist.isend(t, dst=dst, group=group, tag=tag)
        assert work is not None
        works.append(work)
    return works


def recv_tensors(src: int, tag: int, expected: int, group: dist.ProcessGroup | None = None) -> list[torch.Tensor]:
    """Receive a message of ``expected`` tensors from global rank ``src`` (blocking, with the group's timeout)."""
    header = torch.empty(HEADER_LEN, dtype=torch.int64)
    dist.recv(header, src=src, group=group, tag=tag)
    specs = parse_header(header)
    if len(specs) != expected:
        raise RuntimeError(f"handshake from rank {src} (tag {tag}): {len(specs)} tensors, expected {expected}")
    out = []
    for dtype, shape in specs:
        t = torch.empty(shape, dtype=dtype)
        if t.numel():
            dist.recv(t, src=src, group=group, tag=tag)
        out.append(t)
    return out


def nbytes(tensors: Sequence[torch.Tensor]) -> int:
    """Payload bytes of a message."""
    return sum(t.numel() * t.element_size() for t in tensors)
