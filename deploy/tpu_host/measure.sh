#!/usr/bin/env bash
# Issue #49's measurements on one TPU host (docs/training.md, "Running on a TPU host"): install offline,
# then the runs named (all of them by default, in the order below). Each run's output goes to
# DIR/NAME.txt (default DIR ./tpu-measurements) and each has its own time limit, so one that hangs
# costs only its own. Name a few at a time where a session's calls are short. From the repository root:
#   bash deploy/tpu_host/measure.sh [DIR [NAME...]]
# Names: fused_head_512 llama_150m_b64 llama_150m_b32 llama_600m train_lm_baseline memory_150m, and named_run
# (the demo's run from the bundle .tpu-bundle that named_run.py made here; not in the default list).
set -uo pipefail
out=${1:-tpu-measurements}
shift || true
names=("$@")
[ ${#names[@]} -gt 0 ] || names=(fused_head_512 llama_150m_b64 llama_150m_b32 llama_600m train_lm_baseline memory_150m)
mkdir -p "$out"
export PYTHONUNBUFFERED=1 GIT_PYTHON_REFRESH=quiet
SECONDS=0

if [ ! -d /tmp/site/levanter ]; then
    bash deploy/tpu_host/install.sh > "$out/install.txt" 2>&1 || { tail -n 20 "$out/install.txt"; exit 1; }
fi
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}/tmp/site
echo "== installed at ${SECONDS}s"

# The first training run asks the device for its TPU type and count (a child process that opens the
# chip, about 15 s); the later ones are told, as a user may tell gpu_train with --devices and --tpu-type.
device=()
step() {  # step NAME LIMIT_S COMMAND...: run it, keep its output in DIR/NAME.txt, print its last lines
    local name=$1 limit=$2
    shift 2
    timeout "$limit" "$@" > "$out/$name.txt" 2>&1
    echo "== $name: exit $? at ${SECONDS}s"
    grep -v '^{' "$out/$name.txt" | tail -n 4
    if [ ${#device[@]} -eq 0 ] && [ "$1" = python3 ] && [ "$2" = benchmarks/gpu_train.py ]; then
        read -r -a device < <(tail -n 1 "$out/$name.txt" | python3 -c \
            'import json,sys; r=json.load(sys.stdin); print("--devices", r["device_count"], "--tpu-type", r["tpu_type"])' \
            2>/dev/null)
    fi
}
train() {  # train NAME LIMIT_S GPU_TRAIN_ARGS...: one benchmarks/gpu_train.py run on the TPU
    local name=$1 limit=$2
    shift 2
    step "$name" "$limit" python3 benchmarks/gpu_train.py --accelerator tpu --variants data_parallel "${device[@]}" \
        --workdir /tmp/measure "$@"
}

for name in "${names[@]}"; do
    case $name in
        fused_head_512) step "$name" 120 python3 benchmarks/fused_loss.py --tokens 65536 --hidden 512 --vocab 128256 ;;
        # The planner's pick at batch 64: its data (the most tokens) serves the later runs.
        llama_150m_b64) train "$name" 240 --size llama_150m --steps 12 ;;
        llama_150m_b32) train "$name" 240 --size llama_150m --batch-size 32 --gradient-checkpointing off \
            --fused-loss on --steps 12 ;;
        llama_600m) train "$name" 300 --size llama_600m --steps 10 ;;
        # The same config through train_main and through Levanter's train_lm: what the project's process costs.
        train_lm_baseline) train "$name" 300 --size llama_150m --batch-size 16 --gradient-checkpointing off \
            --fused-loss off --cross-entropy-block-size 4096 --steps 12 --train-lm ;;
        memory_150m) step "$name" 180 python3 -m benchmarks.memory_fit --shape llama_150m --batch 32 \
            --checkpointing off --fused-loss ;;
        named_run) step "$name" 300 python3 deploy/tpu_host/named_run.py run .tpu-bundle --out "$out/named_run" ;;
        *) echo "measure.sh: unknown run $name" >&2; exit 2 ;;
    esac
done
echo "== done in ${SECONDS}s; outputs in $out"
