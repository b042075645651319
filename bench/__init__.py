# SPDX-License-Identifier: Apache-2.0
"""ringkv's benchmarks (``ringkv bench ...``): CPU figures with vLLM's own scheduling code, the native compile
report, the prepared GPU check. Results land in ``bench/results/`` with an environment record per row."""
