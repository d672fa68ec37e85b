"""``benchmarks/kernels.py`` end to end on CPU (Triton's interpreter, tiny shapes), as the kernel issue
asks: every row carries its fields, every kernel agrees with its baseline, and no section failed.

The agreement check is what the benchmark's ``max_diff`` is for: it once caught the per-sequence SDPA
baseline of ``attention_varlen`` running the last sequence three times (a generator in a list
comprehension sees the loop variable late), which the times alone never showed.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

ROOT = Path(__file__).resolve().parents[2]
FIELDS = {"kernel", "shape", "ours_ms", "baseline", "baseline_ms", "speedup"}


@pytest.mark.slow
def test_kernel_benchmark_runs_on_cpu_and_kernels_agree_with_baselines() -> None:
    # the CPU path on any machine (a visible GPU would make it time full-size shapes)
    env = {**os.environ, "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, "benchmarks/kernels.py"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:] + done.stdout[-2000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["interpreted"] is True and report["errors"] == []
    kernels = {r["kernel"] for r in report["results"]}
    assert kernels == {"norm_modulate", "gated_norm_modulate", "rope3d", "attention", "attention_varlen"}
    for r in report["results"]:
        assert FIELDS <= r.keys(), r
        assert r["ours_ms"] > 0 and r["baseline_ms"] > 0, r
    checked = [r for r in report["results"] if "max_diff" in r]
    assert {r["kernel"] for r in checked} == kernels
    for r in checked:  # float32 on O(1) values, reassociated sums: ~1e-6
        assert r["max_diff"] < 1e-4 and r["rel_diff"] < 1e-4, r


@pytest.mark.slow
def test_a_sigterm_reports_what_was_measured() -> None:
    """As `timeout` ends it in gpu_checks.sh: the JSON line still comes, with the rows so far and the cut
    named, and the exit status is 124."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        [sys.executable, "benchmarks/kernels.py"], cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None
    lines = []
    for line in proc.stdout:  # the first measured row, then the signal
        lines.append(line)
        if "norm_modulate" in line:
            break
    proc.send_signal(signal.SIGTERM)
    rest, _ = proc.communicate(timeout=120)
    assert proc.returncode == 124, "".join(lines) + rest
    report = json.loads(rest.strip().splitlines()[-1])
    assert report["results"] and report["results"][0]["kernel"] == "norm_modulate"
    assert [e["error"] for e in report["errors"]] == ["SIGTERM (time limit): the rest was not measured"]


#: Run with benchmarks/ first on sys.path, as ``python benchmarks/<script>`` runs: import diffusers
#: (which imports Hugging Face's ``kernels`` where transformers installed it), then start every script
#: with ``--help`` in this one process; prints each script's name and whether its usage came out.
_START_EVERY_SCRIPT = """
import contextlib, io, json, runpy, sys
scripts = sys.argv[1:]
sys.path.insert(0, "benchmarks")
import diffusers  # noqa: F401  (the import the shadowing broke)
started = {}
for script in scripts:
    sys.argv = [f"benchmarks/{script}", "--help"]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        try:
            runpy.run_path(f"benchmarks/{script}", run_name="__main__")
            code = 0
        except SystemExit as exit:
            code = exit.code or 0
    started[script] = code == 0 and "usage:" in out.getvalue()
print(json.dumps(started))
"""


def test_benchmark_scripts_start_beside_the_kernel_benchmark() -> None:
    """``python benchmarks/<script>`` puts benchmarks/ first on sys.path, where ``kernels.py`` would stand
    in for Hugging Face's ``kernels`` package (diffusers imports it where transformers installed it) and
    every script importing diffusers died at its imports; the benchmark hands the name over instead.
    One process (each start costs the imports of torch and diffusers) starts every script's ``--help``."""
    scripts = sorted(p.name for p in (ROOT / "benchmarks").glob("*.py") if p.name != "kernels.py")
    assert len(scripts) > 5
    done = subprocess.run(
        [sys.executable, "-c", _START_EVERY_SCRIPT, *scripts], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    started = json.loads(done.stdout.strip().splitlines()[-1])
    assert started == dict.fromkeys(scripts, True), done.stderr[-3000:]
