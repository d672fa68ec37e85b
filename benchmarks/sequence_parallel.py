"""mmpipe's sequence-parallel attention side by side with yunchang's ``LongContextAttention`` (USP).

For every (mode, causal, sequence length, heads, ranks) both implementations get the *same tokens* of
the same seeded full q / k / v on every rank (ours sharded by ``SequenceLayout.shard``, yunchang's by
its own ``EXTRACT_FUNC_DICT`` helper: contiguous for ``basic`` rings, zig-zag for causal ``zigzag``
rings) and are measured on two passes:

- ``fwd``: the forward only, no autograd graph;
- ``fwd+bwd``: forward, then backward with a fixed seeded upstream gradient.

Time: median over ``--reps`` repetitions after ``--warmup`` runs (the first of which also checks
correctness) of the slowest rank's wall time; every timed run starts after a barrier (and a CUDA
synchronize on GPU); ours and yunchang's runs alternate so drift on a shared machine hits both.
Error: max abs difference over all ranks of the output (and of dq, dk, dv on ``fwd+bwd``) against
the unsplit single-process attention (``mmpipe.parallel.attention.local_attention``) on the full
tensors, in float32 (on CPU: ATen's fused CPU flash kernel; on GPU: ``sdpa``, i.e. PyTorch's
memory-efficient kernel, which accepts float32).

Modes: ``ulysses`` (ulysses = ranks, ring = 1), ``ring`` (ring = ranks) and, from 4 ranks, ``2d``
(ulysses = ranks / 2, ring = 2); non-causal and causal. Ranks are consecutive in a Ulysses group
(yunchang's ``use_ulysses_low=True``, mmpipe's ``("ring", "ulysses")`` mesh), so both place tokens
alike.

CPU (default when no GPU): gloo, one process per rank spawned on this machine, float32, each rank
``cpus // ranks`` threads (at least 1: 4 ranks on a 2-core machine are oversubscribed, which both
implementations suffer alike). yunchang ships no CPU kernel with an LSE *and* a backward: its
``torch_flash`` / ``torch_efficient`` types call CUDA-only ATen ops, ``torch_math`` returns a zero
LSE (wrong merges as soon as the ring has more than one rank) and every ``torch_*`` type raises in
the backward. So on CPU yunchang runs with ``torch_math``; each row it cannot run (it raises) or
gets wrong (error above tolerance) reports ``yunchang_s: null`` and the reason in ``note``.
``--yunchang-cpu-shim`` instead plugs ATen's CPU flash kernel (the one mmpipe uses) into yunchang's
ring functions by patching their kernel lookup, to compare the two orchestrations with one kernel;
such rows say so in ``yunchang_attn``. Its backward is only right with ``--dtype bfloat16``: in float32
yunchang's ring backward aliases its gradient accumulators with the kernel's output buffers, and on
gloo a 1-rank ring (``ulysses`` mode) fails because yunchang's backward sends to itself.

GPU (``--device cuda``, or auto when at least 2 GPUs are visible): NCCL, one process per GPU,
bfloat16, larger shapes; yunchang uses the flash-attn backend (``fa``) when ``flash_attn`` imports,
else ``torch_flash`` (forward only: yunchang's torch types have no backward).

    pip install --no-deps yunchang   # only for this benchmark; it needs nothing but torch on CPU
    python benchmarks/sequence_parallel.py --quick            # smoke run, seconds
    python benchmarks/sequence_parallel.py                    # CPU, a few minutes on 2 cores
    python benchmarks/sequence_parallel.py --device cuda      # GPUs (also pip install flash-attn)

A table goes to stderr; the last line of stdout is one JSON object ``{"results": [...]}``.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import importlib
import json
import math
import os
import socket
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.device_mesh import DeviceMesh

from mmpipe.parallel.attention import attention_backward, attention_with_lse, local_attention, select_backend
from mmpipe.parallel.sequence import SequenceMesh, sequence_parallel_attention

YUNCHANG_INSTALL = "pip install --no-deps yunchang"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
Grads = tuple[torch.Tensor, ...]


# ---- what to run --------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Case:
    """One row group: a mode at one shape (both passes)."""

    mode: str
    ulysses: int
    ring: int
    causal: bool
    seq: int
    heads: int

    @property
    def ranks(self) -> int:
        return self.ulysses * self.ring


@dataclasses.dataclass(frozen=True)
class Settings:
    """Everything a worker needs besides its cases."""

    device: str
    dtype: str
    batch: int
    head_dim: int
    warmup: int
    reps: int
    backward: bool
    yunchang_attn: str
    yunchang_cpu_shim: bool
    ref_dir: str | None  # CPU: references precomputed by the parent; GPU: None (each rank computes)
    seed: int
    timeout_s: float


def modes(world: int) -> list[tuple[str, int, int]]:
    """``(name, ulysses, ring)`` of the modes benchmarked on ``world`` ranks."""
    out = [("ulysses", world, 1), ("ring", 1, world)]
    if world >= 4 and world % 2 == 0:
        out.append(("2d", world // 2, 2))
    return out


def build_cases(world: int, seqs: list[int], heads: list[int]) -> list[Case]:
    """Cases grouped by shape (one reference per shape and causality), modes innermost."""
    return [
        Case(name, u, r, causal, s, h)
        for s in seqs
        for h in heads
        for causal in (False, True)
        for name, u, r in modes(world)
    ]


# ---- inputs and references ----------------------------------------------------------------------
def full_inputs(seq: int, heads: int, st: Settings, device: torch.device) -> tuple[torch.Tensor, ...]:
    """The seeded full ``q, k, v, dout`` (``B, H, S, D``) of one shape, identical on every rank."""
    gen = torch.Generator(device=device).manual_seed(st.seed + 1000 * seq + heads)
    shape = (st.batch, heads, seq, st.head_dim)
    return tuple(torch.randn(shape, generator=gen, device=device).to(DTYPES[st.dtype]) for _ in range(4))


def reference(inputs: tuple[torch.Tensor, ...], causal: bool) -> tuple[torch.Tensor, ...]:
    """Float32 unsplit attention ``(out, dq, dk, dv)`` of ``inputs`` (``sdpa`` on GPU: float32 there has
    no fused flash kernel, and the math fallback would materialise the whole score matrix)."""
    q, k, v = (t.detach().float().requires_grad_() for t in inputs[:3])
    impl = select_backend("sdpa") if q.is_cuda else None
    out = local_attention(q, k, v, causal=causal, impl=impl)
    out.backward(inputs[3].float())
    assert q.grad is not None and k.grad is not None and v.grad is not None
    return out.detach(), q.grad, k.grad, v.grad


def _ref_path(ref_dir: str, seq: int, heads: int, causal: bool) -> Path:
    return Path(ref_dir) / f"ref_s{seq}_h{heads}_c{int(causal)}.pt"


def precompute_cpu_references(cases: list[Case], st: Settings) -> None:
    """The parent (all cores) computes each CPU reference once instead of every rank redundantly."""
    assert st.ref_dir is not None
    for seq, heads, causal in dict.fromkeys((c.seq, c.heads, c.causal) for c in cases):
        path = _ref_path(st.ref_dir, seq, heads, causal)
        if not path.exists():
            t0 = time.perf_counter()
            torch.save(reference(full_inputs(seq, heads, st, torch.device("cpu")), causal), path)
            print(
                f"reference seq={seq} heads={heads} causal={causal}: {time.perf_counter() - t0:.1f} s", file=sys.stderr
            )


# ---- yunchang (optional) ------------------------------------------------------------------------
def import_yunchang() -> tuple[Any, str | None]:
    """``(yunchang module, None)``, or ``(None, why not)``."""
    try:
        yunchang = importlib.import_module("yunchang")
        importlib.import_module("yunchang.kernels")
    except ImportError as err:
        return None, f"yunchang is not installed ({err}); `{YUNCHANG_INSTALL}` to compare against it"
    return yunchang, None


_ATEN = select_backend("torch")  # the kernel mmpipe runs on CPU: ATen's fused flash attention


def _aten_cpu_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    *_: Any,
    **__: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """yunchang's ``fwd-only`` kernel contract (``B, S, H, D`` in and out, LSE ``B, H, S``) on ATen's CPU flash kernel."""
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale
    assert not dropout_p, "the shim has no dropout"
    out, lse = attention_with_lse(
        _ATEN, q.transpose(1, 2).contiguous(), k.transpose(1, 2).contiguous(), v.transpose(1, 2).contiguous(),
        causal=causal, scale=scale,
    )  # fmt: skip
    return out.transpose(1, 2), lse


def _aten_cpu_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    dq_buf: torch.Tensor,
    dk_buf: torch.Tensor,
    dv_buf: torch.Tensor,
    dropout_p: float,
    softmax_scale: float | None,
    causal: bool,
    *_: Any,
    **__: Any,
) -> None:
    """yunchang's ``bwd-only`` kernel contract (gradients written into the buffers) on ATen's CPU flash kernel."""
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale
    assert not dropout_p, "the shim has no dropout"
    dout_, q_, k_, v_, out_ = (t.transpose(1, 2) for t in (dout, q, k, v, out))
    dq, dk, dv = attention_backward(_ATEN, dout_, q_, k_, v_, out_, lse.contiguous(), causal=causal, scale=scale)
    for buf, grad in ((dq_buf, dq), (dk_buf, dk), (dv_buf, dv)):
        buf.copy_(grad.transpose(1, 2))


def install_cpu_shim() -> None:
    """Make yunchang's ring functions look up ATen's CPU flash kernel for their forward and backward blocks."""
    for name in ("yunchang.ring.ring_flash_attn", "yunchang.ring.zigzag_ring_flash_attn"):
        module = importlib.import_module(name)
        original = vars(module)["select_flash_attn_impl"]

        def select(impl_type: Any, stage: str = "fwd-bwd", attn_processor: Any = None, _orig: Any = original) -> Any:
            if stage == "fwd-only":
                return _aten_cpu_forward
            if stage == "bwd-only":
                return _aten_cpu_backward
            return _orig(impl_type, stage, attn_processor)

        vars(module)["select_flash_attn_impl"] = select


def yunchang_attn_type(st: Settings) -> tuple[Any, str]:
    """``(AttnType, label)`` yunchang runs with on this device."""
    kernels = importlib.import_module("yunchang.kernels")
    if st.yunchang_attn != "auto":
        return kernels.AttnType.from_string(st.yunchang_attn), st.yunchang_attn
    if st.device == "cpu":
        if st.yunchang_cpu_shim:
            return kernels.AttnType.TORCH_FLASH, "aten_cpu_flash (shim, not a shipped yunchang backend)"
        return kernels.AttnType.TORCH_MATH, "torch_math"
    if importlib.import_module("yunchang.globals").HAS_FLASH_ATTN:
        return kernels.AttnType.FA, "fa"
    return kernels.AttnType.TORCH_FLASH, "torch_flash (flash_attn not installed)"


# ---- one worker ---------------------------------------------------------------------------------
def _barrier(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        dist.barrier(device_ids=[device.index])
    else:
        dist.barrier()


def _global_max(values: list[float], device: torch.device) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def _all_agree(ok: bool, device: torch.device) -> bool:
    t = torch.tensor([0.0 if ok else 1.0], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item() == 0.0


def _max_err(got: tuple[torch.Tensor, ...], want: tuple[torch.Tensor, ...]) -> float:
    return max(float((a.float() - b.float()).abs().max()) for a, b in zip(got, want, strict=True))


def _timed(run: Callable[[], Any], device: torch.device) -> float:
    _barrier(device)
    t0 = time.perf_counter()
    run()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - t0


def _ours_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, mesh: SequenceMesh, length: int, causal: bool, scale: float
) -> torch.Tensor:
    return sequence_parallel_attention(q, k, v, mesh=mesh, length=length, causal=causal, scale=scale)


def _yunchang_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, attn: Any, causal: bool, scale: float
) -> torch.Tensor:
    return attn(q, k, v, softmax_scale=scale, causal=causal)


@dataclasses.dataclass
class Contender:
    """One implementation on one case: its attention, its local inputs and the reference for them."""

    fn: Callable[..., torch.Tensor]
    qkv: tuple[torch.Tensor, ...]
    dout: torch.Tensor
    bshd: bool  # inputs and outputs are (B, S, H, D); results are returned as (B, H, S, D)

    def run(self, backward: bool) -> tuple[torch.Tensor, ...]:
        """``(out,)`` or ``(out, dq, dk, dv)``, on fresh leaves, in ``B, H, S, D``."""
        if not backward:
            with torch.no_grad():
                got: tuple[torch.Tensor, ...] = (self.fn(*self.qkv),)
        else:
            leaves = tuple(t.detach().requires_grad_() for t in self.qkv)
            out = self.fn(*leaves)
            out.backward(self.dout)
            grads = [t.grad for t in leaves]
            got = (out.detach(), *(g for g in grads if g is not None))
            assert len(got) == 4
        return tuple(t.transpose(1, 2) for t in got) if self.bshd else got


def _tolerance(st: Settings, ours_err: float) -> float:
    return max(1e-3 if st.dtype == "float32" else 5e-2, 10 * ours_err)


def _check(
    who: Contender, backward: bool, want: tuple[torch.Tensor, ...], device: torch.device
) -> tuple[float | None, str | None]:
    """Run once: ``(max error over ranks, None)``, or ``(None, exception)`` if any rank raised."""
    try:
        local, why = _max_err(who.run(backward), want), None
    except Exception as err:  # noqa: BLE001 - any failure makes the row incomparable
        local, why = float("nan"), f"{type(err).__name__}: {str(err).splitlines()[0][:160] if str(err) else ''}"
    _barrier(device)
    if not _all_agree(why is None, device):
        return None, why or "raised on another rank"
    return _global_max([local], device)[0], None


def _row(
    c: Case, st: Settings, pass_name: str, ours_s: float, yc_s: float | None, ours_err: float, yc_err: float | None
) -> dict[str, Any]:
    return {
        "mode": c.mode,
        "causal": c.causal,
        "seq": c.seq,
        "heads": c.heads,
        "ranks": c.ranks,
        "ulysses": c.ulysses,
        "ring": c.ring,
        "pass": pass_name,
        "device": st.device,
        "dtype": st.dtype,
        "batch": st.batch,
        "head_dim": st.head_dim,
        "ours_s": round(ours_s, 6),
        "yunchang_s": None if yc_s is None else round(yc_s, 6),
        "ratio": None if yc_s is None else round(ours_s / yc_s, 4),
        "ours_max_err": ours_err,
        "yunchang_max_err": yc_err,
    }


def _explain(note: str, c: Case, st: Settings, backward: bool) -> str:
    """``note`` with the cause found in yunchang's source, where known."""
    if (
        "is wrong" in note
        and st.yunchang_attn in ("auto", "torch_math")
        and st.device == "cpu"
        and not st.yunchang_cpu_shim
    ):
        if c.ring > 1:
            note += " (torch_math returns a zero LSE, so the ring merges its blocks with equal weights)"
    elif "is wrong" in note and st.yunchang_cpu_shim and backward and st.dtype == "float32" and c.ring > 1:
        note += (
            " (yunchang's ring backwards start their accumulators as `dq_buffer.to(torch.float32)` etc., the"
            " buffers themselves in float32, which the next block's kernel overwrites; flash-attn is fp16/bf16 only,"
            " so GPUs never hit it; try --dtype bfloat16)"
        )
    elif "Pair is not connected" in note and c.ring == 1:
        note += " (gloo: yunchang's ring backward sends dk/dv to itself even on a 1-rank ring; NCCL allows that)"
    return note


