"""Median times of mmpipe's Triton kernels against their baselines, side by side in one run.

    python benchmarks/kernels.py            # DiT-realistic shapes on a GPU; tiny interpreted shapes on CPU

Per kernel and shape: ours (Triton, forward + backward) against PyTorch eager (norm + modulate, rotary)
or SDPA (attention: the flash backend on CUDA) and xformers where installed (its row names the
operators it dispatched: without the ``flash_attn`` package those are ATen's own FlashAttention-2 and
CUTLASS kernels, so on square non-causal shapes it times SDPA-flash's kernel again); packed sequences of
different lengths (``attention_varlen``, one call) against SDPA and eager PyTorch on each sequence
separately. With achieved TFLOP/s (attention) or GB/s (elementwise kernels) next to this device's
measured ceilings (a large matmul, a large copy). On a GPU the times are ``triton.testing.do_bench``
medians of at least ``MIN_REPS`` timed calls (its default window times one call of a long attention).
Without one the kernels run in Triton's CPU interpreter at tiny shapes: those rows check that
the script and the kernels run end to end (``"interpreted": true``); their times say nothing about the
kernels.

The last output line is one JSON object ``{"device", "interpreted", "ceilings", "results": [...],
"autotuned": [...]}``, each result with ``kernel``, ``shape``, ``ours_ms``, ``baseline``,
``baseline_ms``, ``speedup``, ``elapsed_s`` (since the start) and, against the first baseline of each
kernel and shape, ``max_diff`` and ``rel_diff`` (the largest absolute difference of output and input
gradients, and that over the baseline tensor's largest magnitude: long attentions' outputs are O(0.05),
so only the relative figure tells a wrong kernel from bf16 rounding, ~1e-2 at most);
``autotuned`` lists the attention tiles the autotuner chose (GPU only); ``errors`` the sections that
failed (the others still run; the exit status is then 1). Rows print as they are measured, and a
SIGTERM (``timeout``) prints the JSON of what was measured before exiting with 124; the 64k-token
attention, the longest section, runs last. Attention times include no tuning: each figure's first
call, which tunes, is outside the timing.
"""

from __future__ import annotations

if __name__ == "kernels":
    # `python benchmarks/<any>.py` puts this folder first on sys.path, so diffusers' `import kernels`
    # (Hugging Face's package, which transformers >= 5.25 installs) found this script: load the real
    # package, from the path without this folder, in its place (`import` returns what sys.modules holds).
    import importlib
    import os
    import sys

    _here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _here]
    del sys.modules["kernels"]
    sys.modules["kernels"] = importlib.import_module("kernels")  # the rest of this file then runs unused

import functools
import itertools
import json
import signal
import statistics
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

import mmpipe  # noqa: F401  (sets up Triton's interpreter on machines without a GPU)
from mmpipe.kernels import _triton
from mmpipe.kernels.norm import (
    gated_norm_modulate,
    gated_norm_modulate_reference,
    norm_modulate,
    norm_modulate_reference,
)
from mmpipe.kernels.rope import rope3d, rope3d_reference

CUDA = torch.cuda.is_available()
RESULTS: list[dict[str, Any]] = []  # every row so far, in the order measured
MIN_REPS = 5  # timed calls behind each GPU median at the least
STARTED = time.perf_counter()


def bench(fn: Callable[[], Any]) -> float:
    """Median milliseconds of ``fn``."""
    if CUDA:
        import triton.testing

        fn()  # compiles and autotunes
        torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        once_ms = (time.perf_counter() - t) * 1e3
        # do_bench times rep / (its own estimate) calls: a window of MIN_REPS calls and some slack
        window = max(100.0, 1.2 * MIN_REPS * once_ms)
        return float(triton.testing.do_bench(fn, warmup=25, rep=window, return_mode="median"))
    fn()
    times = []
    for _ in range(3):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def ceilings(device: torch.device) -> dict[str, float]:
    """This device's matmul TFLOP/s and copy GB/s (what the kernels' figures are compared with)."""
    n = 8192 if CUDA else 512
    dtype = torch.bfloat16 if CUDA else torch.float32
    a, b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)
    mm = bench(lambda: a @ b)
    x = torch.empty(256 * 2**20 if CUDA else 16 * 2**20, dtype=torch.uint8, device=device)
    y = torch.empty_like(x)
    cp = bench(lambda: y.copy_(x))
    return {"matmul_tflops": 2 * n**3 / mm / 1e9, "copy_gb_s": 2 * x.numel() / cp / 1e6}


Outputs = torch.Tensor | tuple[torch.Tensor, ...]


