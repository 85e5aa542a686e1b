#!/usr/bin/env bash
# The CUDA backend's check on a lent GPU machine (issue #8), prepared so that one call does the essentials:
# the Triton kernels' and the GPU path's tests on the GPU, then bench/gpu.py on the Qwen3.6-27B shapes, with
# llama.cpp built there meanwhile and run on the same random model if time allows (else by a second call).
#
#   bash bench/gpu_check.sh prepare   # here, with network: wheel, fixtures, Gemma 3 slice, llama.cpp -> .gpu/
#   bash bench/gpu_check.sh run       # there (device run, carry [".gpu"], timeout_s 600); results under $OUT
#   bash bench/gpu_check.sh peer      # there, right after, on the still-warm machine, if `run` left the peer out
#
# The GPU machine has no network and its own python3 with torch and triton (2.11 and 3.6 in the H200 image, not
# our pinned versions), nvcc, cmake and ninja, and every other package mtpserve's model path imports except
# gguf, which travels as a wheel. ../shared does not travel: the fixtures the GPU tests read (tinyqwen35 Q4_K_M
# and Q8_0 and llama.cpp's references, about 17 MB) are copied into .gpu/shared. Gemma 3's file (250 MB) is too
# big to carry: a slice of it travels instead (its first 6 layers and 16384 tokens plus the fixture prompts',
# 34 MB, tests/support/gguf_slice.py), held on the GPU to the CPU path by
# test_a_gemma3_slice_gives_the_cpu_paths_greedy_tokens; the whole-file tests skip there. llama.cpp's source
# (the version our references were made with, from the llama-cpp-python sdist, without the other backends,
# tests and docs: 4 MB) travels as .gpu/llama.cpp.tar.xz.
#
# `run` keeps within one 600 s call: it starts llama.cpp's build in the background (setsid: it outlives the call,
# log in /tmp/llama.cpp-build.log, copied to $OUT), runs the tests (180 s), then the bench (380 s), whose last
# stage waits for llama-bench and runs it on the same weights. bench/gpu.py saves its JSON after each stage (and
# `run` keeps a copy in /tmp), so a cut-short run still returns what it measured, and `peer` can add llama.cpp.
set -uo pipefail
cd "$(dirname "$0")/.."
GGUF_VERSION=$(sed -n 's/^ *"gguf==\([0-9.]*\)".*/\1/p' pyproject.toml)
LLAMA_CPP_PYTHON=0.3.36 # the llama.cpp of ../shared/fixtures' references
SHARED=${MTPSERVE_SHARED:-../shared}
LLAMA_BENCH=/tmp/llama.cpp/build/bin/llama-bench
BUILD_LOG=/tmp/llama.cpp-build.log
RESULTS=/tmp/mtpserve-gpu.json

environment() { # there: the carried gguf wheel, mtpserve's source, the carried fixtures
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        .gpu/whl/*.whl || exit 1
    export PYTHONPATH=/tmp/site:$PWD/src MTPSERVE_SHARED=$PWD/.gpu/shared PYTHONUNBUFFERED=1
    export LD_LIBRARY_PATH=/tmp/cublas${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}  # llama-bench on torch's pip cuBLAS
}

case "${1:-}" in
prepare)
    set -e
    rm -rf .gpu && mkdir -p .gpu/whl .gpu/shared/fixtures/refs .gpu/sdist
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_17_x86_64 -d .gpu/whl "gguf==$GGUF_VERSION"
    cp "$SHARED"/fixtures/tinyqwen35-mtp-Q4_K_M.gguf "$SHARED"/fixtures/tinyqwen35-mtp-Q8_0.gguf .gpu/shared/fixtures/
    cp "$SHARED"/fixtures/refs/*.json .gpu/shared/fixtures/refs/
    PY=python3; [ -x .venv/bin/python ] && PY=.venv/bin/python
    GEMMA=$($PY -c 'from mtpserve.default_models import DEFAULT_MODELS, model_path
print(model_path(DEFAULT_MODELS["gemma3"]))')
    [ -f "$GEMMA" ] || { echo "$GEMMA is missing: run make models first" >&2; exit 1; }
    $PY -m tests.support.gguf_slice "$GEMMA" \
        .gpu/shared/fixtures/gemma-3-270m-q4_k_m.slice6.gguf --ref "$SHARED"/fixtures/refs/gemma-3-270m-q4_k_m.json
    python3 -m pip download -q --no-deps --no-binary :all: -d .gpu/sdist "llama-cpp-python==$LLAMA_CPP_PYTHON"
    tar -xzf .gpu/sdist/llama_cpp_python-*.tar.gz -C .gpu/sdist
    SKIP=(build '.git*' models docs examples tests benches gguf-py media tools/server tools/ui)
    for b in vulkan metal sycl cann opencl webgpu hexagon zdnn zendnn openvino virtgpu et; do
        SKIP+=("ggml/src/ggml-$b")
    done
    tar -cJf .gpu/llama.cpp.tar.xz -C .gpu/sdist/llama_cpp_python-*/vendor "${SKIP[@]/#/--exclude=llama.cpp/}" llama.cpp
    rm -rf .gpu/sdist
    du -sh .gpu
    echo "carry .gpu in the device run: bash bench/gpu_check.sh run"
    ;;
run)
    : "${OUT:?run on the GPU machine, where \$OUT is the folder that comes back}"
    environment
    nvidia-smi >"$OUT/nvidia-smi.txt" 2>&1
    python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__,
        torch.cuda.get_device_name(), torch.cuda.get_device_capability())' 2>&1 | tee "$OUT/versions.txt"
    PEER=()
    if [ -f .gpu/llama.cpp.tar.xz ] && [ ! -e "$LLAMA_BENCH" ]; then
        setsid nohup bash bench/gpu_check.sh build-peer >"$BUILD_LOG" 2>&1 </dev/null &
    fi
    [ -f .gpu/llama.cpp.tar.xz ] && PEER=(--llama-bench "$LLAMA_BENCH" --peer-wait 150 --peer-reps 2 --peer-timeout 120)
    # The GPU path's tests first (token identity); workers in parallel when pytest-xdist is there (the image has it):
    # Triton compiles each kernel configuration on the CPU, once a process, and there are 16 cores.
    XDIST=(); python3 -c 'import xdist' 2>/dev/null && XDIST=(-n 8)
    timeout 180 python3 -m pytest -q -p no:cacheprovider -o addopts='-ra' "${XDIST[@]}" --durations=15 \
        tests/models/test_gpu_path.py tests/kernels/test_triton_gemv.py tests/kernels/test_triton_gemm.py \
        tests/kernels/test_triton_attention.py tests/kernels/test_triton_gated_delta.py 2>&1 | tee "$OUT/tests.log"
    timeout 380 python3 bench/gpu.py --json "$OUT/gpu.json" "${PEER[@]}" 2>&1 | tee "$OUT/bench.log"
    cp "$OUT/gpu.json" "$RESULTS" 2>/dev/null
    cp "$BUILD_LOG" "$OUT/llama.cpp-build.log" 2>/dev/null
    true
    ;;
