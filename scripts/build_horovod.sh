#!/usr/bin/env bash
# Build Horovod 0.28.1 (PyTorch + Gloo, CPU) against the venv's torch and
# install it (used by `make install`). The work is done by
# dp_plugin/cli/build_horovod.py, the code behind `dp-plugin build-horovod`
# that ships inside the package; it needs only the standard library, so it
# runs here before dp_plugin itself is installed. See docs/horovod-build.md.
set -euo pipefail

PY=${1:?usage: build_horovod.sh PATH_TO_VENV_PYTHON}
exec "$PY" "$(dirname "$0")/../dp_plugin/cli/build_horovod.py" --python "$PY"
