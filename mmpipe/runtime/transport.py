"""Point-to-point transport of edge tensors between ranks, with a shape / dtype handshake.

A message is a list of tensors. The sender first sends a fixed-size int64 header (count, then per
tensor: dtype code, ndim, dims), then each tensor; the receiver allocates from the header and
checks it against what its plan expects. Messages of one edge bundle use one tag, so two edges
between the same pair of ranks never interleave.

The header is always a CPU tensor; the payload travels on the ``wire`` device: the rank's GPU
under ``cpu:gloo,cuda:nccl`` (headers go through gloo, payloads device to device through NCCL),
host memory under gloo (a CUDA tensor is copied to the host before it is sent and back to the
rank's device after it arrives: how ranks that share one GPU exchange tensors). NCCL ignores tags
and matches a pair's messages in the order they were posted, so under NCCL the executor checks
that every pair of ranks sends and receives its bundles in the same order (:func:`check_pair_order`).
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


def isend_message(
    tensors: Sequence[torch.Tensor],
    dst: int,
    tag: int,
    group: dist.ProcessGroup | None = None,
    *,
    wire: torch.device | None = None,
) -> tuple[list[dist.Work], list[torch.Tensor]]:
    """Start sending ``tensors`` to global rank ``dst``, the payload on ``wire`` (default: where each
    tensor is); returns the works and the tensors they read, which the caller keeps alive until the
    works finish."""
    # Empty tensors travel in the header only (gloo cannot send zero bytes).
    payload = [_header(tensors)] + [_on(t.detach(), wire).contiguous() for t in tensors if t.numel()]
    works = []
    for t in payload:
        work = dist.isend(t, dst=dst, group=group, tag=tag)
        assert work is not None
        works.append(work)
    return works, payload


def isend_tensors(
    tensors: Sequence[torch.Tensor], dst: int, tag: int, group: dist.ProcessGroup | None = None
) -> list[dist.Work]:
    """Start sending CPU ``tensors`` to global rank ``dst``; the caller keeps them alive until the works finish."""
    return isend_message(tensors, dst, tag, group)[0]


def recv_tensors(
    src: int,
    tag: int,
    expected: int,
    group: dist.ProcessGroup | None = None,
    *,
    wire: torch.device | None = None,
    device: torch.device | None = None,
) -> list[torch.Tensor]:
    """Receive a message of ``expected`` tensors from global rank ``src`` (blocking, with the group's
    timeout): the payload arrives on ``wire`` (default CPU) and is returned on ``device`` (default: ``wire``)."""
    header = torch.empty(HEADER_LEN, dtype=torch.int64)
    dist.recv(header, src=src, group=group, tag=tag)
    specs = parse_header(header)
    if len(specs) != expected:
        raise RuntimeError(f"handshake from rank {src} (tag {tag}): {len(specs)} tensors, expected {expected}")
    out = []
    for dtype, shape in specs:
        t = torch.empty(shape, dtype=dtype, device=wire)
        if t.numel():
            dist.recv(t, src=src, group=group, tag=tag)
        out.append(_on(t, device))
    return out


def _on(t: torch.Tensor, device: torch.device | None) -> torch.Tensor:
    return t if device is None else t.to(device)


def nbytes(tensors: Sequence[torch.Tensor]) -> int:
    """Payload bytes of a message."""
    return sum(t.numel() * t.element_size() for t in tensors)
