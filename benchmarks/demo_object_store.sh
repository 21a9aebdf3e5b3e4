#!/bin/bash
# `marin demo` on local disk, then on an S3 prefix, one after the other, each from an empty store
# and a fresh DAGSTER_HOME; prints wall times and the load average around each run.
#
#   AWS_ENDPOINT_URL=http://127.0.0.1:5000 AWS_ACCESS_KEY_ID=testing AWS_SECRET_ACCESS_KEY=testing \
#     benchmarks/demo_object_store.sh [WORK_DIR]
#
# With no endpoint set it uses AWS itself. The bucket `marin-demo-<epoch>` is created first.
set -u
REPO=$(cd "$(dirname "$0")/.." && pwd)
PY=${PYTHON:-$REPO/.venv/bin/python}
WORK=${1:-$(mktemp -d)}
export MARIN_ENV=local
rm -rf "$WORK/local" "$WORK/s3" && mkdir -p "$WORK/local" "$WORK/s3"
load() { cut -d' ' -f1-3 /proc/loadavg; }

run() {  # name prefix
    echo "$1: start $(date -u +%T), load $(load)"
    local s e rc
    s=$(date +%s.%N)
    (cd "$WORK/$1" && MARIN_PREFIX=$2 DAGSTER_HOME=$WORK/$1/home "$PY" -m marin_assets.cli demo > out.log 2>&1)
    rc=$?
    e=$(date +%s.%N)
    echo "$1: exit $rc, wall $(echo "$e - $s" | bc) s, load $(load); log $WORK/$1/out.log"
}

run local "$WORK/local/store"
BUCKET=marin-demo-$(date +%s)
"$PY" -c "import s3fs; s3fs.S3FileSystem().mkdir('$BUCKET')"
run s3 "s3://$BUCKET/store"
