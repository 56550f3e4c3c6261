#!/usr/bin/env bash
# One-shot GPU check of dflash-kernels, for a machine with one NVIDIA GPU and no network.
#
#   bash bench/gpu_check.sh            # from the repository root (or anywhere: it cds there)
#
# Steps (the whole run is capped at GPU_CHECK_BUDGET_S seconds, default 560, so < 10 minutes):
#   0. fail early unless nvidia-smi lists a GPU and torch.cuda.is_available()
#   1. build:   pip install --no-build-isolation --no-deps -e .  (the extension builds as a
#               CUDAExtension for this GPU's architecture only; checked: built_with_cuda)
#   2. tests:   the kernel tests that put their tensors on CUDA, with Triton compiled for real
#               (DFLASH_TEST_REAL_TRITON=1: no interpreter)
#   3. kernels: bench/gpu_kernel_check.py: every op at Qwen3-8B shapes vs its reference (exact
#               or within bf16 tolerance), plus gather's fraction of copy bandwidth, the fused
#               lm_head ops against the bare GEMM, tree attention against dense-mask SDPA
#      compiled: bench/gpu_compiled_round.py: one draft and one verify round and end-to-end tokens/s at
#               Qwen3-8B shapes (8 layers), eager vs generate(compile=True) (torch.compile + CUDA
#               graphs, set up before the clock); the greedy tokens of both must be equal
#      hybrid:  bench/gpu_hybrid_check.py: a Qwen3.5-27B-shaped stack of 4 layers (Gated-DeltaNet +
#               attention, random bf16 weights): chain verify 16 + rollback and a 65-node tree verify +
#               commit against a plain 1-token decode step (CUDA events); states checked against
#               transformers' own step-by-step decode
#   4. micro:   the pytest-benchmark suite in bench/ at real model shapes, random weights
#   5. round:   bench/gpu_round_latency.py: one DFlash / DDTree verify round at Qwen3-8B shapes
#               (target cut to 8 of 36 layers): our path, our path with the pre-redesign dense-mask
#               SDPA attention, and the plain-torch path: the table
#      syncs:   bench/gpu_round_syncs.py: host syncs per round of ar / dflash / ddtree at Qwen3-8B
#               shapes (4 layers), by torch.cuda.set_sync_debug_mode and by the host-read counter
#      stress:  bench/gpu_compaction_stress.py: thousands of adversarial accepted paths through
#               compact_kv_ at Qwen3-8B cache shapes against the reference (the race fix)
#      families: bench/gpu_family_check.py: gpt-oss-20b- (sinks, alternating 128-token windows,
#               MoE), Gemma3- (5:1 local/global windows, rope per layer type) and Gemma2-shaped
#               (softcaps) layer stacks, random bf16 weights: prefill + chain verify + tree verify
#               through our adapter vs the model's own forward (relative error bound)
#   6. e2e:     python -m dflash bench on the embedded tiny pair, fp32, T = 0: every method's
#               output must equal plain decoding's token for token
# Exit status: 0 when every step passed; 1 when any failed (a kernel result differing from its
# reference fails step 3, 5 or 2; a family stack off its model's forward fails families), timed out, or had no time left; JSON and logs go to $OUT
# when set, else bench/results/gpu_check/.
set -uo pipefail

cd "$(dirname "$0")/.." || exit 1
PY=${PYTHON:-python}
BUDGET_S=${GPU_CHECK_BUDGET_S:-560}
OUT_DIR=${OUT:-bench/results/gpu_check}

die() {
    echo "gpu_check: FAIL: $*" >&2
    exit 1
}

# ---------------------------------------------------------------- 0. a GPU, or stop now
if ! command -v nvidia-smi >/dev/null 2>&1; then
    die "no NVIDIA GPU visible: nvidia-smi is not on PATH. This check needs a machine with one NVIDIA GPU and its driver."
fi
GPUS=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ' || true)
if [ "${GPUS:-0}" -lt 1 ]; then
    die "no NVIDIA GPU visible: 'nvidia-smi -L' lists no GPU (driver not loaded, or CUDA_VISIBLE_DEVICES hides them)."
