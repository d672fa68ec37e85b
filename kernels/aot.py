"""Compile every Triton kernel mmpipe launches for an NVIDIA architecture, on a machine without a GPU.

    python -m mmpipe.kernels.aot                 # sm_90 (H100 / H200), all cases
    python -m mmpipe.kernels.aot --arch 80 --quick

The interpreter (what the CPU tests run) accepts programs the GPU compiler rejects or makes slow: a
tile that does not fit in shared memory, a ``tl.dot`` shape the tensor cores cannot take, registers
that spill. This runs the real compiler (Triton to PTX to cubin, ``ptxas`` included) through the
kernels' own launch sites, on CPU tensors of DiT-realistic shapes, with launching replaced by
compiling, and reports per kernel: shared memory (against the architecture's limit), registers per
thread, bytes spilled per thread, warps, pipeline stages and whether the matmuls became
Hopper's warpgroup MMA (``wgmma``). A kernel that fails to compile or needs more shared memory than the
architecture has is an error (exit 1); spills are reported, not errors.

It needs Triton's compiled mode, so it re-runs itself with ``TRITON_INTERPRET=0`` when the process was
started interpreted (``mmpipe`` sets the interpreter up on machines without a GPU). The last output line
is one JSON object ``{"arch", "triton", "ok", "kernels": [...]}``.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import re
import subprocess
import sys
import tempfile
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch
from tqdm import tqdm

from mmpipe.kernels import _triton

# The largest dynamic shared memory a block may opt into, per compute capability (CUDA programming
# guide, "Technical Specifications per Compute Capability").
MAX_SHARED_BYTES = {
    70: 98304,
    75: 65536,
    80: 166912,
    86: 101376,
    87: 166912,
    89: 101376,
    90: 232448,
    100: 232448,
    120: 101376,
}


@dataclasses.dataclass
class Compiled:
    """What one compiled kernel needs."""

    case: str
    kernel: str
    num_warps: int
    num_stages: int
    shared_bytes: int
    registers: int
    spill_bytes: int
    wgmma: bool
    constexprs: dict[str, Any]


@dataclasses.dataclass
class Failure:
    case: str
    error: str


@contextlib.contextmanager
def _compile_only(arch: int) -> Iterator[list[Any]]:
    """Within: Triton targets ``sm_<arch>`` and every launch compiles without running; yields the list
    of ``(kernel name, constexprs, compiled kernel)`` the launches produced."""
    from triton.backends.compiler import GPUTarget  # optional dependency: main() checks for triton first
    from triton.runtime.autotuner import Autotuner
    from triton.runtime.driver import driver
    from triton.runtime.jit import JITFunction

    class _TargetOnly:
        """The driver calls a launch makes before it compiles, for a GPU that is not here."""

        def __init__(self, target: GPUTarget) -> None:
            self.target = target

        def get_current_device(self) -> int:
            return 0

        def get_current_stream(self, device: int | None = None) -> int:
            return 0

        def get_current_target(self) -> GPUTarget:
            return self.target

    compiled: list[Any] = []
    run, tune = JITFunction.run, Autotuner.run
    active = driver._active  # (reset_active() would look for a GPU driver)

    def compile_only(self: Any, *args: Any, grid: Any, warmup: bool, **kwargs: Any) -> Any:
        kernel = run(self, *args, grid=grid, warmup=True, **kwargs)
        named = {p.name for p in self.params if p.is_constexpr}
        compiled.append((self.fn.__name__, {k: v for k, v in kwargs.items() if k in named}, kernel))
        return kernel

    def compile_every_config(self: Any, *args: Any, **kwargs: Any) -> Any:
        """An autotuned launch: what the tuner would time, each config compiled."""
        return [self.fn.run(*args, **kwargs, **config.all_kwargs()) for config in self.configs]

    driver.set_active(_TargetOnly(GPUTarget("cuda", arch, 32)))  # type: ignore[arg-type]
    JITFunction.run = compile_only  # type: ignore[method-assign]
    Autotuner.run = compile_every_config  # type: ignore[method-assign]
    try:
        yield compiled
    finally:
        JITFunction.run, Autotuner.run = run, tune  # type: ignore[method-assign]
        driver._active = active


@contextlib.contextmanager
def _cpu_tensors_accepted() -> Iterator[None]:
    """The kernels' "can this run here" checks, answered yes for CPU tensors (nothing runs)."""
    from mmpipe.kernels import attention, norm, rope  # they import triton: after main() has set its environment

    modules = [vars(m) for m in (attention, norm, rope)]  # each imported `can_run` by name
    saved = [m["can_run"] for m in modules]
    for m in modules:
        m["can_run"] = lambda *tensors: True
    try:
        yield
    finally:
        for m, f in zip(modules, saved, strict=True):
            m["can_run"] = f


