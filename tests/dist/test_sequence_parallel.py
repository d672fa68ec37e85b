"""Ulysses, ring and 2-D attention on 2 and 4 gloo processes against the unsplit single-process attention:
outputs and the gradients of q, k and v, causal and non-causal, even and uneven lengths, and joint
attention with a replicated, padded text tail (HunyuanVideo's)."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from workers import run_workers

from mmpipe.parallel.attention import local_attention, select_backend
from mmpipe.parallel.sequence import (
    SequenceLayout,
    SequenceMesh,
    joint_sequence_parallel_attention,
    sequence_parallel_attention,
)

B, H, D = 2, 4, 8
LENGTHS = (16, 13)  # even, and not divisible by 2, 4 or 8 (zig-zag chunks of 2 and 1 tokens)


def _inputs(length: int, seed: int) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(B, H, length, D, generator=gen) for _ in range(4))  # q, k, v, upstream grad


def _reference(length: int, causal: bool, seed: int) -> tuple[torch.Tensor, ...]:
    q, k, v, dout = (t.clone().requires_grad_(i < 3) for i, t in enumerate(_inputs(length, seed)))
    out = local_attention(q, k, v, causal=causal)
    out.backward(dout)
    return out.detach(), q.grad, k.grad, v.grad


def _cases(world: int) -> list[tuple[int, int, bool, int]]:
    degrees = [(world, 1), (1, world)] + ([(2, 2)] if world == 4 else [])
    return [(u, r, c, n) for (u, r), c, n in itertools.product(degrees, (False, True), LENGTHS)]


def _run_cases(rank: int, world: int) -> list[tuple[tuple[int, int, bool, int], list[float]]]:
    meshes = {}
    for u, r in {(u, r) for u, r, _, _ in _cases(world)}:  # every rank builds every mesh (collective)
        meshes[(u, r)] = DeviceMesh("cpu", torch.arange(world).view(r, u), mesh_dim_names=("ring", "ulysses"))
    errors = []
    for i, (u, r, causal, length) in enumerate(_cases(world)):
        mesh = SequenceMesh.from_device_mesh(meshes[(u, r)], zigzag=causal)
        lay = mesh.layout
        q, k, v, dout = (lay.shard(t, 2, mesh.index).clone() for t in _inputs(length, seed=i))
        q, k, v = (t.requires_grad_() for t in (q, k, v))
        out = sequence_parallel_attention(q, k, v, mesh=mesh, length=length, causal=causal)
        out.backward(dout)
        ref = [lay.shard(t, 2, mesh.index) for t in _reference(length, causal, seed=i)]
        errors.append(
            (
                (u, r, causal, length),
                [float((a - b).abs().max()) for a, b in zip((out, q.grad, k.grad, v.grad), ref, strict=True)],
            )
        )
    for i, (u, r, length) in enumerate(_joint_cases(world)):  # non-causal with a replicated text tail
        mesh = SequenceMesh.from_device_mesh(meshes[(u, r)], zigzag=False)
        got, ref = _joint_run(mesh, length, seed=100 + i), _joint_reference(length, seed=100 + i)
        for _, tail_grad in got[1:]:  # the tail's gradients: per-rank shares of the whole
            dist.all_reduce(tail_grad)
        lay, idx = mesh.layout, mesh.index
        diffs = []
        for (gs, gt), (rs, rt) in zip(got, ref, strict=True):
            diffs += [float((gs - lay.shard(rs, 2, idx)).abs().max()), float((gt - rt).abs().max())]
        errors.append(((u, r, "joint", length), diffs))
    return errors


TAIL = 5  # text tokens; sample 1 has its last 2 padded


def _joint_cases(world: int) -> list[tuple[int, int, int]]:
    degrees = [(world, 1), (1, world)] + ([(2, 2)] if world == 4 else [])
    return [(u, r, n) for (u, r), n in itertools.product(degrees, LENGTHS)]


def _tail_valid() -> torch.Tensor:
    valid = torch.ones(B, TAIL, dtype=torch.bool)
    valid[1, -2:] = False
    return valid


def _joint_reference(length: int, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    q, k, v, dout = (t.clone().requires_grad_(i < 3) for i, t in enumerate(_inputs(length + TAIL, seed)))
    valid = torch.cat([torch.ones(B, length, dtype=torch.bool), _tail_valid()], 1)
    bias = torch.zeros(B, 1, 1, length + TAIL).masked_fill(~valid[:, None, None], float("-inf"))
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=bias)
    out.backward(dout)
    return [(t[:, :, :length].detach(), t[:, :, length:].detach()) for t in (out, q.grad, k.grad, v.grad)]


def _joint_run(mesh: SequenceMesh, length: int, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    lay = mesh.layout
    full = _inputs(length + TAIL, seed)
    local = [torch.cat([lay.shard(t[:, :, :length], 2, mesh.index), t[:, :, length:]], 2).clone() for t in full]
    q, k, v = (t.requires_grad_() for t in local[:3])
    out = joint_sequence_parallel_attention(q, k, v, _tail_valid(), mesh=mesh, length=length)
    # every rank holds the whole tail's output; its upstream gradient is shared out, as a loss made of
    # per-rank shares would give it
    dout = local[3].clone()
    dout[:, :, -TAIL:] /= lay.sp
    out.backward(dout)
    n = out.shape[2] - TAIL
    return [(t[:, :, :n].detach(), t[:, :, n:].detach().clone()) for t in (out, q.grad, k.grad, v.grad)]


@pytest.mark.parametrize("world", [2, 4])
def test_attention_matches_single_process(world: int) -> None:
    results = run_workers(_run_cases, world)
    assert len(results[0]) == len(_cases(world)) + len(_joint_cases(world))
    for rank_results in results:
        for case, errs in rank_results:
            # float32: the split changes only the order of the softmax sums (LSE merges across blocks,
            # per-block accumulation); observed ~1e-7, 2e-6 allows reassociation over 16 tokens while a
            # missing or misplaced block (errors of order 1e-1) fails.
            assert max(errs) < 2e-6, f"case ulysses={case[0]} ring={case[1]} causal={case[2]} length={case[3]}: {errs}"


def _refusals(rank: int, world: int) -> list[str]:
    mesh_ring = SequenceMesh.from_device_mesh(
        DeviceMesh("cpu", torch.arange(2).view(2, 1), mesh_dim_names=("ring", "ulysses")), zigzag=False
    )
    mesh_uly = SequenceMesh.from_device_mesh(
        DeviceMesh("cpu", torch.arange(2).view(1, 2), mesh_dim_names=("ring", "ulysses")), zigzag=False
    )
    x = torch.randn(1, 3, 4, 8)
    messages = []
    for mesh, impl in ((mesh_ring, select_backend("sdpa")), (mesh_uly, None)):
        try:
            sequence_parallel_attention(x, x, x, mesh=mesh, length=8, impl=impl)
        except ValueError as err:
            messages.append(str(err))
    return messages


def test_ring_refuses_backend_without_lse_and_ulysses_names_heads() -> None:
    for messages in run_workers(_refusals, 2):
        assert len(messages) == 2
        assert "'sdpa'" in messages[0] and "log-sum-exp" in messages[0]
        assert "3 attention heads" in messages[1] and "ulysses=2" in messages[1]


def test_layout_covers_every_token_once() -> None:
    for u, r, zz, n in itertools.product((1, 2, 3), (1, 2, 4), (False, True), (1, 7, 16, 29)):
        lay = SequenceLayout(u, r, zz)
        seen = torch.cat([lay.positions(n, i) for i in range(lay.sp)])
        assert sorted(seen.tolist()) == list(range(n)), (u, r, zz, n)
        sizes = [lay.size(n, i) for i in range(lay.sp)]
        if not zz:
            assert max(sizes) - min(sizes) <= 1 + (u > 1)
