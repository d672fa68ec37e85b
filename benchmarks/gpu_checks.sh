#!/usr/bin/env bash
# The GPU checks of the memory and kernel issues, as one run on a lent GPU machine (the `device`
# tool's `run`): the CUDA tests (pinned host tier, xFormers backend), then the GPU benchmarks,
# each printing its JSON last line; logs and JSON go to $OUT (or ./gpu-out). Needs, beside the
# machine's own torch and triton, the project's pure-Python dependencies and xFormers as wheels in
# .whl/ (the device machine reaches no registry), and in .whl/cu12/ the CUDA 12 runtime that xFormers'
# wheel links (its _C.so needs libcudart.so.12; the machine's torch is a CUDA 13 build):
#
#   echo /.whl/ >> .git/info/exclude
#   P="--no-deps --only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64"
#   P="$P --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64"
#   python3 -m pip download $P -d .whl diffusers==0.42.1 hydra-core==1.3.8 omegaconf==2.3.1 av==18.1.0 ftfy==6.3.1 \
#       wcwidth xformers==0.0.35
#   python3 -m pip wheel --no-deps -w .whl antlr4-python3-runtime==4.9.3   # omegaconf's; PyPI has no wheel of it
#   python3 -m pip download $P -d .whl/cu12 nvidia-cuda-runtime-cu12==12.8.90
#
# (46 MB; constraints.txt's versions (a test holds them equal), checked to download; ftfy, which diffusers' Wan pipeline
# imports where installed, needs wcwidth) and then
# `run(command="bash benchmarks/gpu_checks.sh", carry=[".whl"], timeout_s=520)`; arguments pick steps
# (`bash benchmarks/gpu_checks.sh memory`: the installs, the preflight and that step alone; the default
# is all of tests, kernels and memory). The steps together are
# bounded by 450 s, so that with the machine's start the run fits a 15-minute lease; the kernel benchmark
# runs before the memory benchmark, which gets what the others left; on its limit the kernel benchmark prints what it measured (SIGTERM) before it is killed.
set -uo pipefail
cd "$(dirname "$0")/.."
STEPS=" ${*:-tests kernels memory} "
for step in $STEPS; do
    case $step in tests | kernels | memory) ;; *) echo "gpu_checks.sh: unknown step '$step' (tests, kernels, memory)"; exit 2 ;; esac
done
OUT="${OUT:-gpu-out}"
mkdir -p "$OUT"
SITE=/tmp/mmpipe-site
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .whl/*.whl
fi
if compgen -G ".whl/cu12/*.whl" >/dev/null; then  # outside PYTHONPATH: only its library is wanted
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/mmpipe-cu12 .whl/cu12/*.whl
    export LD_LIBRARY_PATH="/tmp/mmpipe-cu12/nvidia/cuda_runtime/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
fi
# mmpipe's folders install inside its namespace (pyproject's package-dir), so it is installed, not run
# from source; `python3 -P` keeps the checkout's ./mmpipe (which lacks them) off sys.path
python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --target "$SITE" . || exit 1
export PYTHONPATH="$SITE" PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$OUT/gpu.txt"

status=0
END=$((SECONDS + 450))
# Preflight: a module missing from the carried wheels costs seconds here, not a step
timeout 60 python3 -P -c "import mmpipe.presets, mmpipe.stages.dit, mmpipe.memory.host, mmpipe.kernels.attention, xformers.ops" \
    2>&1 | tee "$OUT/preflight.log" || status=1
[[ $STEPS == *" tests "* ]] && { TRITON_INTERPRET=0 timeout 90 python3 -P -m pytest -q -p no:cacheprovider tests/unit/test_memory_host_tier.py tests/unit/test_attention_cuda.py \
    tests/unit/test_attention_xformers.py tests/unit/test_kernels_cuda.py 2>&1 | tee "$OUT/tests.log" || status=1; }
# the kernel benchmark took 115 s on an H200 (2026-12-04); on its limit it prints what it measured (SIGTERM)
[[ $STEPS == *" kernels "* ]] && { TRITON_INTERPRET=0 timeout -k 10 170 python3 -P benchmarks/kernels.py 2>&1 | tee "$OUT/kernels.log" || status=1
    tail -n 1 "$OUT/kernels.log" >"$OUT/kernels.json"; }
# the memory benchmark where a step is bound by compute (a cap at 16k tokens), with the curve; the time left
LEFT=$((END - SECONDS))
[[ $STEPS == *" memory "* ]] && { timeout $((LEFT > 120 ? LEFT : 120)) python3 -P benchmarks/memory.py --device cuda \
    --cap-frames 64 --max-frames 192 --frame-step 32 --reps 5 --curve 2>&1 | tee "$OUT/memory.log" || status=1
    tail -n 1 "$OUT/memory.log" >"$OUT/memory.json"; }
exit $status