def _resources(kernel: Any, arch: int) -> tuple[int, int, int]:
    """``(registers per thread, spilled bytes per thread, static shared bytes)`` of a compiled kernel.

    ``cuobjdump`` reads registers, shared memory and the stack frame from the cubin. A frame may hold
    spilled registers or local arrays (float64 ``sin`` keeps one); only when there is a frame is
    ``ptxas -v`` run again on the PTX, with the compiler's architecture, to count the spill stores."""
    import triton  # optional dependency: main() checks for triton first
    from triton.backends.nvidia.compiler import (  # optional dependency: main() checks for triton first
        get_ptxas,
        sm_arch_from_capability,
    )

    with tempfile.TemporaryDirectory() as tmp:
        cubin, ptx = os.path.join(tmp, "k.cubin"), os.path.join(tmp, "k.ptx")
        with open(cubin, "wb") as f:
            f.write(kernel.asm["cubin"])
        tool = triton.knobs.nvidia.cuobjdump.path
        text = subprocess.run([tool, "--dump-resource-usage", cubin], capture_output=True, text=True, check=True).stdout
        fields = dict(tok.split(":", 1) for line in text.splitlines() if "REG:" in line for tok in line.split())
        regs, shared = int(fields["REG"]), int(fields["SHARED"])
        if int(fields["STACK"]) + int(fields["LOCAL"]) == 0:
            return regs, 0, shared
        with open(ptx, "w") as f:
            f.write(kernel.asm["ptx"])
        cmd = [get_ptxas(arch).path, "-v", f"--gpu-name={sm_arch_from_capability(arch)}", ptx, "-o", cubin]
        log = subprocess.run(cmd, capture_output=True, text=True, check=True).stderr
    spills = re.search(r"(\d+) bytes spill stores", log)
    return regs, int(spills.group(1)) if spills else 0, shared


# ---- the cases: what mmpipe launches, at DiT-realistic shapes ------------------------------------


def _attention_cases(quick: bool) -> Iterator[tuple[str, Callable[[], None]]]:
    from mmpipe.kernels import attention as fa  # imports triton: after main() has set its environment

    dtypes = [torch.bfloat16] if quick else [torch.bfloat16, torch.float16, torch.float32, torch.float64]
    dims = [128] if quick else [64, 128]
    # quick: each compile-time switch once (uniform non-causal, varlen causal)
    flags = [(False, False), (True, True)] if quick else [(c, v) for c in (False, True) for v in (False, True)]
    for dtype in dtypes:
        for d in dims:
            for causal, varlen in flags:
                name = f"attention {'varlen ' if varlen else ''}{str(dtype)[6:]} D{d}{' causal' if causal else ''}"
                yield name, _attention_launch(fa, dtype, d, causal, varlen)


