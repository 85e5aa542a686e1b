#!/usr/bin/env bash
# The CUDA backend's check on a lent GPU machine (issues #8, #19), in stages that cannot waste the window: each runs
# under its own `timeout`, in its own error boundary (a failing or timed-out stage records its exit, its
# traceback and log in its file, and the next stage still runs), and writes its results under $OUT as they come.
#
#   bash bench/gpu_check.sh prepare   # here, with network: wheel, fixtures, Gemma 3 slice, llama.cpp -> .gpu/
#   bash bench/gpu_check.sh run       # there (device run, carry [".gpu"], timeout_s 600); results under $OUT
#   bash bench/gpu_check.sh peer      # there, right after, on the still-warm machine, if `run` left the peer out
#   bash bench/gpu_check.sh prepare-peer   # here (nvcc, network, ~30 min): llama-bench for sm_90 -> .gpu-peer/
#   bash bench/gpu_check.sh peer      # there, a second call with carry [".gpu-peer"] (the first call's decode.json
#                                     # copied into .gpu-peer/): llama.cpp on the same model, no build there
#   OUT=/tmp/x bash bench/gpu_check.sh run   # here: a stand-in run, every GPU stage skipped ("no CUDA device")
#
# A window's plan (15 minutes of device time in all, starts included): `prepare` (and `prepare-peer` unless
# .gpu-peer/llama.cpp-sm90.tar.xz is there already) before asking for the device; device `run` of
# `bash bench/gpu_check.sh run`, carry [".gpu"], timeout_s 600, kind nvidia-h200 (the first run's card: every number
# then compares with it and with the time model's H200 rows; an H100 where a refusal offers only that: the same
# GH100 SMs and clocks, so latency-bound kernels run at the same TB/s and read as larger fractions of its 3.35;
# the time model's `predicted_other` has its rows, and bench/gpu_calibrated.py fits a run on it as its own card);
# copy the decode.json it returns into .gpu-peer/; if at least 5 minutes are left, device `run` of
# `bash bench/gpu_check.sh peer`, carry [".gpu-peer"], timeout_s 300; then give_back.
#
# `run`'s stages, in order (limit: its `timeout`, each also cut to what is left of the call's budget, 560 s):
#   env    30 s  env.txt    nvidia-smi, python/torch/triton/CUDA versions, the device, its capability, free memory and
#                           L2, the git commit when .git travelled, the stage plan; each stage's outcome is appended
#                           as it ends, so env.txt is also the run's index. llama.cpp's build starts here (setsid, in
#                           the background: it outlives the call, log /tmp/llama.cpp-build.log).
#   smoke 120 s  smoke.txt  bench/gpu_smoke.py: every Triton wrapper of mtpserve.kernels.triton once at the 27B's
#                           shapes against its PyTorch twin, and one CUDA graph capture + replay of a small model's
#                           decode step against eager: a PASS/FAIL/SKIP line per case (~60 s, most of it compiling).
#   bench 260 s  bench.txt  most wanted first: bench/gpu.py -> decode.json: decode tok/s at depths 4096 and 65536, with
#                decode.json draft-mtp (n_max 2) and without, with and without the matmuls (their time apart from the
#                gemv.json  small kernels'), with the few-row GEMVs split 4 ways along K (a decode step and a
#                           verification), with the K-quant GEMVs prefetching their weights 2 steps ahead into L2
#                           (alone, with the split, with PDL; first depth), with programmatic dependent launch (its
#                           logits held to the plain graph's bit for bit), with the decode attention choices
#                           ($ATTENTION_CHOICES), kernels launched per token, a per-kernel table (torch.profiler)
#                           of one graphed decode step and one MTP cycle at each depth, printed as made, then
#                           prefill of 8192 tokens (one model build); then
#                           bench/gemv_l2.py --integer-only -> gemv.json: the integer GEMV and its tile's
#                           choices (K splits and L2 prefetch first) with weights rotated through > 2x L2, timed in
#                           a CUDA graph (GB/s, fraction of a copy's; any error row fails the stage), each choice on
#                           every matrix, none begun after 60 s; then bench/gpu_ncu.py: Nsight Compute's
#                           counters (occupancy and its limits, DRAM throughput, issue, warp stalls) of the GEMVs
#                           and attention kernels whose speed the first run left unexplained, none begun after
#                           45 s, in bench.txt; then bench/attention_gpu.py: decode attention's choices alone
#                           (operands, tile, warps, split size, rows a program) at 4096 and 65536 tokens, the
#                           likeliest cures first and none begun after 60 s (gpu.py has timed the GPU check's
#                           choices in the captured steps already), its table in bench.txt; then, if the stage has
#                           time left, bench/attention_layouts.py --time: decode attention prototypes by cache
#                           layout and QK arithmetic beside the server's kernel, none begun after 40 s, in bench.txt.
#   tests 150 s  tests.txt  pytest on tests/kernels, tests/models/test_gpu_path.py, tests/ops, the slow tests too (8
#                           xdist workers when the image has xdist; --timeout per test when it has pytest-timeout); -v
#                           names each test's outcome as it ends, the -ra summary every failure again. Then the GPU
#                           path's tests again with MTPSERVE_CUDA_CAPABILITY=7.5: the RTX 2080 Ti's branches on this
#                           GPU (if the stage's time runs out first, GPU_CHECK_STAGES="env tests"
#                           GPU_CHECK_TIMEOUT_TESTS=400 on the warm machine runs both).
#   rest  (what is left)    rest.txt, gpu.json: bench/gpu.py's parts the bench stage left out (4 sequences at once,
#                           the chunk scan, memory at 262144 tokens), then llama.cpp's llama-bench against the bench
#                           stage's rows (into decode.json) only if its build has already finished (else "peer
#                           skipped: build not finished"; no waiting), and the build log's tail.
# At most 8 files come back (the device's limit). The first H200 run (2026-12-04) took env 12 s, smoke 108 s, bench
# ~80 s (decode, MTP, prefill, GEMVs), tests over 170 s (cut at 99% of the native pass; the sm_75 pass alone 53 s);
# the limits add to the 560 s budget; `rest` gets the remainder and, from a first call, rarely finishes: a second
# call, on the still-warm machine (the build kept running), runs it alone with the whole budget:
# GPU_CHECK_STAGES="env rest" bash bench/gpu_check.sh run (then `peer` if llama.cpp was still building). The build
# there takes longer than a call (285 objects; at 142 when the first window ended), and a machine idle for 30 s is
# given back with it, so the peer's sure way is a build made here: `prepare-peer` packs llama-bench for sm_90 (the
# H100 and the H200) with its libraries, built against CUDA 13 and pip's cuBLAS (the image's torch brings
# libcublas.so.13), portable CPU code, into .gpu-peer (41 MB, under the 64 MiB a call carries), and a second call
# carrying it runs `peer`: the random 27B-shaped model written as GGUF and llama-bench on it, ~4 minutes.
#
# Switches (environment): GPU_CHECK_STAGES (default "env smoke bench tests rest"), GPU_CHECK_TIMEOUT_<STAGE> (seconds,
# e.g. GPU_CHECK_TIMEOUT_SMOKE=60), GPU_CHECK_BUDGET (560: the call's seconds in all), GPU_CHECK_FAIL (stages that
# fail on purpose, "smoke" or "smoke:hang", comma-separated: the error boundaries' test), GPU_CHECK_PYTHON.
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
set -uo pipefail
cd "$(dirname "$0")/.."
GGUF_VERSION=$(sed -n 's/^ *"gguf==\([0-9.]*\)".*/\1/p' pyproject.toml)
LLAMA_CPP_PYTHON=0.3.36 # the llama.cpp of ../shared/fixtures' references
SHARED=${MTPSERVE_SHARED:-../shared}
LLAMA_BENCH=${GPU_CHECK_LLAMA_BENCH:-/tmp/llama.cpp/build/bin/llama-bench}
PEER=${GPU_CHECK_PEER_DIR:-.gpu-peer} # prepare-peer's llama-bench for the lent GPU, carried by a second call
CUBLAS=${GPU_CHECK_CUBLAS_LINKS:-/tmp/cublas} # cuBLAS and the CUDA runtime under the names llama.cpp links and loads
BUILD_LOG=/tmp/llama.cpp-build.log
RESULTS=/tmp/mtpserve-gpu.json
STAGES=${GPU_CHECK_STAGES:-env smoke bench tests rest}
GPU_CHECK_FAIL=${GPU_CHECK_FAIL:-}
BUDGET=${GPU_CHECK_BUDGET:-560}
# The decode attention choices bench/gpu.py times in the captured decode step and verification (the first run's
# latency: more programs, more programs an SM, both; a verification's rows in one block; the default before a decode
# step took 8-row blocks), bench/attention_gpu.py's names
ATTENTION_CHOICES="int8 min64,int8 min32,mma,mma16,ieee min16,fp16 s16 w2 min16,fp16 m32 w8"
declare -A LIMIT=([env]=30 [smoke]=120 [bench]=260 [tests]=150 [rest]=0)  # rest: whatever the budget has left
declare -A FILE=([env]=env.txt [smoke]=smoke.txt [bench]=bench.txt [tests]=tests.txt [rest]=rest.txt)
declare -A NEEDS_GPU=([env]=0 [smoke]=1 [bench]=1 [tests]=1 [rest]=1)

