#!/usr/bin/env bash
# Build Horovod 0.28.1 (PyTorch + Gloo, CPU) against the venv's torch and
# install it; the built wheel is cached outside the repository, keyed by the
# Horovod, torch and Python versions, so a second install takes seconds.
#
# Why a patch: Horovod 0.28.1 compiles its torch extension as C++14, and torch
# >= 2.1 headers need C++17 (they use C++17 library features). Raising
# CMAKE_CXX_STANDARD to 17 in two CMakeLists.txt is enough.
set -euo pipefail

PY=${1:?usage: build_horovod.sh PATH_TO_VENV_PYTHON}
HOROVOD_VERSION=0.28.1
TORCH_VERSION=$("$PY" -c 'import torch; print(torch.__version__.split("+")[0])')
PY_TAG=$("$PY" -c 'import sys; print(f"cp{sys.version_info[0]}{sys.version_info[1]}")')
CACHE_ROOT=${DP_PLUGIN_WHEEL_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/dp_plugin/wheels}
CACHE_DIR="$CACHE_ROOT/horovod-$HOROVOD_VERSION-torch$TORCH_VERSION-$PY_TAG"

if "$PY" -c "import horovod.torch" 2>/dev/null && \
   [ "$("$PY" -c 'import horovod; print(horovod.__version__)')" = "$HOROVOD_VERSION" ]; then
    echo "build_horovod: horovod $HOROVOD_VERSION already installed"
    exit 0
fi

shopt -s nullglob
cached=("$CACHE_DIR"/horovod-"$HOROVOD_VERSION"-*.whl)
if [ ${#cached[@]} -eq 0 ]; then
    echo "build_horovod: building horovod $HOROVOD_VERSION for torch $TORCH_VERSION ($PY_TAG); about 2 minutes on 2 cores"
    work=$(mktemp -d)
    trap 'rm -rf "$work"' EXIT
    "$PY" -m pip download --quiet --no-deps --no-binary :all: "horovod==$HOROVOD_VERSION" -d "$work"
    tar -xzf "$work/horovod-$HOROVOD_VERSION.tar.gz" -C "$work"
    src="$work/horovod-$HOROVOD_VERSION"
    for f in "$src/CMakeLists.txt" "$src/horovod/torch/CMakeLists.txt"; do
        grep -q 'set(CMAKE_CXX_STANDARD 14)' "$f" || {
            echo "build_horovod: $f has no 'set(CMAKE_CXX_STANDARD 14)'; the patch no longer applies" >&2
            exit 1
        }
        sed -i 's/set(CMAKE_CXX_STANDARD 14)/set(CMAKE_CXX_STANDARD 17)/' "$f"
    done
    mkdir -p "$work/out"
    HOROVOD_WITH_PYTORCH=1 HOROVOD_WITH_GLOO=1 HOROVOD_WITHOUT_MPI=1 \
    HOROVOD_WITHOUT_TENSORFLOW=1 HOROVOD_WITHOUT_MXNET=1 \
    MAKEFLAGS="-j$(nproc)" \
        "$PY" -m pip wheel --no-build-isolation --no-deps -w "$work/out" "$src" \
        > "$work/build.log" 2>&1 || {
            echo "build_horovod: the build failed; last lines of its log:" >&2
            tail -40 "$work/build.log" >&2
            exit 1
        }
    mkdir -p "$CACHE_DIR"
    cp "$work"/out/horovod-*.whl "$CACHE_DIR/"
    cached=("$CACHE_DIR"/horovod-"$HOROVOD_VERSION"-*.whl)
fi
"$PY" -m pip install --quiet --no-deps --force-reinstall "${cached[0]}"
"$PY" -c "import horovod.torch as hvd; assert hvd.gloo_built(), 'horovod was built without Gloo'"
echo "build_horovod: installed ${cached[0]}"
