#!/usr/bin/env bash
# mypy over the package as it is installed: dp_plugin/ plus the adapters at
# dp_plugin/torch, dp_plugin/tensorflow and dp_plugin/keras. Run on the source tree instead,
# mypy would take adapters/torch for the real `torch` package and hide it.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
tree=$(mktemp -d)
trap 'rm -rf "$tree"' EXIT
mkdir "$tree/dp_plugin"
for entry in "$root"/dp_plugin/*; do
    ln -s "$entry" "$tree/dp_plugin/$(basename "$entry")"
done
for adapter in "$root"/adapters/*/; do
    ln -s "${adapter%/}" "$tree/dp_plugin/$(basename "$adapter")"
done
cd "$tree"
"$root/.venv/bin/mypy" --config-file "$root/pyproject.toml" --cache-dir "$root/.mypy_cache" -p dp_plugin