# The python that holds torch: the image's python3 there; here (a stand-in run) the venv's when python3 has none.
PY=${GPU_CHECK_PYTHON:-python3}
if [ -z "${GPU_CHECK_PYTHON:-}" ] && ! python3 -c 'import torch' 2>/dev/null && [ -x .venv/bin/python ]; then
    PY=.venv/bin/python
fi

environment() { # there: the carried gguf wheel, mtpserve's source, the carried fixtures (when they travelled)
    if ! "$PY" -c 'import gguf' 2>/dev/null; then
        local wheel
        wheel=$(ls .gpu/whl/*.whl "$PEER"/whl/*.whl 2>/dev/null | head -n 1)
        if [ -z "$wheel" ]; then
            echo "no gguf for $PY and no .gpu/whl or $PEER/whl: run prepare (or prepare-peer) here" >&2
            return 1
        fi
        "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
            "$wheel" || return 1
        export PYTHONPATH=/tmp/site
    fi
    export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD/src PYTHONUNBUFFERED=1
    [ -d .gpu/shared ] && export MTPSERVE_SHARED=$PWD/.gpu/shared
    # llama-bench on torch's pip cuBLAS ($CUBLAS), a carried build's libraries beside it
    export LD_LIBRARY_PATH=$CUBLAS:${LLAMA_BENCH%/*}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
    return 0
}

cublas_links() { # $CUBLAS: cuBLAS's headers and libraries under the names a build links and a binary loads
    local cu=${CUBLAS_DIR:-}
    if [ -z "$cu" ]; then # torch's pip cuBLAS (the lent image's toolkit has nvcc without cuBLAS)
        cu=$(python3 -c 'import glob, os, nvidia
found = sorted(glob.glob(os.path.join(list(nvidia.__path__)[0], "*", "lib", "libcublas.so.*")))
print(os.path.dirname(os.path.dirname(found[0])))') || return 1
    fi
    mkdir -p "$CUBLAS"/include
    ln -sf "$cu"/include/cublas*.h "$CUBLAS"/include/
    local lib so
    for lib in libcublas libcublasLt; do # the link name and the soname the loader asks for
        so=$(ls "$cu"/lib/$lib.so.* | head -n 1)
        ln -sf "$so" "$CUBLAS"/$lib.so
        ln -sf "$so" "$CUBLAS"/"$(basename "$so")"
    done
    # the CUDA runtime a carried build loads: pip's beside its cuBLAS (torch's own), else the toolkit's
    so=$(ls "$cu"/lib/libcudart.so.[0-9]* /usr/local/cuda/lib64/libcudart.so.[0-9]* 2>/dev/null | head -n 1)
    [ -z "$so" ] || ln -sf "$so" "$CUBLAS"/"$(basename "$so")"
}

unpack_peer() { # a llama-bench built here for this GPU (prepare-peer), where none was built there
    local packed=$PEER/llama.cpp-sm${CUDA_ARCH:-90}.tar.xz
    [ -e "$LLAMA_BENCH" ] || [ ! -f "$packed" ] && return 0
    mkdir -p "${LLAMA_BENCH%/*}" && tar -xJf "$packed" -C "${LLAMA_BENCH%/*}" && cublas_links
    if "$LLAMA_BENCH" --help >/dev/null 2>&1; then
        echo "llama.cpp peer: the build carried in $packed"
    else
        echo "llama.cpp peer: the carried build does not run here:"
        "$LLAMA_BENCH" --help 2>&1 | tail -n 3
        rm -f "$LLAMA_BENCH"
    fi
}

now() { date -u +%FT%TZ; }

injected() { # whether GPU_CHECK_FAIL names stage $1 (prints "fail" or "hang")
    local item
    for item in ${GPU_CHECK_FAIL//,/ }; do
        [ "${item%%:*}" = "$1" ] && { [ "$item" = "$1:hang" ] && echo hang || echo fail; return 0; }
    done
    return 1
}

stage_body() { # one stage's work, run by `run` as `bash bench/gpu_check.sh stage NAME` under its timeout
    local how
    if how=$(injected "$1"); then
        echo "GPU_CHECK_FAIL=$GPU_CHECK_FAIL: stage $1 fails on purpose ($how)"
        [ "$how" = hang ] && exec sleep 3600
        exec "$PY" -c "raise RuntimeError('injected failure in stage $1 (GPU_CHECK_FAIL)')"
    fi
    case "$1" in
    env)
        echo "date $(now)  host $(uname -srm)  python $PY: $("$PY" -V 2>&1)"
        if [ -d .git ] && command -v git >/dev/null; then
            echo "git commit $(git rev-parse HEAD 2>&1), $(git status --short 2>/dev/null | wc -l) paths changed"
        else
            echo "git commit: unavailable (the tree was copied without .git)"
        fi
        echo "stages (limit in s): $(for s in $STAGES; do echo -n "$s ${LIMIT[$s]/#0/what is left}, "; done)" \
            "budget ${BUDGET} s"
        echo "pytest plugins: xdist $("$PY" -c 'import xdist' 2>/dev/null && echo yes || echo no), pytest-timeout $(
            "$PY" -c 'import pytest_timeout' 2>/dev/null && echo yes || echo no)"
        if [ -e "$LLAMA_BENCH" ]; then echo "llama.cpp peer: built ($LLAMA_BENCH)"
        elif [ -f .gpu/llama.cpp.tar.xz ]; then echo "llama.cpp peer: building in the background (log $BUILD_LOG)"
        else echo "llama.cpp peer: no .gpu/llama.cpp.tar.xz: not run"; fi
        "$PY" - <<'PY'
import torch
print("torch", torch.__version__, "CUDA", torch.version.cuda, "cuDNN", torch.backends.cudnn.version())
try:
    import triton
    print("triton", triton.__version__)
except ImportError as e:
    print("triton: not importable:", e)
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    free, total = torch.cuda.mem_get_info(0)
    print(f"device {p.name}, capability {p.major}.{p.minor}, {p.multi_processor_count} SMs, "
          f"L2 {getattr(p, 'L2_cache_size', 0) / 2**20:.0f} MiB, memory {free / 2**30:.1f} GiB free of "
          f"{total / 2**30:.1f} GiB, {torch.cuda.device_count()} device(s)")
else:
    print("device: none visible to torch")
PY
        echo "--- nvidia-smi"
        if command -v nvidia-smi >/dev/null; then nvidia-smi 2>&1; else echo "nvidia-smi: not found"; fi
        ;;
    smoke)
        "$PY" bench/gpu_smoke.py
        ;;
    bench)
        # Two runs, each run whatever the other did; the stage fails if either does. The numbers the project lacks
        # first: decode and the MTP cycle at two depths, then prefill, in one model build (a second build of the
        # 27B-shaped model would cost the stage more than the GEMVs' order is worth), then the GEMV calibration.
        local rc=0
        "$PY" bench/gpu.py --parts decode,mtp,prefill --contexts 4096,65536 --prefill 8192 --batch 1 --memory-ctx 0 \
            --split-matmuls --gemv-k-splits 4 --gemv-l2-ahead 2 --pdl --attention-choices "$ATTENTION_CHOICES" \
            --json "$OUT/decode.json" \
            || rc=$?
        cp "$OUT/decode.json" "$RESULTS" 2>/dev/null  # what llama.cpp's rows are compared with (rest, peer)
        # the integer GEMV and its tiles' choices, each on every matrix, none begun after 60 s
        "$PY" bench/gemv_l2.py --integer-only --budget-s 60 --json "$OUT/gemv.json" || rc=$?
        "$PY" bench/gpu_ncu.py --budget-s 45 || rc=$?  # why they run at the speed they do: ncu's counters
        # decode attention's choices alone (its table in bench.txt: 8 files at most come back), none begun after
        # 60 s; the captured steps above timed the check's choices already
        "$PY" bench/attention_gpu.py --budget-s 60 || rc=$?
        # what the planar cache layout and an int8 QK would buy (docs/gpu-decode.md), last: cut first by the limit
        "$PY" bench/attention_layouts.py --time 4096,65536 --budget-s 40 || rc=$?
        return $rc
        ;;
    tests)
        # every GPU-path test, the slow ones too (cheap on a GPU: the deployed configuration's graph captures, the
        # Gemma slice), each named with its outcome as it ends (-v), not only in the summary at exit
        local args=(-v -p no:cacheprovider -m '' -ra --durations=15 --tb=short)
        "$PY" -c 'import xdist' 2>/dev/null && args+=(-n 8)  # Triton compiles each configuration once a process
        "$PY" -c 'import pytest_timeout' 2>/dev/null && args+=(--timeout=120)  # else only the stage's own timeout
        "$PY" -m pytest "${args[@]}" tests/kernels tests/models/test_gpu_path.py tests/ops
        local native=$?
        # Then the RTX 2080 Ti's branches on this GPU (kernels/capability.py): fp16 prompt GEMMs through cuBLAS, the
        # PyTorch chunk loop, SDPA in fp16 at D = 256, the GEMM's 8 warps, against the same twins and references.
        echo "--- again with MTPSERVE_CUDA_CAPABILITY=7.5: the sm_75 branches"
        MTPSERVE_CUDA_CAPABILITY=7.5 "$PY" -m pytest "${args[@]}" tests/models/test_gpu_path.py tests/ops \
            tests/kernels/test_triton_gemm.py tests/kernels/test_triton_gated_delta.py
        local turing=$?
        return $((native != 0 ? native : turing))
        ;;
    rest)
        # What the bench stage left out (several sequences at once, the chunk scan, memory at 262144 tokens), then
        # llama.cpp on the same model against the bench stage's rows, into decode.json, if its build has finished.
        "$PY" bench/gpu.py --parts batch,chunk_scan,memory --contexts 4096 --json "$OUT/gpu.json"
        local rc=$?
        if [ -x "$LLAMA_BENCH" ] && [ -f "$RESULTS" ]; then
            "$PY" bench/gpu.py --peer-only "$RESULTS" --prefill 8192 --json "$OUT/decode.json" \
                --llama-bench "$LLAMA_BENCH" --peer-reps 2 --peer-timeout 100 || rc=$?
        elif [ -f .gpu/llama.cpp.tar.xz ]; then
            echo "peer skipped: build not finished (no $LLAMA_BENCH yet; a later \`peer\` call adds it)"
        else
            echo "peer skipped: no .gpu/llama.cpp.tar.xz (run prepare here)"
        fi
        [ -f "$BUILD_LOG" ] && { echo "--- llama.cpp build log, last lines"; tail -n 15 "$BUILD_LOG"; }
        return $rc
        ;;
    *)
        echo "unknown stage $1" >&2
        return 2
        ;;
    esac
}

run_stage() { # runs stage $1 in its own error boundary: its outcome is the last line of its file and a line of env.txt
    local name=$1 file=$OUT/${FILE[$1]} start=$SECONDS limit left outcome rc
    left=$((BUDGET - (SECONDS - RUN_START)))
    limit=${LIMIT[$name]}
    limit=$(eval echo "\${GPU_CHECK_TIMEOUT_${name^^}:-$limit}")
    [ "$limit" -le 0 ] || [ "$limit" -gt "$left" ] && limit=$left
    echo "== $name: started $(now), limit ${limit} s" >>"$file"
    if ! injected "$name" >/dev/null && [ "${NEEDS_GPU[$name]}" = 1 ] && [ -n "$NO_GPU" ]; then
        outcome="SKIPPED: $NO_GPU"
    elif [ "$left" -lt 10 ]; then
        outcome="SKIPPED: no time left (${left} s of the ${BUDGET} s budget)"
    else
        timeout -k 10 "$limit" bash bench/gpu_check.sh stage "$name" >>"$file" 2>&1 </dev/null
        rc=$?
        case $rc in
        0) outcome="PASSED in $((SECONDS - start)) s" ;;
        124 | 137) outcome="TIMED OUT after $((SECONDS - start)) s (its limit ${limit} s); its log is above" ;;
        *) outcome="FAILED (exit $rc) after $((SECONDS - start)) s; its traceback/log is above" ;;
        esac
    fi
    echo "== $name: $outcome" >>"$file"
    [ "$name" = env ] || echo "stage $name: $outcome" >>"$OUT/env.txt"
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
    RUN_START=$SECONDS
    if environment >>"$OUT/env.txt" 2>&1; then
        NO_GPU=$(timeout 60 "$PY" -c 'import torch
print("" if torch.cuda.is_available() else "no CUDA device (torch %s sees none)" % torch.__version__)' 2>&1 |
            tail -n 1)
        [ -n "$NO_GPU" ] && [[ "$NO_GPU" != "no CUDA device"* ]] &&
            NO_GPU="no CUDA device (torch did not load: $NO_GPU)"
    else
        NO_GPU="no CUDA device checked: the environment failed (env.txt)"
    fi
    # llama.cpp builds beside the stages (its log there already: a build this machine started earlier).
    if [ -z "$NO_GPU" ] && [ -f .gpu/llama.cpp.tar.xz ] && [ ! -e "$LLAMA_BENCH" ] && [ ! -f "$BUILD_LOG" ]; then
        setsid nohup bash bench/gpu_check.sh build-peer >"$BUILD_LOG" 2>&1 </dev/null &
    fi
    export OUT PY STAGES BUDGET
    for stage in env smoke bench tests rest; do
        [[ " $STAGES " == *" $stage "* ]] && run_stage "$stage"
    done
    true
    ;;
stage) # one of run's stages (run calls it under the stage's timeout)
    stage_body "$2"
    ;;
peer)
    : "${OUT:?run on the GPU machine, where \$OUT is the folder that comes back}"
    environment
    unpack_peer 2>&1 | tee "$OUT/peer.log"
    # the bench stage's rows: this machine's from `run`, else the first call's decode.json carried in .gpu-peer
    results=$RESULTS
    [ -f "$results" ] || results=$PEER/decode.json
    echo "llama.cpp peer: against the bench stage's rows in $results" | tee -a "$OUT/peer.log"
    timeout 280 "$PY" bench/gpu.py --peer-only "$results" --prefill 8192 --json "$OUT/decode.json" \
        --llama-bench "$LLAMA_BENCH" \
        --peer-wait 120 --peer-reps 2 --peer-timeout 100 2>&1 | tee -a "$OUT/peer.log"
    cp "$BUILD_LOG" "$OUT/llama.cpp-build.log" 2>/dev/null
    true
    ;;
prepare-peer)
    # Here, with network and nvcc: llama.cpp's llama-bench built for the lent GPU (CUDA_ARCH, default 90: the H100
    # and the H200) against pip's cuBLAS for CUDA 13, packed with the gguf wheel into .gpu-peer (carried by a second
    # device call that runs `peer`; the first call's decode.json goes beside it). A build already in /tmp/llama.cpp
    # for that arch is packed as it is. About 30 minutes on 2 cores.
    set -e
    CUDA_ARCH=${CUDA_ARCH:-90}
    export CUDA_ARCH
    mkdir -p "$PEER"/whl
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_17_x86_64 -d "$PEER"/whl "gguf==$GGUF_VERSION"
    if ! grep -Eq "^CMAKE_CUDA_ARCHITECTURES:[A-Z]+=$CUDA_ARCH\$" /tmp/llama.cpp/build/CMakeCache.txt 2>/dev/null ||
        [ ! -x "$LLAMA_BENCH" ]; then
        [ -f .gpu/llama.cpp.tar.xz ] || { echo "no .gpu/llama.cpp.tar.xz: run prepare first" >&2; exit 1; }
        mkdir -p /tmp/cublas-wheel
        python3 -m pip download -q --no-deps -d /tmp/cublas-wheel "nvidia-cublas>=13.0,<13.1"
        python3 -m zipfile -e /tmp/cublas-wheel/nvidia_cublas-*.whl /tmp/cublas-wheel/x
        CUBLAS_DIR=$(ls -d /tmp/cublas-wheel/x/nvidia/cu13) PORTABLE=1 bash bench/gpu_check.sh build-peer
    fi
    (cd "${LLAMA_BENCH%/*}" && tar -cJf - llama-bench lib*.so*) >"$PEER"/llama.cpp-sm$CUDA_ARCH.tar.xz
    du -sh "$PEER"
    echo "then: the first call's decode.json into .gpu-peer/, and a device call with carry [\".gpu-peer\"]:"
    echo "bash bench/gpu_check.sh peer"
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
    [ -n "${PORTABLE:-}" ] && FLAGS+=(-DGGML_NATIVE=OFF)  # prepare-peer: for another machine's CPU
    if [ ! -e /usr/local/cuda/lib64/libcublas.so ]; then
        # A toolkit of nvcc without cuBLAS: pip's cuBLAS, its headers linked apart from the toolkit's own.
        cublas_links
        FLAGS+=(-DCUDA_cublas_LIBRARY=$CUBLAS/libcublas.so -DCUDA_cublasLt_LIBRARY=$CUBLAS/libcublasLt.so
            -DCMAKE_CUDA_FLAGS=-I$CUBLAS/include -DCMAKE_CXX_FLAGS=-I$CUBLAS/include)
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