def _tuple(out: Outputs) -> tuple[torch.Tensor, ...]:
    return out if isinstance(out, tuple) else (out,)


def fwd_bwd(fn: Callable[..., Outputs], *inputs: torch.Tensor) -> Callable[[], None]:
    """One forward and backward of ``fn`` (one or several outputs, each with its upstream gradient)."""
    grads: tuple[torch.Tensor, ...] | None = None
    wrt = [t for t in inputs if t.requires_grad]

    def run() -> None:
        nonlocal grads
        outs = _tuple(fn(*inputs))
        grads = tuple(torch.ones_like(o) for o in outs) if grads is None else grads
        torch.autograd.grad(outs, wrt, grads)

    return run


def agreement(fn: Callable[..., Outputs], base: Callable[..., Outputs], *inputs: torch.Tensor) -> dict[str, float]:
    """``max_diff``: the largest absolute difference between ``fn`` and ``base`` over the outputs and the
    gradients of the inputs that require them, for the same upstream gradients; ``rel_diff``: the largest
    over those tensors of that difference divided by the baseline tensor's largest magnitude. A kernel
    that computes something else shows here, whatever its speed; NaN is reported as such."""
    wrt = [t for t in inputs if t.requires_grad]
    grads: tuple[torch.Tensor, ...] | None = None
    results = []
    for f in (fn, base):
        outs = _tuple(f(*inputs))
        grads = tuple(torch.randn_like(o) for o in outs) if grads is None else grads
        results.append((*outs, *torch.autograd.grad(outs, wrt, grads)))
    absolute, relative = [], []
    for a, b in zip(*results, strict=True):
        d = (a.float() - b.float()).abs().max().item()
        absolute.append(d)
        relative.append(d / max(b.float().abs().max().item(), 1e-30))

    def worst(ds: list[float]) -> float:
        return max(ds, key=lambda d: (d != d, d))  # NaN first

    return {"max_diff": worst(absolute), "rel_diff": worst(relative)}


def row(kernel: str, shape: str, ours: float, baseline: str, base: float, **extra: float) -> None:
    """One result, printed now and kept in ``RESULTS`` (what a SIGTERM still reports)."""
    extra = extra | {"elapsed_s": time.perf_counter() - STARTED}
    r = {"kernel": kernel, "shape": shape, "ours_ms": ours, "baseline": baseline, "baseline_ms": base}
    r |= {"speedup": base / ours} | extra
    RESULTS.append(r)
    extras = "".join(f"  {k} {v:.3g}" for k, v in extra.items())
    print(
        f"{kernel:>19} {shape:>36}  ours {ours:9.3f} ms  {baseline} {base:9.3f} ms  x{base / ours:.2f}{extras}",
        flush=True,
    )


def norm_rows(device: torch.device, dtype: torch.dtype) -> None:
    shapes = [(1, 16384, 5120), (1, 65536, 5120)] if CUDA else [(1, 16, 64)]
    for b, s, d in shapes:
        x = torch.randn(b, s, d, device=device, dtype=dtype, requires_grad=True)
        shift = torch.randn(b, 1, d, device=device, requires_grad=True)
        scale = torch.randn(b, 1, d, device=device, requires_grad=True)
        ours = bench(fwd_bwd(norm_modulate, x, shift, scale))
        eager = bench(fwd_bwd(norm_modulate_reference, x, shift, scale))
        moved = 5 * x.numel() * x.element_size()  # fwd: read x, write y; bwd: read x, dy, write dx
        diff = agreement(norm_modulate, norm_modulate_reference, x, shift, scale)
        shape = f"B{b} S{s} D{d}"
        row("norm_modulate", shape, ours, "torch eager", eager, gb_s=moved / ours / 1e6, **diff)
        y = torch.randn_like(x, requires_grad=True)
        gate = torch.randn_like(shift, requires_grad=True)
        gated, gated_ref = gated_norm_modulate, gated_norm_modulate_reference  # (h, out): both get a gradient
        ours = bench(fwd_bwd(gated, x, y, gate, shift, scale))
        eager = bench(fwd_bwd(gated_ref, x, y, gate, shift, scale))
        moved = 12 * x.numel() * x.element_size()  # fwd: x, y -> h, out; bwd: dout, dh, h, y -> dx, dy, 2 row sums
        diff = agreement(gated, gated_ref, x, y, gate, shift, scale)
        row("gated_norm_modulate", shape, ours, "torch eager", eager, gb_s=moved / ours / 1e6, **diff)


