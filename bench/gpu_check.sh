#!/usr/bin/env bash
# One-shot GPU check of dflash-kernels, for a machine with one NVIDIA GPU and no network.
#
#   bash bench/gpu_check.sh                        # from anywhere: it cds to the repository root
#   OUT=/results PYTHON=python3.12 bash bench/gpu_check.sh
#   GPU_CHECK_DRY_RUN=1 bash bench/gpu_check.sh    # on a CPU machine: every step's Python, tiny shapes
#   GPU_CHECK_STEPS=hybrid,e2e bash bench/gpu_check.sh   # only those steps (a second, shorter lease)
#
# Time: the whole run stays inside GPU_CHECK_BUDGET_S seconds (default 540). PLAN below gives each
# step a limit; the limits add up to at most the budget, and the plan and its sum ("planned device
# time: N s") are printed first. A step may also use what the steps before it left unused, never
# the time the steps after it are planned to get; it ends with SIGTERM when its time is up (a pytest
# step then still writes its report), and with SIGKILL 5 s later. Steps in order of value, so a run
# cut short loses the least:
#   probe:    (before the steps) nvidia-smi lists a GPU and torch.cuda.is_available(); else stop at once
#   build:    pip install --no-build-isolation --no-deps --no-index -e .  (the C++ extension, its
#             sources compiled in parallel, MAX_JOBS=$(nproc)); then dflash_kernels._C must import
#   kernels:  bench/gpu_kernel_check.py: every op at Qwen3-8B shapes against its reference (exact, or
#             within bf16 tolerance), plus gather's fraction of copy bandwidth, the fused lm_head ops
#             against the bare GEMM, tree attention against dense-mask SDPA
#   headline: bench/headline.py: the headline table at Qwen3-8B shapes (36 layers, bf16, a 5-layer drafter steered
#             to a chosen tau): tokens/s of transformers' AR, ours ar / dflash / ddtree, the drop-in and the carried
#             references (GPU_CHECK_REF_SRC; "not carried" otherwise, never a failure), each against the limit its
#             acceptance allows, peak memory, greedy tokens against transformers'. The default is scaled down to
#             its limit (one 512-token prompt, 64 new tokens, tau 6, eager rows; a row that does not fit is
#             skipped); GPU_CHECK_HEADLINE_ARGS adds arguments: "--full" is the whole table (prompts 512 and
#             4096, 256 new tokens, tau 3 / 6 / 9, compiled rows too), one prompt length per run on a lease
#             of its own (GPU_CHECK_STEPS=headline GPU_CHECK_HEADLINE_ARGS="--full --prompt-lens 512", then 4096)
#   tests:    the kernel tests listed in bench/gpu_tests.txt (tests whose tensors go to CUDA), with
#             DFLASH_TEST_REAL_TRITON=1: Triton compiled for the GPU, no interpreter
#   syncs:    bench/gpu_round_syncs.py: host reads and synchronizing CUDA calls per round of ar / dflash /
#             ddtree at Qwen3-8B shapes (4 layers); more than one host read in a round fails
#   round:    bench/gpu_round_latency.py: one DFlash / DDTree verify round at Qwen3-8B shapes (8 of 36
#             layers, prefix 4096): our path, our path with the pre-redesign dense-mask attention, and
#             the plain-torch path; their features and K/V must agree
#   long:     bench/long_prompts.py: 2k-32k-token prompts at Qwen3-8B shapes (4 layers, bf16): time to first
#             token and per token against transformers' generate() (Triton path: the prefill's later chunks
#             and every round's verify through the tree-attention kernel, split over the keys at a 32k
#             prefix), dflash / ddtree round times, peak memory at 32k; tokens equal
#   compiled: bench/gpu_compiled_round.py: eager vs generate(compile=True) (torch.compile + CUDA graphs)
#             at Qwen3-8B shapes (4 layers): draft / verify ms per round, tokens/s; greedy tokens equal,
#             or in bf16 a divergence at a near-tie of the target's logits (its margin is reported)
#   hybrid:   bench/gpu_hybrid_check.py: a Qwen3.5-27B-shaped stack (3 Gated-DeltaNet layers + 1
#             attention layer): states after chain rollback and tree commit against transformers' own
#             decode, and the latencies against a decode step
#   families: bench/gpu_family_check.py: gpt-oss-20b- (sinks, windows, MoE), Gemma3- (local/global
#             windows, rope per layer type) and Gemma2-shaped (softcaps) stacks against the model's
#             own forward
#   stress:   bench/gpu_compaction_stress.py: thousands of adversarial accepted paths through
#             compact_kv_ at Qwen3-8B cache shapes against the reference
#   e2e:      python -m dflash bench on the embedded tiny pair, fp32, T = 0: every method's output must
#             equal plain decoding's
#   auto:     bench/gpu_auto_budget.py: tree_budget="auto" against DDTree budgets 4..64 at Qwen3-8B shapes
#             (4 layers, fp32, a drafter steered to the target's greedy text, right 80% per position):
#             tokens/s and tau per row, auto over the best and the median fixed budget
#   batch:    bench/gpu_batch_crossover.py: ar, the DFlash chain and DDTree budgets 8 / 32 / 64 at batch 1, 4
#             and 16, Qwen3-8B shapes (4 layers, fp32, the steered drafter): where trees stop paying
#   refloops: (opt-in: only when GPU_CHECK_STEPS names it) bench/reference_loops.py --device cuda: z-lab's
#             DFlash loop and the DDTree reference loop beside ours (eager and compiled) on the tiny pair:
#             tokens/s, tau, ops per round, greedy tokens equal. Their code travels as files under
#             GPU_CHECK_REF_SRC (default runs/refsrc: zlab/dflash/ = z-lab's installed dflash 0.1.0 package
#             folder, ddtree/ = a checkout of the DDTree code; carry runs/refsrc); a missing one fails the step
#   micro:    the pytest-benchmark suite in bench/ (without bench_train_memory.py) at real shapes (last: it
#             gets what the steps before it left)
# Output, in $OUT when set, else bench/results/gpu_check/: each step's log (<step>.log) and JSON,
# written as soon as the step ends (the scripts rewrite theirs after each part), and
# gpu_check_summary.json (every step's state, seconds, planned limit, granted limit and JSON file),
# rewritten when a step starts and when it ends.
#
# Dry run (GPU_CHECK_DRY_RUN=1, for a CPU machine and CI): no GPU probe and no pip build (said so;
# build only checks that the installed extension imports), CUDA hidden; every script runs with
# --dry-run (tiny shapes on the CPU, each CUDA-only part skipped with its reason printed), the
# kernel tests and the micro suite are collected only (--collect-only -q: a selection error or an
# import error fails), e2e runs at a few tokens on the CPU. Each step is capped at
# GPU_CHECK_DRY_STEP_S seconds (default 300) instead of its device limit.
#
# Selection (GPU_CHECK_STEPS, a comma list of step names; unset or empty: every step but the opt-in ones):
# the other steps are "not selected", left out of the plan and its sum, and not run. An opt-in step
# (OPT_IN: it needs files carried to the machine) runs only when named; the default plan's sum stays
# within the budget without it. Without build among them the
# extension is not built, only checked to import (an in-place build carried from an earlier run, say:
# dflash_kernels/_C*.so); if it does not, the run stops there.
#
# Exit status: 0 when every step passed; 1 when one failed, timed out or had no time left.
set -uo pipefail

