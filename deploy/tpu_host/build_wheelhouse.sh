#!/usr/bin/env bash
# Download what a TPU host lacks (requirements-wheelhouse.txt) as wheels for it: CPython 3.11 on
# x86-64 Linux, glibc 2.36 (read on the host). Run on a machine with network access; any OS will do,
# since pip picks the wheels for the host's platform, not this one's. docs/tpu-host.md.
#   deploy/tpu_host/build_wheelhouse.sh [DIR]     (default: .whl-tpu in the repository root)
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
dir=${1:-$here/../../.whl-tpu}
mkdir -p "$dir"
dir=$(cd "$dir" && pwd)
platforms=()
for tag in manylinux_2_36_x86_64 manylinux_2_35_x86_64 manylinux_2_34_x86_64 manylinux_2_31_x86_64 \
           manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 manylinux_2_17_x86_64 \
           manylinux2014_x86_64 manylinux1_x86_64; do
    platforms+=(--platform "$tag")
done
# --no-deps: the list is complete; the packages' own needs come from the host's index.
PIP_CONFIG_FILE=/dev/null python3 -m pip download --isolated --disable-pip-version-check --quiet --no-deps --only-binary=:all: \
    --python-version 3.11 --implementation cp "${platforms[@]}" \
    -d "$dir" -r "$here/requirements-wheelhouse.txt"
wanted=$(grep -c '^[a-z]' "$here/requirements-wheelhouse.txt")
found=$(find "$dir" -maxdepth 1 -name '*.whl' | wc -l)
if [ "$found" -ne "$wanted" ]; then
    echo "$dir holds $found wheels for $wanted requirements: remove the wheels not in the list and run again" >&2
    exit 1
fi
echo "$found wheels, $(du -cb "$dir"/*.whl | tail -1 | cut -f1) bytes in $dir"
