#!/usr/bin/env bash
# Set the per-pool concurrency limits of a Dagster instance.
#
# Dagster 1.13 reads only `concurrency.pools.default_limit` from dagster.yaml; a limit for one
# named pool is instance state stored in the event-log database, set with
# `dagster instance concurrency set POOL LIMIT`. Run this once per instance and again whenever
# the cluster's accelerator capacity changes. It is idempotent.
#
# Usage (anywhere the instance is reachable, i.e. DAGSTER_HOME holds its dagster.yaml):
#   deploy/set_pools.sh
#   kubectl exec -i deploy/dagster-daemon -- bash -s < deploy/set_pools.sh
#
# Limits count concurrently executing assets in the pool across all runs:
#   cpu-train  CPU-only training/tokenization pods       (MARIN_POOL_CPU_TRAIN, default 4)
#   gpu        GPU training pods, one per GPU node group  (MARIN_POOL_GPU, default 2)
#   tpu        TPU slices, one per slice                  (MARIN_POOL_TPU, default 1)
set -euo pipefail

: "${DAGSTER_HOME:?DAGSTER_HOME must point at the instance directory (holding dagster.yaml)}"

declare -A limits=(
  [cpu-train]="${MARIN_POOL_CPU_TRAIN:-4}"
  [gpu]="${MARIN_POOL_GPU:-2}"
  [tpu]="${MARIN_POOL_TPU:-1}"
)

pools=(cpu-train gpu tpu)

# Validate every limit before touching the instance, so a typo never leaves it half-updated.
for pool in "${pools[@]}"; do
  if ! [[ "${limits[$pool]}" =~ ^[0-9]+$ ]]; then
    echo "set_pools.sh: limit for pool $pool must be a non-negative integer, got '${limits[$pool]}'" >&2
    exit 2
  fi
done

for pool in "${pools[@]}"; do
  dagster instance concurrency set "$pool" "${limits[$pool]}"
done