fi
# one python start: "ARCH|NAME" when CUDA works, else "none|torch version" (or the import error)
PROBE=$("$PY" -c 'import torch
if torch.cuda.is_available():
    print("%d.%d|%s" % (torch.cuda.get_device_capability(0) + (torch.cuda.get_device_name(0),)))
else:
    print("none|torch %s, CUDA %s" % (torch.__version__, torch.version.cuda))' 2>&1 | tail -n 1)
ARCH=${PROBE%%|*}
GPU_NAME=${PROBE#*|}
if [ "$ARCH" = "$PROBE" ]; then
    die "nvidia-smi sees ${GPUS} GPU(s) but '$PY' cannot import torch: ${PROBE}"
fi
if [ "$ARCH" = "none" ]; then
    die "nvidia-smi sees ${GPUS} GPU(s) but torch.cuda.is_available() is False (${GPU_NAME}); install a CUDA build of torch that matches the driver."
fi
if [ "$GPUS" -gt 1 ]; then
    echo "gpu_check: ${GPUS} GPUs visible; everything runs on cuda:0"
fi
mkdir -p "$OUT_DIR" || die "cannot create $OUT_DIR"
echo "gpu_check: ${GPU_NAME} (sm_${ARCH/./}), output in ${OUT_DIR}, time budget ${BUDGET_S}s"

# ---------------------------------------------------------------- step runner
NAMES=()
STATES=()
TIMES=()
FAILED=0

record() {  # name state seconds
    NAMES+=("$1")
    STATES+=("$2")
    TIMES+=("$3")
    if [ "$2" != "ok" ]; then
        FAILED=1
    fi
}

step() {  # name limit_s command...
    local name=$1 limit=$2
    shift 2
    local remaining=$((BUDGET_S - SECONDS))
    if [ "$remaining" -lt 15 ]; then
        echo "== [$name] SKIPPED: no time left in the ${BUDGET_S}s budget" >&2
        record "$name" "no time" 0
        return 1
    fi
    if [ "$limit" -gt "$remaining" ]; then
        limit=$remaining
    fi
    echo "== [$name] $* (limit ${limit}s)"
    local t0=$SECONDS rc
    timeout --kill-after=10 "$limit" "$@" 2>&1 | tee "$OUT_DIR/$name.log"
    rc=${PIPESTATUS[0]}
    local dt=$((SECONDS - t0))
    if [ "$rc" -eq 0 ]; then
        record "$name" ok "$dt"
    elif [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
        echo "== [$name] TIMEOUT after ${limit}s" >&2
        record "$name" "TIMEOUT" "$dt"
    else
        echo "== [$name] FAILED (exit $rc), log: $OUT_DIR/$name.log" >&2
        record "$name" "FAIL ($rc)" "$dt"
    fi
    return "$rc"
}

summary() {
    echo
    echo "== gpu_check summary (${GPU_NAME}, ${SECONDS}s)"
    printf '%-10s %-12s %6s\n' step result seconds
    local i
    for i in "${!NAMES[@]}"; do
        printf '%-10s %-12s %6s\n' "${NAMES[$i]}" "${STATES[$i]}" "${TIMES[$i]}"
    done
    if [ "$FAILED" -ne 0 ]; then
        echo "gpu_check: FAIL (see the logs in $OUT_DIR)" >&2
    else
        echo "gpu_check: all steps passed; JSON in $OUT_DIR"
    fi
}

# ---------------------------------------------------------------- 1. build for this GPU
if ! step build 240 env TORCH_CUDA_ARCH_LIST="$ARCH" MAX_JOBS="$(nproc)" \
        "$PY" -m pip install --no-build-isolation --no-deps --no-index -e .; then
    summary
    die "the extension did not build (the later steps need it)"
fi
CUDA_EXT_CHECK='import sys, dflash_kernels._C as C; n = C.cuda_device_count() if C.built_with_cuda else 0; print("dflash_kernels._C: CUDAExtension, sees %d GPU(s)" % n if C.built_with_cuda else "dflash_kernels._C: CppExtension only (no CUDA toolkit at build time: set CUDA_HOME to one with nvcc)"); sys.exit(0 if n >= 1 else 1)'
step cuda-ext 30 "$PY" -c "$CUDA_EXT_CHECK"

# ---------------------------------------------------------------- 2. kernel tests, real Triton
# Only test files that move their tensors to CUDA when it is available can test compiled kernels
# (real Triton cannot run CPU tensors); a file that never mentions cuda is left out and said so.
# Step 3 checks every op on the GPU in any case.
KERNEL_TESTS=()
for f in tests/test_gather.py tests/test_lm_head.py tests/test_tree_attention.py tests/test_ancestor_bits.py \
         tests/test_kv_compaction.py tests/test_tree_build.py tests/test_tree_device.py tests/test_extension.py \
         tests/test_device_lengths.py tests/test_gated_delta.py; do
    if [ -f "$f" ] && grep -q 'cuda' "$f"; then
        KERNEL_TESTS+=("$f")
    else
        echo "gpu_check: leaving out $f: its tensors stay on the CPU (step 3 covers its ops)"
    fi
done
step tests 180 env DFLASH_TEST_REAL_TRITON=1 "$PY" -m pytest -q -p no:cacheprovider "${KERNEL_TESTS[@]}"

# ---------------------------------------------------------------- 3. every op vs reference at real shapes
step kernels 120 "$PY" bench/gpu_kernel_check.py --model qwen3-8b --json "$OUT_DIR/gpu_kernel_check.json"

# ---------------------------------------------------------------- 3b. compiled rounds: eager vs CUDA graphs
step compiled 150 "$PY" bench/gpu_compiled_round.py --layers 8 --prompt-len 512 --max-new-tokens 64 \
    --json "$OUT_DIR/gpu_compiled_round.json"

# ---------------------------------------------------------------- 3c. hybrid targets: verify + rollback
step hybrid 60 "$PY" bench/gpu_hybrid_check.py --json "$OUT_DIR/gpu_hybrid_check.json"

# ---------------------------------------------------------------- 4. microbenchmarks, real shapes
step micro 100 "$PY" -m pytest bench -q -p no:cacheprovider --benchmark-json="$OUT_DIR/micro.json" \
    --benchmark-max-time=0.1 --benchmark-min-rounds=3 --benchmark-columns=median,rounds

# ---------------------------------------------------------------- 5. one round, our path vs plain torch
step round 120 "$PY" bench/gpu_round_latency.py --layers 8 --prefix 4096 --budgets 64,256 \
    --json "$OUT_DIR/gpu_round_latency.json"

step syncs 90 "$PY" bench/gpu_round_syncs.py --layers 4 --json "$OUT_DIR/gpu_round_syncs.json"
step stress 60 "$PY" bench/gpu_compaction_stress.py --cases 3000
step families 60 "$PY" bench/gpu_family_check.py --json "$OUT_DIR/gpu_family_check.json"

# ---------------------------------------------------------------- 6. end to end, lossless on the GPU
step e2e 90 "$PY" -m dflash bench --device cuda --dtype float32 --num-prompts 2 --max-new-tokens 48 \
    --temperatures 0 --budgets 4,16 --methods ar,dflash,ddtree,hf,prompt-lookup --no-progress \
    --out "$OUT_DIR/e2e"

summary
exit "$FAILED"
