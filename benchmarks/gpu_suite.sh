#!/usr/bin/env bash
# The GPU measurements BENCHMARKS.md records, as named suites, for a machine that already has
# the project's GPU dependencies (CUDA torch, vLLM; docs/setup.md) and a checkout of this tree.
#
#   bash benchmarks/gpu_suite.sh [options] SUITE...
#
# Suites (each benchmark prints one JSON object and writes it to OUT):
#   recipes           benchmarks/async_vs_sync.py, sync against async, over configs/bench_1.5b.yaml,
#                     bench_3b.yaml and bench_7b_lora.yaml as they stand (`auto` settings), 10
#                     measured steps each: async_vs_sync_<gpu>.json, _<gpu>_3b.json, _<gpu>_7b_lora.json;
#                     then bench_7b.yaml with auto's 80 GB choice (memory.gpu_gb=80: FSDP2's full
#                     offload, 32768-token micro-batches, vLLM 0.41; needs a host of about 128 GB), the
#                     plan's step time beside the measured one (`plan_train_s`, `train_s_per_step`):
#                     async_vs_sync_<gpu>_7b.json
#   moe               async_vs_sync.py over configs/bench_moe.yaml (a 2.4B mixture of experts, 0.71B
#                     active), 10 measured steps, with routing replay (`rollout`) and without it
#                     (`measure`: the trainer routes, router_disagree / routing_mismatch say how often
#                     otherwise): async_vs_sync_<gpu>_moe.json, _<gpu>_moe_measure.json. Needs vLLM's
#                     MoE kernels (a full vLLM wheel)
#   rollout           benchmarks/rollout.py: the rollout role against bare vLLM, 128 prompts x 512
#                     tokens, the 1.5B recipe's engine, and the cost of seeded sampling
#                     (--seeded): rollout_<gpu>.json
#   longtail          async_vs_sync.py, the 1.5B recipe with log-normal response lengths (mean 512,
#                     capped at 2048), async at staleness 8, 20 measured steps: async_vs_sync_<gpu>_longtail.json
#   fixed512          async_vs_sync.py, the 1.5B recipe, every sample 512 tokens, 20 measured steps:
#                     async_vs_sync_<gpu>_fixed512.json
#   trainer           benchmarks/trainer.py: the compiled FSDP engine at fixed 4k and a length mix,
#                     one profiled step per case: trainer_<gpu>.json
#   trainer-variants  trainer.py: the compiled engine against cuDNN attention, reduced accumulation,
#                     bf16 accumulation and 4096-token logprob chunks, in one run: trainer_variants_<gpu>.json
#   attention         benchmarks/attention.py: the attention kernels alone: attention_<gpu>.json
#   scaling           benchmarks/scaling.py: the model curve (10 steps a point) and the length curve
#                     (staleness 8): scaling_model_<gpu>.json, scaling_length_<gpu>.json
#   distill           benchmarks/distill.py: configs/distill_1.5b.yaml (1.5B student, 3B-shaped teacher
#                     role on the same GPU) against the same recipe without a teacher, 10 measured
#                     steps each: distill_<gpu>.json
#   gpu-tests         pytest -m gpu tests/gpu: gpu_tests_<gpu>.xml (JUnit)
#   all               every suite above, in that order
#
# <gpu> is GPU 0's model as nvidia-smi names it and the number of GPUs visible (CUDA_VISIBLE_DEVICES
# if set), e.g. h100x1 or h200x2. Every step's output goes to a .log next to its JSON; a failed step
# is reported and the next one runs; the exit status is non-zero if any step failed.
#
# Options:
#   --out DIR         where the JSON and logs go (default benchmarks/results)
#   --run-root DIR    the runs' directories go under DIR/<UTC time>/ (default runs/gpu_suite)
#   --gpu TAG         name the results with TAG instead of what nvidia-smi says (e.g. h100x1)
#   --repeats N       async_vs_sync.py's --repeats: alternating sync/async pairs (default 1)
#   --python PY       the interpreter (default: $PYTHON, else python3)
#   --dry-run         print the commands instead of running them
#
# The JSON records the commit (`$TANDEM_COMMIT` if set, else git's HEAD) and GPU 0's name. The
# H200 rows in BENCHMARKS.md ran with the recipes' GPU settings pinned, not `auto`; to measure what they
# measured, add the settings they pinned (BENCHMARKS.md, `H200_15B`) to the command by hand.
set -uo pipefail
cd "$(dirname "$0")/.."