peer)
    : "${OUT:?run on the GPU machine, where \$OUT is the folder that comes back}"
    environment
    timeout 280 python3 bench/gpu.py --peer-only "$RESULTS" --json "$OUT/gpu.json" --llama-bench "$LLAMA_BENCH" \
        --peer-wait 120 --peer-reps 2 --peer-timeout 100 2>&1 | tee "$OUT/peer.log"
    cp "$BUILD_LOG" "$OUT/llama.cpp-build.log" 2>/dev/null
    true
    ;;
build-peer)
    # llama.cpp's llama-bench for this machine's GPU, as `run` starts it (in the background, below the tests).
    set -ex
    date
    rm -rf /tmp/llama.cpp && tar -xJf .gpu/llama.cpp.tar.xz -C /tmp
    ARCH=${CUDA_ARCH:-$(python3 -c 'import torch; print("%d%d" % torch.cuda.get_device_capability())')}
    FLAGS=(-DCMAKE_BUILD_TYPE=Release -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES="$ARCH" -DGGML_CUDA_NCCL=OFF
        -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF
        -DLLAMA_BUILD_APP=OFF)
    if [ ! -e /usr/local/cuda/lib64/libcublas.so ]; then
        # A toolkit of nvcc without cuBLAS: torch's pip cuBLAS, its headers linked apart from the toolkit's own.
        CU=$(python3 -c 'import glob, os, nvidia
found = sorted(glob.glob(os.path.join(list(nvidia.__path__)[0], "*", "lib", "libcublas.so.*")))
print(os.path.dirname(os.path.dirname(found[0])))')
        mkdir -p /tmp/cublas/include
        ln -sf "$CU"/include/cublas*.h /tmp/cublas/include/
        # Each library under its link name and under the soname the loader asks for (RUNPATH has /tmp/cublas).
        for lib in libcublas libcublasLt; do
            so=$(ls "$CU"/lib/$lib.so.* | head -1)
            ln -sf "$so" /tmp/cublas/$lib.so
            ln -sf "$so" /tmp/cublas/"$(basename "$so")"
        done
        FLAGS+=(-DCUDA_cublas_LIBRARY=/tmp/cublas/libcublas.so -DCUDA_cublasLt_LIBRARY=/tmp/cublas/libcublasLt.so
            -DCMAKE_CUDA_FLAGS=-I/tmp/cublas/include -DCMAKE_CXX_FLAGS=-I/tmp/cublas/include)
    fi
    DRIVER=$(ls /usr/local/cuda/lib64/stubs/libcuda.so /usr/local/nvidia/lib64/libcuda.so* 2>/dev/null | head -1 ||
        true)
    [ -z "$DRIVER" ] && DRIVER=$(ldconfig -p | sed -n 's/.*libcuda\.so\.1 .*=> //p' | head -1)
    if [ -n "$DRIVER" ]; then FLAGS+=(-DCUDA_cuda_driver_LIBRARY="$DRIVER"); else FLAGS+=(-DGGML_CUDA_NO_VMM=ON); fi
    GEN=(); command -v ninja >/dev/null && GEN=(-G Ninja)
    cd /tmp/llama.cpp
    cmake -B build "${GEN[@]}" "${FLAGS[@]}"
    nice -n 10 cmake --build build --target llama-bench -j "$(( $(nproc) > 6 ? $(nproc) - 4 : 2 ))"
    date
    ;;
*)
    echo "usage: bash bench/gpu_check.sh prepare|run|peer" >&2
    exit 2
    ;;
esac
