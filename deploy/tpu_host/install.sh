#!/usr/bin/env bash
# Install, without network, what a TPU host lacks for the training, evaluation and export processes
# (docs/tpu-host.md): the wheelhouse (build_wheelhouse.sh) and requirements-host-index.txt from the
# host's own index, into one folder to append to PYTHONPATH. Never jax, jaxlib, libtpu, numpy or
# scipy: --no-deps keeps pip from bringing its own, and the host's stay first on the path.
#   deploy/tpu_host/install.sh [WHEELHOUSE]      (default: .whl-tpu in the repository root)
# Environment: SITE (default /tmp/site), HOST_INDEX (default file:///opt/pypi/simple), PYTHON (python3).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
wheelhouse=${1:-$here/../../.whl-tpu}
site=${SITE:-/tmp/site}
index=${HOST_INDEX:-file:///opt/pypi/simple}
python=${PYTHON:-python3}
# One pip call for both lists: installs into one --target folder do not merge shared folders
# (bin/, namespace packages); a second call would replace them.
# pip warns, for each wheelhouse package, that the index has no page for it: expected, so not shown.
PIP_CONFIG_FILE=/dev/null "$python" -m pip install --isolated --disable-pip-version-check --quiet --no-deps --no-compile \
    --no-cache-dir --only-binary=:all: --upgrade --target "$site" --index-url "$index" --find-links "$wheelhouse" \
    -r "$here/requirements-wheelhouse.txt" -r "$here/requirements-host-index.txt" \
    2> >(grep -v "is ignored: it is neither a file nor a directory" >&2)
PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$site" "$python" "$here/check_install.py" "$site"
echo "installed; before running the processes: export PYTHONPATH=\$PYTHONPATH:$site"
