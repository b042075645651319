#!/usr/bin/env bash
# The prepared GPU run on a machine with torch + triton (+ typer, rich) but no install of ringkv and no network:
# map the checkout's folders under an import root `ringkv` (a namespace package) and run `ringkv bench gpu-check`.
#   bash bench/on_gpu.sh --out "$OUT" [--vllm-source DIR] [--budget-s 300] [--skip-tests]
set -euo pipefail
checkout="$(cd "$(dirname "$0")/.." && pwd)"
root="$(mktemp -d)"
mkdir -p "$root/ringkv"
for folder in kernels dflash2 integration bench; do
  ln -s "$checkout/$folder" "$root/ringkv/$folder"
done
cd "$checkout"
PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}" exec python3 -m ringkv.bench.cli bench gpu-check "$@"
