#!/usr/bin/env bash
# The H200 measurements that open issues still owe (docs/gpu-verification.md, "Not yet
# verified"), as queues for the lent device machine. In the tree, not in an ignored folder,
# because a new checkout starts without the ignored ones.
#
# The device machine has python3.12, torch and CUDA but no vLLM: ../shared/device/
# prepare_vllm_carry.sh builds .carry0, .carry1 and .carry2 in this checkout first. The
# machine is released about 30 s after a call ends, so the calls go back to back in one
# batch, each with its carry:
#   bash benchmarks/h200_owed.sh carry 0                          carry [".carry0"], timeout 300
#   bash benchmarks/h200_owed.sh carry 1                          carry [".carry1"], timeout 120
#   TANDEM_COMMIT=<short sha> bash benchmarks/h200_owed.sh carry 2 issue30 issue34
#                                                                 carry [".carry2"], timeout 300
#       (any queue function below may be named: `longtail` adds a long-tail repeat)
#   bash benchmarks/h200_owed.sh poll 540                         (again and again), timeout 600
# A queue that needs no vLLM (trainer_only) starts after `carry 0` alone:
#   bash benchmarks/h200_owed.sh carry 0 && TANDEM_COMMIT=<short sha> bash benchmarks/h200_owed.sh start trainer_only
# `carry 2` installs vLLM and starts the named queues, one after the other, in the
# background; `poll S` waits until they end or S seconds pass, then copies every JSON and
# log written so far to $OUT. Each queue's steps are ordered by what they decide, so a cut
# budget loses the least. TANDEM_COMMIT is the commit the JSON records (the machine's copy of
# the tree has no git history): commit first, then start.
set -uo pipefail
cd "$(dirname "$0")/.."
Q=${H200_QUEUE_DIR:-/root/q}  # what the queues write; poll copies it to $OUT/q
STASH=/root/stash
SITE=/tmp/site

device_env() {
    export PYTHONUNBUFFERED=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 HF_HUB_OFFLINE=1 VLLM_USE_FLASHINFER_SAMPLER=0
    export PYTHONPATH="$SITE:$PWD"
}