cd "$(dirname "$0")/.." || exit 1
PY=${PYTHON:-python3}
BUDGET_S=${GPU_CHECK_BUDGET_S:-540}
OUT_DIR=${OUT:-bench/results/gpu_check}
DRY_RUN=${GPU_CHECK_DRY_RUN:-0}
DRY_STEP_S=${GPU_CHECK_DRY_STEP_S:-300}
SELECTED=${GPU_CHECK_STEPS:-}
GRACE_S=5     # SIGTERM this long before a step's time is up, then SIGKILL
MIN_STEP_S=10  # a step granted less than this is not started ("no time")

# name:limit_s in run order; the sum over the default selection (the opt-in steps left out) is the planned
# device time and must not exceed BUDGET_S. Sized from
# the seconds each step took on an H200 (two leases, 2026-12): probe 4-6, build 53, kernels 30, tests 66
# (82 kernel tests, their Triton compiles included), syncs 27-33, round 21, compiled 71-73, hybrid 27,
# families 34-40 (before gpt-oss's fp32 rerun), stress 11, e2e 22, auto 39 (bf16, 96 tokens), micro 104
# (before its vocabulary-sized weights were drawn on the device instead of the host); refloops (opt-in) not yet
# run on a GPU: 150 s covers 6 implementations x 8 prompts x (1 + 3 repeats) of 128 tokens on the tiny pair,
# a counted pass of each eager one and two compiles; headline (not yet run on a GPU) got its 25 s from the steps with
# the most room over their measured times (long 60 -> 50, families 50 -> 45, stress 15 -> 12, round, kernels and
# hybrid 2 s each, tests 1 s), and runs on what probe, build and kernels leave too (about 10 s)
PLAN=(
    probe:10
    build:55
    kernels:33
    headline:25
    tests:69
    syncs:30
    round:23
    long:50
    compiled:75
    hybrid:28
    families:45
    stress:12
    e2e:20
    auto:30
    batch:30
    refloops:150
    micro:5
)
OPT_IN=" refloops "  # in the plan only when GPU_CHECK_STEPS names them
REF_SRC=${GPU_CHECK_REF_SRC:-runs/refsrc}

