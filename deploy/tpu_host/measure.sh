#!/usr/bin/env bash
# Issue #49's measurements on one TPU host, in one go (docs/training.md, "Running on a TPU host"):
# install offline, then the fused head alone, llama_150m and the 600M shape through train_main, the
# same config through Levanter's train_lm, and the memory estimate beside XLA's. Each run's output goes
# to DIR (default ./tpu-measurements); each step has its own time limit, so one that hangs costs only
# its own. Run from the repository root:   bash deploy/tpu_host/measure.sh [DIR]
set -uo pipefail
out=${1:-tpu-measurements}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 GIT_PYTHON_REFRESH=quiet
SECONDS=0

step() {  # step NAME LIMIT_S COMMAND...: run it, keep its output in DIR/NAME.txt, print its last lines
  local name=$1 limit=$2
  shift 2
  timeout "$limit" "$@" > "$out/$name.txt" 2>&1
  echo "== $name: exit $? at ${SECONDS}s"
  grep -v '^{' "$out/$name.txt" | tail -n 4
}

bash deploy/tpu_host/install.sh > "$out/install.txt" 2>&1 || { tail -n 20 "$out/install.txt"; exit 1; }
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}/tmp/site
echo "== installed at ${SECONDS}s"

step fused_head_512 120 python3 benchmarks/fused_loss.py --tokens 65536 --hidden 512 --vocab 128256
# The planner's pick at batch 64 first: its data (the most tokens) serves the later runs.
step llama_150m_b64 240 python3 benchmarks/gpu_train.py --accelerator tpu --size llama_150m --variants data_parallel \
    --steps 12 --workdir /tmp/measure
step llama_150m_b32 240 python3 benchmarks/gpu_train.py --accelerator tpu --size llama_150m --variants data_parallel \
    --batch-size 32 --gradient-checkpointing off --fused-loss on --steps 12 --workdir /tmp/measure
step llama_600m 300 python3 benchmarks/gpu_train.py --accelerator tpu --size llama_600m --variants data_parallel \
    --steps 10 --workdir /tmp/measure
step train_lm_baseline 300 python3 benchmarks/gpu_train.py --accelerator tpu --size llama_150m --variants data_parallel \
    --batch-size 16 --gradient-checkpointing off --fused-loss off --cross-entropy-block-size 4096 --steps 12 \
    --train-lm --workdir /tmp/measure
step memory_150m 180 python3 -m benchmarks.memory_fit --shape llama_150m --batch 32 --checkpointing off --fused-loss
echo "== done in ${SECONDS}s; outputs in $out"
