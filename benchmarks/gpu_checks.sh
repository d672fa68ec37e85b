#!/usr/bin/env bash
# The GPU checks, as one run on a lent GPU machine (the `device` tool's `run`): the CUDA tests, then
# the GPU benchmarks, each printing its JSON last line; logs and JSON go to $OUT (or ./gpu-out).
# Needs, beside the machine's own torch, triton and transformers, the project's other pure-Python
# dependencies as wheels in .whl/ (the device machine reaches no registry):
#
#   echo /.whl/ >> .git/info/exclude
#   P="--no-deps --only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64"
#   P="$P --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64"
#   python3 -m pip download $P -d .whl diffusers==0.42.1 hydra-core==1.3.8 omegaconf==2.3.1 av==18.1.0 ftfy==6.3.1 \
#       wcwidth==0.9.4 fastapi==0.165.0 starlette==1.10.0 pydantic==2.14.4 pydantic_core==2.50.5 annotated-types==0.8.0 \
#       typing-inspection==0.4.5 annotated-doc==0.0.7 uvicorn==0.55.0 python-multipart==0.0.34 openai==3.60.0 \
#       jiter==0.19.0 httpx2==2.16.2 httpcore2==2.16.2 truststore==0.10.5 sniffio==1.3.1 opentelemetry-api==1.45.2 \
#       plotly==7.1.0 narwhals==2.29.0
#   python3 -m pip wheel --no-deps -w .whl antlr4-python3-runtime==4.9.3   # omegaconf's; PyPI has no wheel of it
#
# (58 MB; constraints.txt's versions, a test holds them equal) and, for the xformers step of the
# kernel tests only, xformers==0.0.35 in .whl/ and nvidia-cuda-runtime-cu12==12.8.90 in .whl/cu12/.
# Then `run(command="bash benchmarks/gpu_checks.sh train generate pipeline probe tests", carry=[".whl"],
# timeout_s=600)` and, within the 30 s the machine stays warm, `... gpu_checks.sh serve` (issue 29:
# about 6 + 4 minutes on an H200). Arguments pick steps, run in the order given; `kernels` and
# `memory` are the kernel and memory benchmarks of issues 6 and 7, `fast` issue 33's caches and compile. TRAIN_ARGS and GENERATE_ARGS pass
# options to those benchmarks (`TRAIN_ARGS="--profile --compile"`: top kernels a side, regional compile). Each step has its own time limit,
# and a benchmark killed at its limit prints the JSON of what it measured. What comes back:
# $OUT/log.txt (every step's output) and $OUT/results.jsonl (each benchmark's JSON line).
set -uo pipefail
cd "$(dirname "$0")/.."
STEPS="${*:-train generate pipeline probe tests serve}"
for step in $STEPS; do
    case $step in tests | pipeline | probe | train | generate | serve | kernels | memory | fast) ;;
    *) echo "gpu_checks.sh: unknown step '$step' (tests, pipeline, probe, train, generate, serve, kernels, memory, fast)"; exit 2 ;;
    esac
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
python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --upgrade --target "$SITE" . || exit 1
export PYTHONPATH="$SITE" PYTHONUNBUFFERED=1
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"
} 2>&1 | tee -a "$OUT/log.txt"

status=0
# Preflight: a module missing from the carried wheels costs seconds here, not a step
timeout 60 python3 -P -c "import mmpipe.models.wan, mmpipe.train, mmpipe.generate, mmpipe.serve.engine, mmpipe.serve.server, openai" \
    2>&1 | tee -a "$OUT/log.txt" || status=1
bench() {  # bench NAME LIMIT_S ARGS...: one benchmark, its log and its JSON last line
    local name=$1 limit=$2; shift 2
    echo "== $name (limit ${limit}s) $(date +%T)" | tee -a "$OUT/log.txt"
    TRITON_INTERPRET=0 timeout -k 10 "$limit" python3 -P "benchmarks/$name.py" "$@" 2>&1 | tee /tmp/mmpipe-bench.log \
        | tee -a "$OUT/log.txt"
    local rc=${PIPESTATUS[0]}
    tail -n 1 /tmp/mmpipe-bench.log >>"$OUT/results.jsonl"
    [[ $rc == 0 ]] || status=1
    return "$rc"
}
for step in $STEPS; do
    case $step in
    tests)
        echo "== CUDA tests $(date +%T)" | tee -a "$OUT/log.txt"
        TRITON_INTERPRET=0 timeout -k 10 170 python3 -P -m pytest -q -p no:cacheprovider tests/unit/test_train_cuda.py \
            tests/unit/test_generate_cuda.py tests/serve/test_engine_cuda.py tests/unit/test_memory_host_tier.py \
            2>&1 | tee -a "$OUT/log.txt" || status=1 ;;
    # gpu_train exits 3 when mmpipe's planned memory policy ran out of memory: once more with a smaller budget
    train) bench gpu_train 150 ${TRAIN_ARGS:-} || { [[ $? == 3 ]] && bench gpu_train 110 --budget-gb 60; } ;;
    generate) bench gpu_generate 150 ${GENERATE_ARGS:-} ;;
    pipeline) bench gpu_pipeline_check 90 ;;
    probe) bench gpu_gloo_probe 40 ;;
    serve) bench gpu_serve ${SERVE_LIMIT_S:-260} ;;
    # the kernel benchmark took 115 s on an H200 (2026-12-04); on its limit it prints what it measured (SIGTERM)
    kernels) bench kernels 170 ;;
    # the memory benchmark where a step is bound by compute (a cap at 16k tokens), with the curve
    memory) bench memory 240 --device cuda --cap-frames 64 --max-frames 192 --frame-step 32 --reps 5 --curve ;;
    # issue 33: step caches and regional compile of generate, Wan2.1-1.3B at 480p (rehearsed on CPU with --tiny)
    fast) bench gpu_fast_generation 280 ;;
    esac
done
echo "== done $(date +%T), status $status" | tee -a "$OUT/log.txt"
exit $status