selected() {  # name: whether GPU_CHECK_STEPS asks for it (the probe always runs; an opt-in step only by name)
    if [[ "$OPT_IN" == *" $1 "* ]]; then
        [[ ",$SELECTED," == *",$1,"* ]]
        return
    fi
    [ -z "$SELECTED" ] || [ "$1" = probe ] || [[ ",$SELECTED," == *",$1,"* ]]
}

PLAN_NAMES=()
declare -A LIMIT STATE SECS GRANTED JSON_OF
PLANNED_S=0
for entry in "${PLAN[@]}"; do
    name=${entry%%:*}
    PLAN_NAMES+=("$name")
    LIMIT[$name]=${entry#*:}
    STATE[$name]=pending
    SECS[$name]=0
    GRANTED[$name]=0
    if selected "$name"; then
        PLANNED_S=$((PLANNED_S + ${entry#*:}))
    else
        STATE[$name]="not selected"
    fi
done
for name in ${SELECTED//,/ }; do
    if [ -z "${LIMIT[$name]+set}" ] || [ "$name" = probe ]; then
        echo "gpu_check: FAIL: GPU_CHECK_STEPS names '$name', which is no step; the steps are:" \
             "${PLAN_NAMES[*]:1}" >&2
        exit 1
    fi
done
if [ "$DRY_RUN" != 1 ] && ! selected build; then
    export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # the package as it lies here (nothing is installed)
fi
if [ "$DRY_RUN" = 1 ]; then
    MICRO_JSON=micro_tests.json
else
    MICRO_JSON=micro.json
fi
JSON_OF=([probe]="" [build]=build.json [kernels]=gpu_kernel_check.json [headline]=headline.json [tests]=gpu_tests.json
         [syncs]=gpu_round_syncs.json [round]=gpu_round_latency.json [long]=long_prompts.json [compiled]=gpu_compiled_round.json
         [hybrid]=gpu_hybrid_check.json [families]=gpu_family_check.json [stress]=gpu_compaction_stress.json
         [e2e]=e2e/results.json [auto]=gpu_auto_budget.json [batch]=gpu_batch_crossover.json [refloops]=reference_loops.json
         [micro]=$MICRO_JSON)

die() {
    echo "gpu_check: FAIL: $*" >&2
    exit 1
}

print_plan() {
    echo "gpu_check: plan (step: limit in seconds, in run order):"
    local name
    for name in "${PLAN_NAMES[@]}"; do
        selected "$name" && printf '  %-9s %4d s\n' "$name" "${LIMIT[$name]}"
    done
    [ -n "$SELECTED" ] && echo "gpu_check: only the steps in GPU_CHECK_STEPS: ${SELECTED}"
    echo "planned device time: ${PLANNED_S} s (budget ${BUDGET_S} s)"
    if [ "$PLANNED_S" -gt "$BUDGET_S" ]; then
        echo "gpu_check: the plan exceeds the budget: the last steps will get less time or none" >&2
    fi
}

print_plan
GPU_NAME=cpu

# ---------------------------------------------------------------- probe: a GPU, or stop now
if [ "$DRY_RUN" = 1 ]; then
    echo "gpu_check: dry run: skipping the nvidia-smi / torch.cuda probe; CUDA hidden (CUDA_VISIBLE_DEVICES='')," \
         "each step capped at ${DRY_STEP_S}s on this machine"
    export CUDA_VISIBLE_DEVICES=""
    # each script decides where Triton's interpreter runs (the kernel check and the stress test: on; the model
    # scripts: off, their ops on the reference backend), as on a GPU machine where nothing sets it
    unset TRITON_INTERPRET
    STATE[probe]="skipped (dry run)"
else
    if ! command -v nvidia-smi >/dev/null 2>&1; then
        die "no NVIDIA GPU visible: nvidia-smi is not on PATH. This check needs a machine with one NVIDIA GPU and its driver."
    fi
    GPUS=$(timeout 10 nvidia-smi -L 2>/dev/null | grep -c '^GPU ' || true)
    if [ "${GPUS:-0}" -lt 1 ]; then
        die "no NVIDIA GPU visible: 'nvidia-smi -L' lists no GPU (driver not loaded, or CUDA_VISIBLE_DEVICES hides them)."
    fi
    # one python start: "ARCH|NAME" when CUDA works, else "none|torch version" (or the import error)
    PROBE=$(timeout "${LIMIT[probe]}" "$PY" -c 'import torch
if torch.cuda.is_available():
    print("%d.%d|%s" % (torch.cuda.get_device_capability(0) + (torch.cuda.get_device_name(0),)))
else:
    print("none|torch %s, CUDA %s" % (torch.__version__, torch.version.cuda))' 2>&1 | tail -n 1)
    ARCH=${PROBE%%|*}
    GPU_NAME=${PROBE#*|}
    if [ "$ARCH" = "$PROBE" ]; then
        die "nvidia-smi sees ${GPUS} GPU(s) but '$PY' cannot import torch (or took over ${LIMIT[probe]}s): ${PROBE}"
    fi
    if [ "$ARCH" = "none" ]; then
        die "nvidia-smi sees ${GPUS} GPU(s) but torch.cuda.is_available() is False (${GPU_NAME}); install a CUDA build of torch that matches the driver."
    fi
    if [ "$GPUS" -gt 1 ]; then
        echo "gpu_check: ${GPUS} GPUs visible; everything runs on cuda:0"
    fi
    STATE[probe]=ok
    SECS[probe]=$SECONDS
    GRANTED[probe]=${LIMIT[probe]}
fi
mkdir -p "$OUT_DIR" || die "cannot create $OUT_DIR"
if [ "$DRY_RUN" = 1 ]; then
    echo "gpu_check: DRY RUN on the CPU, output in ${OUT_DIR}"
else
    echo "gpu_check: ${GPU_NAME} (sm_${ARCH/./}), output in ${OUT_DIR}, time budget ${BUDGET_S}s"
fi

# ---------------------------------------------------------------- running summary
FAILED=0

write_summary() {  # done: true|false
    local tmp="$OUT_DIR/.gpu_check_summary.json.tmp" name sep="," i=0 n=${#PLAN_NAMES[@]}
    local gpu=${GPU_NAME//[\"\\]/}
    {
        printf '{\n  "budget_s": %d,\n  "planned_s": %d,\n  "dry_run": %s,\n  "gpu": "%s",\n' \
            "$BUDGET_S" "$PLANNED_S" "$([ "$DRY_RUN" = 1 ] && echo true || echo false)" "$gpu"
        printf '  "elapsed_s": %d,\n  "done": %s,\n  "failed": %s,\n  "steps": [\n' \
            "$SECONDS" "$1" "$([ "$FAILED" -ne 0 ] && echo true || echo false)"
        for name in "${PLAN_NAMES[@]}"; do
            i=$((i + 1))
            [ "$i" -eq "$n" ] && sep=""
            printf '    {"step": "%s", "state": "%s", "seconds": %d, "limit": %d, "granted": %d, "json": "%s"}%s\n' \
                "$name" "${STATE[$name]}" "${SECS[$name]}" "${LIMIT[$name]}" "${GRANTED[$name]}" "${JSON_OF[$name]}" "$sep"
        done
        printf '  ]\n}\n'
    } > "$tmp" && mv -f "$tmp" "$OUT_DIR/gpu_check_summary.json"
}

later_limits() {  # the planned seconds of the steps after $1
    local name seen=0 sum=0
    for name in "${PLAN_NAMES[@]}"; do
        if [ "$seen" -eq 1 ] && selected "$name"; then
            sum=$((sum + ${LIMIT[$name]}))
        fi
        [ "$name" = "$1" ] && seen=1
    done
    echo "$sum"
}

step() {  # name command...: run it within its time, log it, record it
    local name=$1
    shift
    if ! selected "$name"; then
        echo "== [$name] not selected (GPU_CHECK_STEPS=${SELECTED})"
        return 0
    fi
    local limit=${LIMIT[$name]} granted
    if [ "$DRY_RUN" = 1 ]; then
        granted=$DRY_STEP_S
    else
        local remaining=$((BUDGET_S - SECONDS))
        granted=$((remaining - $(later_limits "$name")))  # the step's limit plus what earlier steps left
        local own=$((limit < remaining ? limit : remaining))
        [ "$granted" -lt "$own" ] && granted=$own
        if [ "$granted" -lt "$MIN_STEP_S" ]; then
            echo "== [$name] SKIPPED: no time left in the ${BUDGET_S}s budget" >&2
            STATE[$name]="no time"
            FAILED=1
            write_summary false
            return 1
        fi
    fi
    GRANTED[$name]=$granted
    STATE[$name]=running
    write_summary false
    local grace=$((granted / 4 < GRACE_S ? granted / 4 : GRACE_S))
    local shown="$*"
    if [ "${#shown}" -gt 300 ]; then  # the kernel tests' node ids: name the list instead
        shown="${shown:0:300}... ($# arguments in all)"
    fi
    echo "== [$name] $shown (limit ${granted}s, planned ${limit}s)"
    local t0=$SECONDS rc
    # GPU_CHECK_GRANTED_S: the seconds the command has (a script may fit its work into them)
    GPU_CHECK_GRANTED_S=$((granted - grace)) timeout --kill-after="$grace" "$((granted - grace))" "$@" 2>&1 \
        | tee "$OUT_DIR/$name.log"
    rc=${PIPESTATUS[0]}
    SECS[$name]=$((SECONDS - t0))
    if [ "$rc" -eq 0 ]; then
        STATE[$name]=ok
    elif [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
        echo "== [$name] TIMEOUT after ${granted}s" >&2
        STATE[$name]=TIMEOUT
    else
        echo "== [$name] FAILED (exit $rc), log: $OUT_DIR/$name.log" >&2
        STATE[$name]="FAIL ($rc)"
    fi
    [ "$rc" -ne 0 ] && FAILED=1
    write_summary false
    return "$rc"
}

summary() {
    write_summary true
    echo
    if [ "$DRY_RUN" = 1 ]; then
        echo "== gpu_check summary (DRY RUN on the CPU, ${SECONDS}s; planned device time ${PLANNED_S}s)"
    else
        echo "== gpu_check summary (${GPU_NAME}, ${SECONDS}s of ${BUDGET_S}s; planned ${PLANNED_S}s)"
    fi
    printf '%-10s %-18s %7s %6s %7s\n' step result seconds limit granted
    local name
    for name in "${PLAN_NAMES[@]}"; do
        [ "${STATE[$name]}" = pending ] && continue
        printf '%-10s %-18s %7s %6s %7s\n' "$name" "${STATE[$name]}" "${SECS[$name]}" "${LIMIT[$name]}" "${GRANTED[$name]}"
    done
    if [ "$FAILED" -ne 0 ]; then
        echo "gpu_check: FAIL (see the logs in $OUT_DIR)" >&2
    else
        echo "gpu_check: all steps passed; JSON in $OUT_DIR (summary: gpu_check_summary.json)"
    fi
}

write_summary false

# flags every bench script gets in a dry run
DRY=()
if [ "$DRY_RUN" = 1 ]; then
    DRY=(--dry-run)
fi
# the pytest steps: a per-test JSON rewritten after every test, SIGTERM handled as Ctrl-C
PYTEST_ENV=(env "PYTHONPATH=bench${PYTHONPATH:+:$PYTHONPATH}")
PYTEST_ARGS=(-q -p no:cacheprovider -p gpu_pytest_report)

# ---------------------------------------------------------------- build (C++ extension)
EXT_CHECK='import dflash_kernels._C as C, torch; print("dflash_kernels._C imports (%s), torch %s" % (C.__file__, torch.__version__))'
if [ "$DRY_RUN" = 1 ]; then
    echo "gpu_check: dry run: skipping the pip build; checking that the installed extension imports"
    step build "$PY" -c "$EXT_CHECK"
elif ! selected build; then
    echo "gpu_check: build not selected: checking that the extension imports as it is"
    if ! timeout 30 "$PY" -c "$EXT_CHECK" 2>&1; then
        summary
        die "build is not selected and dflash_kernels._C does not import: select build, or carry a built extension"
    fi
else
    step build env MAX_JOBS="$(nproc)" "$PY" -m pip install --no-build-isolation --no-deps --no-index -e .
fi
BUILD_RC=$?
if [ "$BUILD_RC" -eq 0 ] && [ "$DRY_RUN" != 1 ] && selected build; then
    if ! timeout 30 "$PY" -c "$EXT_CHECK" >>"$OUT_DIR/build.log" 2>&1; then
        echo "== [build] the build finished but dflash_kernels._C does not import (see $OUT_DIR/build.log)" >&2
        STATE[build]="FAIL (import)"
        FAILED=1
        BUILD_RC=1
    fi
fi
printf '{"step": "build", "state": "%s", "seconds": %d, "dry_run": %s, "command": "%s", "log": "build.log"}\n' \
    "${STATE[build]}" "${SECS[build]}" "$([ "$DRY_RUN" = 1 ] && echo true || echo false)" \
    "$([ "$DRY_RUN" = 1 ] && echo "import check only (dry run)" || echo "pip install --no-build-isolation --no-deps --no-index -e .")" \
    > "$OUT_DIR/build.json"
selected build || rm -f "$OUT_DIR/build.json"
if [ "$BUILD_RC" -ne 0 ]; then
    summary
    die "the extension did not build (the later steps need it)"
fi

# ---------------------------------------------------------------- kernels: every op vs reference, real shapes
step kernels "$PY" bench/gpu_kernel_check.py --model qwen3-8b --json "$OUT_DIR/gpu_kernel_check.json" "${DRY[@]}"

# ---------------------------------------------------------------- headline: the README's table, real shapes
# (in a dry run: tiny shapes on the CPU, the compiled rows named as skipped; GPU_CHECK_HEADLINE_ARGS: word-split)
# shellcheck disable=SC2206
HEADLINE_ARGS=(${GPU_CHECK_HEADLINE_ARGS:-})
step headline "$PY" bench/headline.py --ref-src "$REF_SRC" --json "$OUT_DIR/headline.json" \
    --markdown "$OUT_DIR/headline.md" "${HEADLINE_ARGS[@]}" "${DRY[@]}"

# ---------------------------------------------------------------- tests: kernel tests, compiled Triton
# the listed ids are selected by pytest --only-listed (tests/sharding.py): strict in the dry run (an id this
# machine's collection lacks fails it), lenient on the GPU (an id whose parametrization differs there is named
# and fails the step at the end, after every other listed test has run)
KERNEL_COUNT=$(grep -c -v -e '^[[:space:]]*#' -e '^[[:space:]]*$' bench/gpu_tests.txt)
if [ "$DRY_RUN" = 1 ]; then
    echo "gpu_check: dry run: collecting the ${KERNEL_COUNT} GPU kernel test ids only (real Triton needs" \
         "CUDA; collected as the CPU suite does, with the interpreter's backends)"
    step tests "${PYTEST_ENV[@]}" GPU_CHECK_PYTEST_JSON="$OUT_DIR/gpu_tests.json" \
        "$PY" -m pytest "${PYTEST_ARGS[@]}" --collect-only --only-listed bench/gpu_tests.txt tests
else
    step tests "${PYTEST_ENV[@]}" GPU_CHECK_PYTEST_JSON="$OUT_DIR/gpu_tests.json" DFLASH_TEST_REAL_TRITON=1 \
        "$PY" -m pytest "${PYTEST_ARGS[@]}" -rfE --durations=10 --only-listed bench/gpu_tests.txt \
        --only-listed-lenient tests
fi

# ---------------------------------------------------------------- syncs: host reads per round
step syncs "$PY" bench/gpu_round_syncs.py --layers 4 --json "$OUT_DIR/gpu_round_syncs.json" "${DRY[@]}"

# ---------------------------------------------------------------- round: our path vs plain torch
step round "$PY" bench/gpu_round_latency.py --layers 8 --prefix 4096 --budgets 64,256 \
    --json "$OUT_DIR/gpu_round_latency.json" "${DRY[@]}"

# ---------------------------------------------------------------- long: 2k-32k-token prompts vs transformers
step long "$PY" bench/long_prompts.py --device cuda --shape qwen3-8b --layers 4 --dtype bfloat16 \
    --lengths 2048,8192,16384,32768 --new-tokens 32 --reps 2 --json "$OUT_DIR/long_prompts.json" "${DRY[@]}"

# ---------------------------------------------------------------- compiled: eager vs CUDA graphs
step compiled "$PY" bench/gpu_compiled_round.py --layers 4 --prompt-len 256 --max-new-tokens 32 --repeats 2 \
    --json "$OUT_DIR/gpu_compiled_round.json" "${DRY[@]}"

# ---------------------------------------------------------------- hybrid targets: verify + rollback
step hybrid "$PY" bench/gpu_hybrid_check.py --json "$OUT_DIR/gpu_hybrid_check.json" "${DRY[@]}"

# ---------------------------------------------------------------- families: sinks, windows, softcaps, MoE
step families "$PY" bench/gpu_family_check.py --json "$OUT_DIR/gpu_family_check.json" "${DRY[@]}"

# ---------------------------------------------------------------- stress: KV compaction races
step stress "$PY" bench/gpu_compaction_stress.py --cases 3000 --json "$OUT_DIR/gpu_compaction_stress.json" "${DRY[@]}"

# ---------------------------------------------------------------- e2e: lossless on the device
if [ "$DRY_RUN" = 1 ]; then
    step e2e "$PY" -m dflash bench --device cpu --dtype float32 --num-prompts 1 --prompt-len 64 --max-new-tokens 8 \
        --warmup-tokens 4 --temperatures 0 --budgets 4 --methods ar,dflash,ddtree,hf,prompt-lookup --no-progress \
        --out "$OUT_DIR/e2e"
else
    step e2e "$PY" -m dflash bench --device cuda --dtype float32 --num-prompts 1 --max-new-tokens 32 \
        --temperatures 0 --budgets 8 --methods ar,dflash,ddtree,hf,prompt-lookup --no-progress \
        --out "$OUT_DIR/e2e"
fi

# ---------------------------------------------------------------- auto: the budget chosen per round
step auto "$PY" bench/gpu_auto_budget.py --layers 4 --prompt-len 256 --new-tokens 48 --repeats 2 \
    --json "$OUT_DIR/gpu_auto_budget.json" "${DRY[@]}"

# ---------------------------------------------------------------- batch: trees against the chain as b grows
step batch "$PY" bench/gpu_batch_crossover.py --layers 4 --prompt-len 256 --new-tokens 48 --repeats 1 \
    --json "$OUT_DIR/gpu_batch_crossover.json" "${DRY[@]}"

# ---------------------------------------------------------------- refloops (opt-in): the reference loops beside ours
if [ "$DRY_RUN" = 1 ]; then
    REF_DEVICE=cpu
else
    REF_DEVICE=cuda
fi
step refloops "$PY" bench/reference_loops.py --device "$REF_DEVICE" --zlab-src "$REF_SRC/zlab" \
    --ddtree-src "$REF_SRC/ddtree" --repeats 3 --require-references --json "$OUT_DIR/reference_loops.json" "${DRY[@]}"

# ---------------------------------------------------------------- micro: pytest-benchmark suite, last
if [ "$DRY_RUN" = 1 ]; then
    echo "gpu_check: dry run: collecting the micro suite only (its Triton providers under the CPU interpreter" \
         "take minutes: too slow for a dry run)"
    step micro "${PYTEST_ENV[@]}" GPU_CHECK_PYTEST_JSON="$OUT_DIR/micro_tests.json" \
        "$PY" -m pytest bench "${PYTEST_ARGS[@]}" --collect-only --ignore=bench/bench_train_memory.py
else
    step micro "${PYTEST_ENV[@]}" GPU_CHECK_PYTEST_JSON="$OUT_DIR/micro_tests.json" \
        "$PY" -m pytest bench "${PYTEST_ARGS[@]}" --ignore=bench/bench_train_memory.py \
        --benchmark-json="$OUT_DIR/micro.json" --benchmark-max-time=0.05 --benchmark-min-rounds=3 \
        --benchmark-columns=median,rounds
fi

summary
exit "$FAILED"