def rope_rows(device: torch.device, dtype: torch.dtype) -> None:
    cases = [((21, 45, 80), 40, 128), ((21, 90, 160), 40, 128)] if CUDA else [((2, 3, 4), 2, 64)]
    for grid, heads, dim in cases:
        tokens = grid[0] * grid[1] * grid[2]
        x = torch.randn(1, tokens, heads, dim, device=device, dtype=dtype, requires_grad=True)
        ours_fn, eager_fn = (lambda t, g=grid, f=f: f(t, g) for f in (rope3d, rope3d_reference))
        ours = bench(fwd_bwd(ours_fn, x))
        eager = bench(fwd_bwd(eager_fn, x))
        moved = 4 * x.numel() * x.element_size()
        shape = f"S{tokens} H{heads} D{dim}"
        diff = agreement(ours_fn, eager_fn, x)
        row("rope3d", shape, ours, "torch eager", eager, gb_s=moved / ours / 1e6, **diff)


def sdpa(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """SDPA, its flash backend on CUDA."""
    if CUDA:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return F.scaled_dot_product_attention(a, b, c)
    return F.scaled_dot_product_attention(a, b, c)


def attention_rows(device: torch.device, dtype: torch.dtype, *, long: bool = False) -> None:
    """Uniform attention at 4k and 16k tokens, or (``long``) at 64k; one tiny interpreted shape on CPU."""
    try:
        from mmpipe.kernels.attention import flash_attention
    except ImportError:
        return
    if CUDA:
        cases = [(65536, 40, 128)] if long else [(4096, 24, 128), (16384, 40, 128)]
    else:
        cases = [] if long else [(32, 2, 64)]
    for s, h, d in cases:
        q, k, v = (torch.randn(1, h, s, d, device=device, dtype=dtype, requires_grad=True) for _ in range(3))
        ours_fn = lambda a, b, c: flash_attention(a, b, c)  # noqa: E731
        ours = bench(fwd_bwd(ours_fn, q, k, v))
        flops = 4 * s * s * h * d * 3.5  # forward (2 matmuls) + backward (5 matmuls), 2 FLOPs each
        shape = f"S{s} H{h} D{d}"
        base = bench(fwd_bwd(sdpa, q, k, v))
        diff = agreement(ours_fn, sdpa, q, k, v)
        name = "sdpa flash" if CUDA else "sdpa"
        row("attention", shape, ours, name, base, tflops=flops / ours / 1e9, **diff)
        xf = xformers_baseline(q) if CUDA else None  # xFormers has no CPU operator
        if xf is not None:
            xf_name, xf_fn = xf
            try:  # an operator that refuses these inputs is a note, not the end of the run
                xf_ms = bench(fwd_bwd(xf_fn, q, k, v))
            except Exception as e:
                print(f"xformers baseline at {shape} skipped: {type(e).__name__}: {e}", flush=True)
                continue
            row("attention", shape, ours, xf_name, xf_ms, tflops=flops / ours / 1e9)


def xformers_baseline(q: torch.Tensor) -> tuple[str, Callable[..., torch.Tensor]] | None:
    """xFormers' ``memory_efficient_attention`` on BHSD tensors, named by the operators it dispatches for
    ``q``'s shape, or None where it is not installed or does not load (the reason is printed). Imported
    here, not at the top: the norm and rotary rows are measured whatever xFormers does on import."""
    try:
        import xformers.ops as xops
    except Exception as e:  # an ImportError, or an OSError from its compiled extension
        print(f"xformers baseline skipped: {type(e).__name__}: {e}", flush=True)
        return None
    try:  # private API: the name is a courtesy, the timing does not depend on it
        from xformers.ops.fmha.common import Inputs
        from xformers.ops.fmha.dispatch import _dispatch_bw, _dispatch_fw

        inp = Inputs(*(q.transpose(1, 2),) * 3)
        name = f"xformers ({_dispatch_fw(inp, True).NAME} / {_dispatch_bw(inp, False).NAME})"
    except Exception as e:
        name = f"xformers (operators unknown: {type(e).__name__})"

    def attn(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        return xops.memory_efficient_attention(*(t.transpose(1, 2) for t in (a, b, c))).transpose(1, 2)

    return name, attn


def varlen_attention_rows(device: torch.device, dtype: torch.dtype) -> None:
    """Packed sequences of different lengths (one ``flash_attn_varlen`` call) against SDPA and eager
    PyTorch run on each sequence separately, forward + backward, non-causal."""
    try:
        import mmpipe.kernels.attention  # noqa: F401
    except ImportError:
        return
    cases = [([8192, 4096, 2048, 1024, 512, 256, 77], 24, 128), ([8192] * 2 + [4096] * 4, 40, 128)]
    for lens, h, d in cases if CUDA else [([5, 37, 16], 2, 64)]:
        varlen_rows(lens, h, d, device, dtype)


def varlen_rows(lens: list[int], h: int, d: int, device: torch.device, dtype: torch.dtype) -> None:
    from mmpipe.kernels.attention import attention_varlen_reference, flash_attn_varlen

    cu = torch.tensor([0, *itertools.accumulate(lens)], dtype=torch.int32, device=device)
    spans = [slice(a, b) for a, b in itertools.pairwise(cu.tolist())]
    q, k, v = (torch.randn(sum(lens), h, d, device=device, dtype=dtype, requires_grad=True) for _ in range(3))
    mx = max(lens)

    def per_sequence(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        # lists: a generator of t[r] would read r after the loop had moved on to the last span
        bhsd = [[t[r].transpose(0, 1)[None] for t in (a, b, c)] for r in spans]
        return torch.cat([sdpa(*x)[0].transpose(0, 1) for x in bhsd])

    ours_fn = lambda a, b, c: flash_attn_varlen(a, b, c, cu, cu, mx, mx)  # noqa: E731
    ours = bench(fwd_bwd(ours_fn, q, k, v))
    base = bench(fwd_bwd(per_sequence, q, k, v))
    eager = bench(fwd_bwd(lambda a, b, c: attention_varlen_reference(a, b, c, cu, cu, False, d**-0.5)[0], q, k, v))
    tflops = sum(4 * s * s * h * d * 3.5 for s in lens) / ours / 1e9  # as attention_rows, per sequence
    shape = f"{len(lens)} seqs total {sum(lens)} max {mx} H{h} D{d}"
    sdpa_name = "sdpa flash per sequence" if CUDA else "sdpa per sequence"
    diff = agreement(ours_fn, per_sequence, q, k, v)
    row("attention_varlen", shape, ours, sdpa_name, base, tflops=tflops, **diff)
    row("attention_varlen", shape, ours, "torch eager per sequence", eager, tflops=tflops)


def autotuned() -> list[dict[str, Any]]:
    """The attention tiles the autotuner chose on this device, per kernel, dtype and length bucket (none
    when interpreted: the interpreter's tiles are fixed)."""
    from mmpipe.kernels import attention

    return [
        {"kernel": kernel, "dtype": group, "s_bucket": s, "t_bucket": t, "key": str(key), "config": str(config)}
        for (kernel, group, s, t), tuner in attention._tuners.items()
        for key, config in tuner.cache.items()
    ]


def main() -> None:
    if not _triton.AVAILABLE or not (CUDA or _triton.INTERPRETED):
        raise SystemExit(
            "benchmarks/kernels.py needs triton (pip install 'mmpipe[triton]') and a GPU or TRITON_INTERPRET=1"
        )
    device = torch.device("cuda" if CUDA else "cpu")
    dtype = torch.bfloat16 if CUDA else torch.float32
    name = torch.cuda.get_device_name() if CUDA else "cpu (Triton interpreter, tiny shapes: times are not kernel speed)"
    ceiling = ceilings(device)
    print(f"{name}: matmul {ceiling['matmul_tflops']:.1f} TFLOP/s, copy {ceiling['copy_gb_s']:.0f} GB/s", flush=True)
    errors = []
    signal.signal(signal.SIGTERM, _deadline)
    long_attention = functools.partial(attention_rows, long=True)
    sections = {
        "norm": norm_rows,
        "rope": rope_rows,
        "attention": attention_rows,
        "attention_varlen": varlen_attention_rows,
        "attention_64k": long_attention,
    }
    # Rows print as they are measured; a section that fails is reported and the others still run.
    status = 0
    for section, rows in sections.items():
        try:
            rows(device, dtype)  # each row lands in RESULTS (and prints) as it is measured
        except _Deadline:
            errors.append({"section": section, "error": "SIGTERM (time limit): the rest was not measured"})
            status = 124
            break
        except Exception as e:
            traceback.print_exc()
            errors.append({"section": section, "error": f"{type(e).__name__}: {e}"})
            status = 1
        if CUDA:
            torch.cuda.empty_cache()
    report = {"device": name, "interpreted": not CUDA, "ceilings": ceiling, "results": RESULTS}
    print(json.dumps(report | {"autotuned": autotuned(), "errors": errors}), flush=True)
    if status:
        raise SystemExit(status)


class _Deadline(BaseException):
    """SIGTERM arrived (the caller's time limit): stop measuring, report what was measured."""


def _deadline(signum: int, frame: Any) -> None:
    raise _Deadline


if __name__ == "__main__":
    main()