def run_cases(rank: int, world: int, cases: list[Case], st: Settings) -> list[dict[str, Any]]:
    device = torch.device(st.device, rank) if st.device == "cuda" else torch.device("cpu")
    scale = 1.0 / math.sqrt(st.head_dim)
    yunchang, yc_missing = import_yunchang()
    attn_type, attn_label = yunchang_attn_type(st) if yunchang is not None else (None, None)
    if yunchang is not None and st.device == "cpu" and st.yunchang_cpu_shim:
        install_cpu_shim()

    meshes: dict[tuple[int, int], DeviceMesh] = {}
    yc_groups: dict[tuple[int, int], tuple[Any, Any]] = {}
    for c in cases:  # every rank builds every group, in the same order (collective)
        key = (c.ulysses, c.ring)
        if key in meshes:
            continue
        meshes[key] = DeviceMesh(
            st.device, torch.arange(world).view(c.ring, c.ulysses), mesh_dim_names=("ring", "ulysses")
        )
        if yunchang is not None:
            yunchang.set_seq_parallel_pg(c.ulysses, c.ring, rank, world, use_ulysses_low=True)
            pg = importlib.import_module("yunchang.globals").PROCESS_GROUP
            yc_groups[key] = (pg.ULYSSES_PG, pg.RING_PG)

    rows: list[dict[str, Any]] = []
    shape_key: tuple[int, int, bool] | None = None
    inputs: tuple[torch.Tensor, ...] = ()
    ref_full: tuple[torch.Tensor, ...] = ()
    for c in cases:
        if (c.seq, c.heads, c.causal) != shape_key:
            shape_key = (c.seq, c.heads, c.causal)
            inputs = ref_full = ()  # free the previous shape's tensors first
            if device.type == "cuda":
                torch.cuda.empty_cache()
            inputs = full_inputs(c.seq, c.heads, st, device)
            ref_full = torch.load(_ref_path(st.ref_dir, *shape_key)) if st.ref_dir else reference(inputs, c.causal)
        mesh = SequenceMesh.from_device_mesh(meshes[(c.ulysses, c.ring)], zigzag=c.causal)
        q, k, v, dout = (mesh.layout.shard(t, 2, mesh.index).contiguous() for t in inputs)
        ref = tuple(mesh.layout.shard(t, 2, mesh.index) for t in ref_full)
        ours = Contender(
            functools.partial(_ours_attention, mesh=mesh, length=c.seq, causal=c.causal, scale=scale),
            (q, k, v),
            dout,
            False,
        )
        yc: Contender | None = None
        yc_fwd_note = yc_missing
        if yunchang is not None:
            pg = importlib.import_module("yunchang.globals").PROCESS_GROUP
            pg.ULYSSES_PG, pg.RING_PG = yc_groups[(c.ulysses, c.ring)]
            ring_impl = "zigzag" if c.causal and c.ring > 1 else "basic"
            extract = yunchang.EXTRACT_FUNC_DICT[ring_impl]
            yq, yk, yv, ydout = (
                extract(t.transpose(1, 2), rank, world_size=world, rd=c.ring, ud=c.ulysses).contiguous() for t in inputs
            )
            # Both must place the same tokens on each rank, or the timings would not compare.
            assert torch.equal(yq.transpose(1, 2), q), (
                f"yunchang's {ring_impl} shard differs from mmpipe's layout ({c})"
            )
            attn = yunchang.LongContextAttention(
                scatter_idx=2, gather_idx=1, ring_impl_type=ring_impl, attn_type=attn_type
            )
            yc = Contender(
                functools.partial(_yunchang_attention, attn=attn, causal=c.causal, scale=scale),
                (yq, yk, yv),
                ydout,
                True,
            )

        for backward in (False, True) if st.backward else (False,):
            want = ref if backward else ref[:1]
            # Warm-up; the first run of each also checks the result.
            ours_err, why = _check(ours, backward, want, device)
            if ours_err is None:
                raise RuntimeError(f"mmpipe's attention failed on {c}: {why}")
            yc_err, note = None, yc_fwd_note
            if yc is not None and note is None:
                yc_err, why = _check(yc, backward, want, device)
                if yc_err is None:
                    note = _explain(f"yunchang ({attn_label}) raised {why}", c, st, backward)
                elif yc_err > _tolerance(st, ours_err):
                    tol = _tolerance(st, ours_err)
                    note = _explain(
                        f"yunchang ({attn_label}) is wrong: max err {yc_err:.3g} > tolerance {tol:.3g}", c, st, backward
                    )
                if note is not None and not backward:
                    yc_fwd_note = note + " [forward; backward not attempted]"
            comparable = yc is not None and note is None
            if comparable and st.device == "cpu" and attn_label == "torch_math":
                note = "kernels differ: yunchang's torch_math materialises the scores, ours runs ATen's flash kernel"
            timed = [ours] + ([yc] if comparable and yc is not None else [])
            for _ in range(st.warmup - 1):
                for who in timed:
                    who.run(backward)
            times: dict[int, list[float]] = {id(who): [] for who in timed}
            for i in range(st.reps):  # alternate which goes first
                for who in timed if i % 2 == 0 else timed[::-1]:
                    times[id(who)].append(_timed(functools.partial(who.run, backward), device))
            ours_s = statistics.median(_global_max(times[id(ours)], device))
            yc_s = statistics.median(_global_max(times[id(yc)], device)) if comparable else None
            row = _row(c, st, "fwd+bwd" if backward else "fwd", ours_s, yc_s, ours_err, yc_err)
            row.update(yunchang_attn=attn_label, note=note)
            rows.append(row)
            if rank == 0:
                print(_format_row(row), file=sys.stderr, flush=True)
    return rows