def _attention_launch(fa: Any, dtype: torch.dtype, d: int, causal: bool, varlen: bool) -> Callable[[], None]:
    def launch() -> None:
        h, s = 4, 1024
        if varlen:
            lens = [512, 384, 128]
            cu = torch.tensor([0, 512, 896, 1024], dtype=torch.int32)
            q, k, v = (torch.empty(s, h, d, dtype=dtype) for _ in range(3))
            layout = fa._Layout(len(lens), h, max(lens), max(lens), cu, cu)
            lse = torch.empty(h, s, dtype=fa._acc_dtype(dtype))
        else:
            q, k, v = (torch.empty(1, h, s, d, dtype=dtype) for _ in range(3))
            layout = fa._Layout(1, h, s, s)
            lse = torch.empty(1, h, s, dtype=fa._acc_dtype(dtype))
        out = torch.empty_like(q)
        fa._launch_forward(q, k, v, out, lse, layout, causal, d**-0.5, None)
        grads = (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v))
        fa._launch_backward(out, q, k, v, out, lse, grads, layout, causal, d**-0.5, None)

    return launch


def _norm_cases(quick: bool) -> Iterator[tuple[str, Callable[[], None]]]:
    from mmpipe.kernels import norm  # imports triton: after main() has set its environment

    dtypes = [torch.bfloat16] if quick else [torch.bfloat16, torch.float32, torch.float64]
    widths = [5120] if quick else [1536, 3072, 5120]  # Wan 2.1 1.3B, 5B, 14B
    for dtype in dtypes:
        for d in widths:
            for rms in (False, True):
                yield f"norm_modulate {str(dtype)[6:]} D{d}{' rms' if rms else ''}", _norm_launch(norm, dtype, d, rms)


def _norm_launch(norm: Any, dtype: torch.dtype, d: int, rms: bool) -> Callable[[], None]:
    def launch() -> None:
        x = torch.empty(1, 64, d, dtype=dtype)
        mod = torch.empty(1, 1, d, dtype=torch.float32)
        _, mean, rstd = norm._fwd(x, mod, mod, rms, 1e-6)
        norm._bwd(x, x, mod, mean, rstd, rms)
        _, _, mean, rstd = norm._gated_fwd(x, x, mod, mod, mod, rms, 1e-6)
        norm._gated_bwd(x, x, x, x, mod, mod, mean, rstd, rms)

    return launch


def _rope_cases(quick: bool) -> Iterator[tuple[str, Callable[[], None]]]:
    from mmpipe.kernels import rope  # imports triton: after main() has set its environment

    dtypes = [torch.bfloat16] if quick else [torch.bfloat16, torch.float32, torch.float64]
    heads = [40] if quick else [12, 24, 40]
    for dtype in dtypes:
        for n in heads:
            yield f"rope3d {str(dtype)[6:]} N{n} D128", _rope_launch(rope, dtype, n)


def _rope_launch(rope: Any, dtype: torch.dtype, n: int) -> Callable[[], None]:
    def launch() -> None:
        x = torch.empty(1, 64, n, 128, dtype=dtype)
        rope._rope3d(x, 4, 4, 0, 10000.0, False)
        rope._rope3d(x, 4, 4, 0, 10000.0, True)

    return launch