carry() {
    mkdir -p "$STASH"
    case "$1" in
    0)
        cp -f .carry0/* "$STASH"/ &&
            python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "$STASH"/*.whl &&
            echo "carry 0: $(ls "$STASH" | wc -l) files installed"
        ;;
    1) cp -f .carry1/* "$STASH"/ && ls -l "$STASH" | grep part ;;
    2)
        cp -f .carry2/* "$STASH"/ &&
            cat "$STASH"/vllm-*.whl.part* >/tmp/vllm-0.26.0-cp38-abi3-manylinux_2_28_x86_64.whl &&
            (cd /tmp && sha256sum -c "$STASH"/vllm.sha256) &&
            python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" /tmp/vllm-*.whl ||
            {
                echo "carry 2 failed: if sha256sum failed the machine was replaced between steps; start at carry 0"
                return 1
            }
        shift
        start "$@"
        ;;
    esac
}

start() {  # start QUEUE...: the queues, one after the other, in the background
    mkdir -p "$Q"
    [ -n "${TANDEM_COMMIT:-}" ] || echo "warning: TANDEM_COMMIT unset; the JSON records no commit"
    # From a copy of the tree: every later call re-sends the checkout, and a run that starts a
    # process after that would import code other than what the queue began with.
    local tree=/root/tree-$$
    mkdir -p "$tree" && tar cf - --exclude='./.carry*' --exclude='./.git' . | tar xf - -C "$tree"
    setsid nohup bash "$tree/benchmarks/h200_owed.sh" queues "$@" >"$Q/queue.log" 2>&1 </dev/null &  # outlives this call
    echo "started: $* from $tree (log $Q/queue.log)"
}

step() {  # step NAME TIMEOUT_S COMMAND...: one measurement, its log in $Q/NAME.log
    local name=$1 limit=$2
    shift 2
    echo "$(date -u +%H:%M:%S) start $name"
    timeout "$limit" "$@" >"$Q/$name.log" 2>&1
    local rc=$?  # before anything else runs: `$(date)` in the line below would reset it
    echo "$(date -u +%H:%M:%S) end $name rc $rc"
}

LONGTAIL=(rollout.max_tokens=2048 rollout.engine.max_model_len=2112 rollout.length_dist.kind=lognormal
    rollout.length_dist.mean_tokens=512 trainer.micro_batch_tokens=8192)
# What the 1.5B recipe ran with on one H200 before these keys were `auto` (bench_h200x1.yaml):
# the long-tail and fixed-512 repeats pin them to measure the same thing. They start new files:
# --add-to refuses the results recorded under the old recipe name.
H200_PINNED=(rollout.engine.gpu_memory_utilization=0.45 trainer.micro_batch_tokens=8192
    rollout.engine.sleep_when_idle=true rollout.engine.sleep_level=2 trainer.offload.optimizer=false
    trainer.offload.params=false)

R=benchmarks/results

longtail() {  # one more long-tail repeat (a new file: the three are bench_h200x1.yaml's)
    step longtail 1200 python3 benchmarks/async_vs_sync.py --config configs/bench_1.5b.yaml --staleness 8 \
        --measured-steps 20 --run-root /root/lt --out $Q/async_vs_sync_h200x1_longtail.json \
        "${H200_PINNED[@]}" "${LONGTAIL[@]}"
}

issue30() {  # the curves' points, then the fixed-512 repeats (the long-tail three are in, 2026-12-05)
    step length_8192 300 python3 benchmarks/scaling.py --axis length --only mean-8192 --staleness 8 --steps 10 \
        --run-root /root/sl --out $Q/scaling_length_h200x1.json
    step model_0.5b 900 python3 benchmarks/scaling.py --axis model --steps 10 --only 0.5b --run-root /root/sm \
        --add-to $R/scaling_model_h200x1.json --out $Q/scaling_model_h200x1.json
    step model_3b 1200 python3 benchmarks/scaling.py --axis model --steps 10 --only 3b --run-root /root/sm3 \
        --add-to $Q/scaling_model_h200x1.json --out $Q/scaling_model_h200x1.json
    for point in mean-512 mean-2048; do
        step "length_$point" 1200 python3 benchmarks/scaling.py --axis length --only $point --staleness 8 \
            --steps 10 --run-root "/root/sl-$point" --add-to $Q/scaling_length_h200x1.json \
            --out $Q/scaling_length_h200x1.json
    done
    local add=()  # the first repeat starts the file (the one before is bench_h200x1.yaml's), the next adds to it
    for pair in 2 3; do
        step "fixed512_$pair" 900 python3 benchmarks/async_vs_sync.py --config configs/bench_1.5b.yaml \
            --measured-steps 20 --run-root "/root/fx$pair" ${add[@]+"${add[@]}"} \
            --out $Q/async_vs_sync_h200x1_fixed512.json "${H200_PINNED[@]}"
        add=(--add-to $Q/async_vs_sync_h200x1_fixed512.json)
    done
}

trainer_variants() {  # trainer_variants TIMEOUT_S [--variant ...]: the compiled engine against
    # cudnn attention and reduced accumulation (and any variants given), in one call
    local limit=$1
    shift
    step trainer_variants "$limit" python3 benchmarks/trainer.py --cases fixed_4k length_mix --loops engine \
        --profile 12 --engine-option trainer.compile=true \
        --variant cudnn trainer.attention_kernel=cudnn \
        --variant cudnn_reduced trainer.attention_kernel=cudnn fsdp.one_rank_accumulation=reduced \
        --variant reduced fsdp.one_rank_accumulation=reduced "$@" \
        --out $Q/trainer_variants_h200x1.json
}

issue34() {  # the compiled engine against its variants first (what decides), then the attention kernels
    trainer_variants 1500 \
        --variant bf16acc "fsdp.mixed_precision={param_dtype: bfloat16, reduce_dtype: bfloat16}" \
        --variant chunk4k trainer.logprob_chunk_tokens=4096
    step attention 600 python3 benchmarks/attention.py --kernels torch cudnn cudnn_repeat sdpa_padded \
        --out $Q/attention_h200x1.json
    step cudnn_test 600 python3 -m pytest -m gpu tests/gpu/test_attention_kernels_gpu.py -k cudnn -s -o addopts=""
}

issue50() {  # one H100: the 1.5B recipe as it stands (auto settings), sync and async, and the rollout
    # role against vLLM's offline LLM.generate in-process at 128 x 512, the engine's GPU contract test; then a
    # second pair and the ipc GPU test
    local avs=(python3 benchmarks/async_vs_sync.py --config configs/bench_1.5b.yaml --measured-steps 10)
    step avs1 900 "${avs[@]}" --run-root /root/avs1 --out $Q/async_vs_sync_h100x1.json
    step rollout 600 python3 benchmarks/rollout.py --config configs/bench_1.5b.yaml --prompts 128 --max-tokens 512 \
        --reps 3 --out $Q/rollout_h100x1.json
    step gpu_engine 600 python3 -m pytest -m gpu tests/gpu/test_rollout_engine_gpu.py -q -s -o addopts=""
    step avs2 900 "${avs[@]}" --run-root /root/avs2 --add-to $Q/async_vs_sync_h100x1.json \
        --out $Q/async_vs_sync_h100x1.json
    step gpu_ipc 600 python3 -m pytest -m gpu tests/gpu/test_weight_ipc.py -q -s -o addopts=""
}

issue50_tests() {  # the in-process engine's GPU tests alone (a short lease)
    step gpu_engine 300 python3 -m pytest -m gpu tests/gpu/test_rollout_engine_gpu.py -q -s -o addopts=""
    step gpu_ipc 400 python3 -m pytest -m gpu tests/gpu/test_weight_ipc.py -q -s -o addopts=""
}

issue51() {  # one H100: the 3B and 7B-LoRA recipes as they stand (auto settings), sync and async, 10 steps
    # each; then the in-process engine's GPU tests
    local avs=(python3 benchmarks/async_vs_sync.py --measured-steps 10)
    step avs_3b 1200 "${avs[@]}" --config configs/bench_3b.yaml --run-root /root/a3 \
        --out $Q/async_vs_sync_h100x1_3b.json
    step avs_7b_lora 1500 "${avs[@]}" --config configs/bench_7b_lora.yaml --run-root /root/a7l \
        --out $Q/async_vs_sync_h100x1_7b_lora.json
    issue50_tests
}

trainer_only() {  # issue 34's deciding run alone, needing no vLLM (carry 0, then `start trainer_only`)
    trainer_variants 900
}

queues() {
    device_env
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
    for q in "$@"; do
        echo "== $q"
        "$q"
    done
    echo "$(date -u +%H:%M:%S) queues done"
    touch "$Q/done"
}

poll() {  # poll SECONDS: wait for the queues (at most SECONDS), then copy what they wrote
    local until=$((SECONDS + $1))
    while [ ! -e "$Q/done" ] && [ $SECONDS -lt "$until" ]; do sleep 10; done
    mkdir -p "$OUT/q"
    cp -f "$Q"/*.json "$OUT/q/" 2>/dev/null
    # Every step's log and every run's role logs (only: no checkpoints or models), in one file
    # (a call brings back at most 8 files): a failure's cause is in there.
    {
        find "$Q" -maxdepth 1 -name '*.log'
        find /root -maxdepth 4 -type d -name logs -not -path '*/.*' 2>/dev/null
        find /tmp -maxdepth 2 -type d -name logs -path '*tandem-bench*' 2>/dev/null
    } | tar czf "$OUT/q/logs.tgz" -T - 2>/dev/null
    cat "$Q/queue.log"
    [ -e "$Q/done" ] && echo "all queues done"
}

"$@"