def _entry(rank: int, world: int, port: int, cases: list[Case], st: Settings, queue: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    timeout = datetime.timedelta(seconds=st.timeout_s)
    if st.device == "cuda":
        torch.cuda.set_device(rank)
        dist.init_process_group(
            "nccl", rank=rank, world_size=world, timeout=timeout, device_id=torch.device("cuda", rank)
        )
    else:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
        dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timeout)
    try:
        queue.put((rank, run_cases(rank, world, cases, st), None))
    except Exception:
        queue.put((rank, None, traceback.format_exc()))
        raise
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_world(world: int, cases: list[Case], st: Settings) -> list[dict[str, Any]]:
    """Spawn ``world`` ranks, run ``cases`` on them, return rank 0's rows."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_entry, args=(r, world, port, cases, st, queue)) for r in range(world)]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    try:
        for _ in procs:
            rank, value, error = queue.get(timeout=st.timeout_s * 4)
            if error is not None:
                raise RuntimeError(f"rank {rank} failed:\n{error}")
            results[rank] = value
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
    return results[0]


# ---- reporting ----------------------------------------------------------------------------------
HEADER = f"{'ranks':>5} {'mode':<7} {'causal':<6} {'seq':>6} {'heads':>5} {'pass':<7} {'ours_s':>9} {'yc_s':>9} {'ratio':>6} {'ours_err':>9} {'yc_err':>9}  note"


def _fmt(x: float | None, spec: str) -> str:
    return format(x, spec) if x is not None else "-".rjust(int(spec.split(".")[0]))


def _format_row(r: dict[str, Any]) -> str:
    return (
        f"{r['ranks']:>5} {r['mode']:<7} {r['causal']!s:<6} {r['seq']:>6} {r['heads']:>5} {r['pass']:<7} "
        f"{_fmt(r['ours_s'], '9.4f')} {_fmt(r['yunchang_s'], '9.4f')} {_fmt(r['ratio'], '6.3f')} "
        f"{_fmt(r['ours_max_err'], '9.2e')} {_fmt(r['yunchang_max_err'], '9.2e')}  {r['note'] or ''}"
    )


# ---- main ---------------------------------------------------------------------------------------
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--device", choices=["auto", "cpu", "cuda"], default="auto", help="auto: cuda with >= 2 GPUs, else cpu"
    )
    p.add_argument("--quick", action="store_true", help="tiny shapes, 2 repetitions: a smoke run of seconds")
    p.add_argument("--worlds", type=int, nargs="+", help="rank counts (default: 2 4 on CPU; 2 4 8 up to the GPU count)")
    p.add_argument("--seq", type=int, nargs="+", help="sequence lengths (default: CPU 2048 6144; GPU 16384 65536)")
    p.add_argument("--heads", type=int, nargs="+", help="head counts (default: CPU 8; GPU 24 40)")
    p.add_argument("--head-dim", type=int, help="default: CPU 64, GPU 128")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--dtype", choices=sorted(DTYPES), help="default: CPU float32, GPU bfloat16")
    p.add_argument("--warmup", type=int, help="runs before timing, the first also checks the result (default 1, GPU 3)")
    p.add_argument("--reps", type=int, help="timed repetitions per implementation (default 3, GPU 10)")
    p.add_argument("--no-backward", action="store_true", help="forward rows only")
    p.add_argument("--yunchang-attn", default="auto", help="yunchang AttnType value (default: CPU torch_math, GPU fa)")
    p.add_argument(
        "--yunchang-cpu-shim",
        action="store_true",
        help="CPU: run yunchang's rings on ATen's CPU flash kernel (patched in)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=600, help="seconds a collective may wait before failing")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    n_gpu = torch.cuda.device_count() if torch.cuda.is_available() else 0
    device = args.device if args.device != "auto" else ("cuda" if n_gpu >= 2 else "cpu")
    if device == "cuda" and n_gpu < 2:
        raise SystemExit(f"--device cuda needs at least 2 GPUs, found {n_gpu}")
    gpu = device == "cuda"
    if args.quick:
        seqs, heads, head_dim, reps, warmup = [256], [4], 32, 2, 1
    elif gpu:
        seqs, heads, head_dim, reps, warmup = [16384, 65536], [24, 40], 128, 10, 3
    else:
        seqs, heads, head_dim, reps, warmup = [2048, 6144], [8], 64, 3, 1
    worlds = args.worlds or ([w for w in (2, 4, 8) if w <= n_gpu] if gpu else [2, 4])
    if gpu and max(worlds) > n_gpu:
        raise SystemExit(f"{max(worlds)} ranks need {max(worlds)} GPUs, found {n_gpu}")
    st = Settings(
        device=device,
        dtype=args.dtype or ("bfloat16" if gpu else "float32"),
        batch=args.batch,
        head_dim=args.head_dim or head_dim,
        warmup=max(1, args.warmup if args.warmup is not None else warmup),
        reps=max(1, args.reps if args.reps is not None else reps),
        backward=not args.no_backward,
        yunchang_attn=args.yunchang_attn,
        yunchang_cpu_shim=args.yunchang_cpu_shim,
        ref_dir=None,
        seed=args.seed,
        timeout_s=args.timeout,
    )
    yunchang, missing = import_yunchang()
    if yunchang is None:
        print(f"NOTE: {missing}. Running mmpipe's side only (yunchang_s: null).", file=sys.stderr)
    elif gpu and not importlib.import_module("yunchang.globals").HAS_FLASH_ATTN and args.yunchang_attn == "auto":
        print("NOTE: flash_attn is not installed; yunchang falls back to torch_flash (no backward).", file=sys.stderr)
    seqs, heads = args.seq or seqs, args.heads or heads

    t_start = time.perf_counter()
    results: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="mmpipe-sp-bench-") as tmp:
        if not gpu:
            st = dataclasses.replace(st, ref_dir=tmp)
            precompute_cpu_references([c for w in worlds for c in build_cases(w, seqs, heads)], st)
        print(
            f"device={device} dtype={st.dtype} batch={st.batch} head_dim={st.head_dim} reps={st.reps}; load average "
            f"{' '.join(f'{x:.2f}' for x in os.getloadavg())} on {os.cpu_count()} CPUs (other load skews CPU timings)",
            file=sys.stderr,
        )
        print(HEADER, file=sys.stderr)
        for world in worlds:
            cases = [c for c in build_cases(world, seqs, heads) if c.heads % c.ulysses == 0]
            results += run_world(world, cases, st)
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    print(
        f"total {time.perf_counter() - t_start:.1f} s; load average now {load} on {os.cpu_count()} CPUs",
        file=sys.stderr,
    )
    print(json.dumps({"results": results}))


if __name__ == "__main__":
    main()
