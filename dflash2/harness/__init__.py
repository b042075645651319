# SPDX-License-Identifier: Apache-2.0
"""The reference harness around the drafter: a ring / full-history K/V store, greedy speculative decoding
against a transformers target, tiny models (random, or built for vLLM's engine) and the long-context smoke.
Used by the tests, the CLI and the benchmarks; not what a deployment runs."""
