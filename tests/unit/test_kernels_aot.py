"""``python -m mmpipe.kernels.aot``: every Triton kernel mmpipe launches compiles for Hopper (sm_90)
on this GPU-less machine, through the kernels' own launch sites, with every config the attention
autotuner may time; what the interpreter tests cannot see (shared memory, the warpgroup MMA, spills)
is read from the real compiler's output."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

import pytest

from mmpipe.kernels import _triton
from mmpipe.kernels import attention as fa

if _triton.AVAILABLE:
    from triton.backends import backends

pytestmark = pytest.mark.skipif(
    not _triton.AVAILABLE or "nvidia" not in backends, reason="needs triton with its NVIDIA backend"
)

DOT_KERNELS = {"_fwd_kernel": "fwd", "_bwd_dkdv_kernel": "dkdv", "_bwd_dq_kernel": "dq"}
ALL_KERNELS = {
    *DOT_KERNELS,
    "_bwd_preprocess_kernel",
    "_norm_modulate_fwd_kernel",
    "_norm_modulate_bwd_kernel",
    "_gated_fwd_kernel",
    "_gated_bwd_kernel",
    "_rope3d_kernel",
}


def _aot(*args: str) -> tuple[int, dict[str, Any], str]:
    """Run the tool (quick set) in a fresh process; its exit code, JSON result and output."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # the tool must switch it off itself
    proc = subprocess.run(
        [sys.executable, "-m", "mmpipe.kernels.aot", "--quick", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=1200,
    )
    out = proc.stdout + proc.stderr
    lines = proc.stdout.strip().splitlines()
    assert lines, out[-4000:]
    return proc.returncode, json.loads(lines[-1]), out


def test_every_kernel_and_autotuner_config_compiles_for_hopper() -> None:
    code, result, out = _aot()
    assert code == 0 and result["ok"], out[-4000:]
    assert result["arch"] == "sm_90" and not result["failed"] and not result["over_shared"]
    kernels = result["kernels"]
    assert {k["kernel"] for k in kernels} == ALL_KERNELS
    assert all(k["shared_bytes"] <= result["max_shared_bytes"] for k in kernels)
    for name, tuner in DOT_KERNELS.items():
        for case in ("attention bfloat16 D128", "attention varlen bfloat16 D128 causal"):
            got = {
                (int(k["constexprs"]["BLOCK_M"]), int(k["constexprs"]["BLOCK_N"]), k["num_warps"], k["num_stages"])
                for k in kernels
                if k["kernel"] == name and k["case"] == case
            }
            assert got == set(fa._TUNE_CONFIGS["16-bit"][tuner]), (name, case)
    # the attention matmuls run on Hopper's warpgroup MMA, not the Ampere-style mma.sync fallback
    assert all(k["wgmma"] for k in kernels if k["kernel"] in DOT_KERNELS)


def test_a_kernel_over_the_shared_memory_limit_is_an_error() -> None:
    code, result, out = _aot("--max-shared", str(96 * 1024))
    assert code == 1 and not result["ok"], out[-4000:]
    assert any("_bwd_dq_kernel" in k for k in result["over_shared"]), result["over_shared"]
    assert "SHARED MEMORY OVER THE LIMIT" in out