OUT=benchmarks/results
RUN_ROOT=runs/gpu_suite
GPU_TAG=
REPEATS=1
PY=${PYTHON:-python3}
DRY=0
FAILED=()

usage() {
    sed -n '2,/^set -uo/p' "$0" | sed '$d; s/^# \{0,1\}//'
    exit "${1:-0}"
}

gpu_tag() {  # h100x1: GPU 0's model (the first word with a digit after "NVIDIA") and the count
    local name count
    name=$(nvidia-smi --query-gpu=name --format=csv,noheader --id=0 2>/dev/null) || {
        echo "no GPU: nvidia-smi failed (use --gpu TAG to name the results anyway)" >&2
        return 1
    }
    if [ -n "${CUDA_VISIBLE_DEVICES:-}" ]; then
        count=$(tr ',' '\n' <<<"$CUDA_VISIBLE_DEVICES" | grep -c .)
    else
        count=$(nvidia-smi --query-gpu=index --format=csv,noheader | grep -c .)
    fi
    name=$(tr ' ' '\n' <<<"${name#NVIDIA }" | grep -m1 '[0-9]' | tr 'A-Z' 'a-z' | tr -cd 'a-z0-9')
    echo "${name:-gpu}x$count"
}

step() {  # step NAME COMMAND...: one measurement, its output in $OUT/NAME.log
    local name=$1
    shift
    if [ "$DRY" = 1 ]; then
        printf '%q ' "$@"
        echo
        return
    fi
    echo "$(date -u +%H:%M:%S) start $name (log $OUT/$name.log)"
    "$@" >"$OUT/$name.log" 2>&1
    local rc=$?  # before anything else runs: `$(date)` below would reset it
    echo "$(date -u +%H:%M:%S) end $name rc $rc"
    [ "$rc" = 0 ] || FAILED+=("$name")
}

avs() {  # avs NAME CONFIG [ARG...]: sync against async, into $OUT/NAME.json
    local name=$1 config=$2
    shift 2
    step "$name" "$PY" benchmarks/async_vs_sync.py --config "$config" --repeats "$REPEATS" \
        --run-root "$RUN_ROOT/$name" --out "$OUT/$name.json" "$@"
}

# Response lengths drawn per group: log-normal, mean 512, capped at 2048 (docs/benchmarks.md).
LONGTAIL=(rollout.max_tokens=2048 rollout.engine.max_model_len=2112 rollout.length_dist.kind=lognormal
    rollout.length_dist.mean_tokens=512)

suite_recipes() {
    avs "async_vs_sync_$G" configs/bench_1.5b.yaml --measured-steps 10
    avs "async_vs_sync_${G}_3b" configs/bench_3b.yaml --measured-steps 10
    avs "async_vs_sync_${G}_7b_lora" configs/bench_7b_lora.yaml --measured-steps 10
    avs "async_vs_sync_${G}_7b" configs/bench_7b.yaml --measured-steps 10 memory.gpu_gb=80
}

suite_moe() {  # the MoE recipe with routing replay, then with the trainer routing itself (replay's reason)
    avs "async_vs_sync_${G}_moe" configs/bench_moe.yaml --measured-steps 10
    avs "async_vs_sync_${G}_moe_measure" configs/bench_moe.yaml --measured-steps 10 algorithm.routing_replay=measure
}

suite_rollout() {
    step "rollout_$G" "$PY" benchmarks/rollout.py --config configs/bench_1.5b.yaml --prompts 128 --max-tokens 512 \
        --reps 3 --seeded --out "$OUT/rollout_$G.json"
}

suite_longtail() {
    avs "async_vs_sync_${G}_longtail" configs/bench_1.5b.yaml --staleness 8 --measured-steps 20 "${LONGTAIL[@]}"
}

suite_fixed512() {
    avs "async_vs_sync_${G}_fixed512" configs/bench_1.5b.yaml --measured-steps 20
}

suite_trainer() {
    step "trainer_$G" "$PY" benchmarks/trainer.py --cases fixed_4k length_mix --loops engine --profile 12 \
        --engine-option trainer.compile=true --out "$OUT/trainer_$G.json"
}