def compile_all(arch: int, *, quick: bool = False) -> tuple[list[Compiled], list[Failure]]:
    """Compile every case for ``sm_<arch>``; what each kernel needs, and the cases that failed."""
    cases = [*_attention_cases(quick), *_norm_cases(quick), *_rope_cases(quick)]
    done: list[Compiled] = []
    failed: list[Failure] = []
    seen: set[str] = set()
    try:
        progress: Any = tqdm(cases, desc=f"compiling for sm_{arch}", unit="case", file=sys.stderr)
    except ImportError:
        progress = cases
    with _cpu_tensors_accepted(), _compile_only(arch) as compiled, warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="TRITON_DEFAULT_FP_FUSION")  # Triton 3.9's notice of a change
        for case, launch in progress:
            compiled.clear()
            try:
                launch()
            except Exception as e:  # noqa: BLE001 - reported per case, the others still compile
                last = (str(e).strip().splitlines() or [""])[-1]  # Triton's compile errors end with the cause
                failed.append(Failure(case, f"{type(e).__name__}: {last}"))
                continue
            for name, constexprs, kernel in compiled:
                key = kernel.hash if hasattr(kernel, "hash") else kernel.metadata.hash
                if key in seen:  # e.g. the backward preprocess, shared by causal and non-causal
                    continue
                seen.add(key)
                regs, spilled, static_shared = _resources(kernel, arch)
                done.append(
                    Compiled(
                        case=case,
                        kernel=name,
                        num_warps=kernel.metadata.num_warps,
                        num_stages=kernel.metadata.num_stages,
                        shared_bytes=kernel.metadata.shared + static_shared,
                        registers=regs,
                        spill_bytes=spilled,
                        wgmma="wgmma.mma_async" in kernel.asm["ptx"],
                        constexprs={k: str(v) for k, v in constexprs.items()},
                    )
                )
    return done, failed


def report(arch: int, done: list[Compiled], failed: list[Failure], max_shared: int) -> dict[str, Any]:
    import triton  # optional dependency: main() checks for triton first

    too_big = [c for c in done if c.shared_bytes > max_shared]
    for c in done:
        flags = []
        if c.shared_bytes > max_shared:
            flags.append(f"SHARED MEMORY OVER THE LIMIT ({max_shared})")
        if c.spill_bytes:
            flags.append(f"spills {c.spill_bytes} B/thread")
        tile = (
            f"{c.constexprs['BLOCK_M']}x{c.constexprs['BLOCK_N']}"
            if {"BLOCK_M", "BLOCK_N"} <= c.constexprs.keys()
            else ""
        )
        print(
            f"{c.case:<37} {c.kernel:<26} {tile:>7} warps {c.num_warps:>2} stages {c.num_stages} "
            f"shared {c.shared_bytes / 1024:6.1f} KiB regs {c.registers:>3}{' wgmma' if c.wgmma else ''}"
            + (f"  [{'; '.join(flags)}]" if flags else "")
        )
    for f in failed:
        print(f"{f.case:<37} FAILED: {f.error}")
    return {
        "arch": f"sm_{arch}",
        "triton": triton.__version__,
        "max_shared_bytes": max_shared,
        "ok": not failed and not too_big,
        "compiled": len(done),
        "failed": [dataclasses.asdict(f) for f in failed],
        "over_shared": [f"{c.case}: {c.kernel}" for c in too_big],
        "spilling": [f"{c.case}: {c.kernel} ({c.spill_bytes} B)" for c in done if c.spill_bytes],
        "kernels": [dataclasses.asdict(c) for c in done],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mmpipe.kernels.aot", description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", type=int, default=90, help="compute capability, major * 10 + minor (default 90)")
    parser.add_argument(
        "--quick", action="store_true", help="bfloat16, one shape per kernel, attention uniform and varlen causal only"
    )
    parser.add_argument("--max-shared", type=int, help="shared memory per block in bytes (default: the arch's)")
    argv = sys.argv[1:] if argv is None else argv
    args = parser.parse_args(argv)
    max_shared = args.max_shared or MAX_SHARED_BYTES.get(args.arch)
    if max_shared is None:
        parser.error(f"--arch {args.arch}: no shared-memory limit known for it; pass --max-shared")

    if not _triton.AVAILABLE:
        print("mmpipe.kernels.aot needs triton (pip install 'mmpipe[triton]')", file=sys.stderr)
        return 2
    if _triton.INTERPRETED:  # the interpreter was chosen when triton was imported: start again without it
        env = os.environ | {"TRITON_INTERPRET": "0"}
        return subprocess.run([sys.executable, "-m", "mmpipe.kernels.aot", *argv], env=env).returncode
    done, failed = compile_all(args.arch, quick=args.quick)
    result = report(args.arch, done, failed, max_shared)
    print(json.dumps(result))
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
