#!/usr/bin/env bash
# The CUDA backend's check on a lent GPU machine (issue #8), prepared so that one call does it all:
# the Triton kernels' and the GPU path's tests on the GPU, then bench/gpu.py on the Qwen3.6-27B shapes.
#
#   bash bench/gpu_check.sh prepare   # here, with network: the gguf wheel and the tinyqwen35 fixtures -> .gpu/
#   bash bench/gpu_check.sh run       # there, from the repo root, with .gpu carried; results under $OUT
#
# The GPU machine has no network and its own python3 with torch and triton (not our pinned versions), and every
# other package mtpserve's model path imports except gguf, which travels as a wheel. ../shared does not travel:
# the fixtures the GPU tests read (tinyqwen35 Q4_K_M and Q8_0 and llama.cpp's references, about 17 MB) are
# copied into .gpu/shared. Gemma 3's file (250 MB) is too big to carry: a slice of it travels instead (its first
# 6 layers and 16384 tokens plus the fixture prompts', 34 MB, tests/gguf_slice.py), held on the GPU to the CPU
# path by test_a_gemma3_slice_gives_the_cpu_paths_greedy_tokens; the whole-file tests skip there.
# `run` keeps within one 600 s call: tests 200 s, the bench 330 s; bench/gpu.py saves its JSON after each stage,
# so a cut-short run still returns what it measured.
set -uo pipefail
cd "$(dirname "$0")/.."
GGUF_VERSION=$(sed -n 's/^ *"gguf==\([0-9.]*\)".*/\1/p' pyproject.toml)
SHARED=${MTPSERVE_SHARED:-../shared}

case "${1:-}" in
prepare)
    set -e
    rm -rf .gpu && mkdir -p .gpu/whl .gpu/shared/fixtures/refs
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_17_x86_64 -d .gpu/whl "gguf==$GGUF_VERSION"
    cp "$SHARED"/fixtures/tinyqwen35-mtp-Q4_K_M.gguf "$SHARED"/fixtures/tinyqwen35-mtp-Q8_0.gguf .gpu/shared/fixtures/
    cp "$SHARED"/fixtures/refs/*.json .gpu/shared/fixtures/refs/
    PY=python3; [ -x .venv/bin/python ] && PY=.venv/bin/python
    GEMMA=$($PY -c 'from mtpserve.default_models import DEFAULT_MODELS, model_path
print(model_path(DEFAULT_MODELS["gemma3"]))')
    [ -f "$GEMMA" ] || { echo "$GEMMA is missing: run make models first" >&2; exit 1; }
    $PY -m tests.gguf_slice "$GEMMA" \
        .gpu/shared/fixtures/gemma-3-270m-q4_k_m.slice6.gguf --ref "$SHARED"/fixtures/refs/gemma-3-270m-q4_k_m.json
    du -sh .gpu
    echo "carry .gpu in the device run: bash bench/gpu_check.sh run"
    ;;
run)
    : "${OUT:?run on the GPU machine, where \$OUT is the folder that comes back}"
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        .gpu/whl/*.whl || exit 1
    export PYTHONPATH=/tmp/site:$PWD/src MTPSERVE_SHARED=$PWD/.gpu/shared PYTHONUNBUFFERED=1
    nvidia-smi >"$OUT/nvidia-smi.txt" 2>&1
    python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__,
        torch.cuda.get_device_name(), torch.cuda.get_device_capability())' 2>&1 | tee "$OUT/versions.txt"
    # The GPU path's tests first (token identity); workers in parallel when pytest-xdist is there (the image has it):
    # Triton compiles each kernel configuration on the CPU, once a process, and there are 16 cores.
    XDIST=(); python3 -c 'import xdist' 2>/dev/null && XDIST=(-n 8)
    timeout 200 python3 -m pytest -q -p no:cacheprovider -o addopts='-ra' "${XDIST[@]}" --durations=15 \
        tests/test_gpu_path.py tests/test_triton_gemv.py tests/test_triton_gemm.py tests/test_triton_attention.py \
        tests/test_triton_gated_delta.py 2>&1 | tee "$OUT/tests.log"
    timeout 330 python3 bench/gpu.py --json "$OUT/gpu.json" 2>&1 | tee "$OUT/bench.log"
    ;;
*)
    echo "usage: bash bench/gpu_check.sh prepare|run" >&2
    exit 2
    ;;
esac