suite_trainer_variants() {
    step "trainer_variants_$G" "$PY" benchmarks/trainer.py --cases fixed_4k length_mix --loops engine \
        --profile 12 --engine-option trainer.compile=true \
        --variant cudnn trainer.attention_kernel=cudnn \
        --variant reduced fsdp.one_rank_accumulation=reduced \
        --variant cudnn_reduced trainer.attention_kernel=cudnn fsdp.one_rank_accumulation=reduced \
        --variant bf16acc "fsdp.mixed_precision={param_dtype: bfloat16, reduce_dtype: bfloat16}" \
        --variant chunk4k trainer.logprob_chunk_tokens=4096 \
        --out "$OUT/trainer_variants_$G.json"
}

suite_attention() {
    step "attention_$G" "$PY" benchmarks/attention.py --kernels torch cudnn cudnn_repeat sdpa_padded \
        --out "$OUT/attention_$G.json"
}

suite_scaling() {
    step "scaling_model_$G" "$PY" benchmarks/scaling.py --axis model --steps 10 \
        --run-root "$RUN_ROOT/scaling_model_$G" --out "$OUT/scaling_model_$G.json"
    step "scaling_length_$G" "$PY" benchmarks/scaling.py --axis length --staleness 8 --steps 10 \
        --run-root "$RUN_ROOT/scaling_length_$G" --out "$OUT/scaling_length_$G.json"
}

suite_distill() {
    step "distill_$G" "$PY" benchmarks/distill.py --config configs/distill_1.5b.yaml --measured-steps 10 \
        --run-root "$RUN_ROOT/distill_$G" --out "$OUT/distill_$G.json"
}

suite_gpu_tests() {
    step "gpu_tests_$G" "$PY" -m pytest -m gpu tests/gpu -q -s -o addopts="" --junitxml "$OUT/gpu_tests_$G.xml"
}

ALL=(recipes moe rollout longtail fixed512 trainer trainer-variants attention scaling distill gpu-tests)
SUITES=()
while [ $# -gt 0 ]; do
    case "$1" in
    --out) OUT=$2; shift 2 ;;
    --run-root) RUN_ROOT=$2; shift 2 ;;
    --gpu) GPU_TAG=$2; shift 2 ;;
    --repeats) REPEATS=$2; shift 2 ;;
    --python) PY=$2; shift 2 ;;
    --dry-run) DRY=1; shift ;;
    -h | --help) usage 0 ;;
    all) SUITES+=("${ALL[@]}"); shift ;;
    -*) echo "unknown option $1" >&2; usage 2 >&2 ;;
    *)
        declare -F "suite_${1//-/_}" >/dev/null || { echo "unknown suite $1 (one of: ${ALL[*]} all)" >&2; exit 2; }
        SUITES+=("$1")
        shift
        ;;
    esac
done
[ ${#SUITES[@]} -gt 0 ] || usage 2 >&2

G=${GPU_TAG:-$(gpu_tag)} || exit 1
RUN_ROOT=$RUN_ROOT/$(date -u +%Y%m%d-%H%M%S)  # a fresh directory per invocation: no run resumes another
# Quiet, offline vLLM and unbuffered logs; the flashinfer sampler off, as in the recorded runs.
export PYTHONUNBUFFERED=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1
export HF_HUB_OFFLINE=${HF_HUB_OFFLINE:-1} VLLM_USE_FLASHINFER_SAMPLER=${VLLM_USE_FLASHINFER_SAMPLER:-0}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if [ -z "${TANDEM_COMMIT:-}" ] && ! git rev-parse --short HEAD >/dev/null 2>&1; then
    echo "warning: no git history and TANDEM_COMMIT unset: the JSON records no commit" >&2
fi
[ "$DRY" = 1 ] || mkdir -p "$OUT" "$RUN_ROOT"
[ "$DRY" = 1 ] || nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null

for suite in "${SUITES[@]}"; do
    [ "$DRY" = 1 ] && echo "# $suite" || echo "== $suite ($G)"
    "suite_${suite//-/_}"
done
if [ ${#FAILED[@]} -gt 0 ]; then
    echo "failed: ${FAILED[*]} (their logs are in $OUT)"
    exit 1
fi
