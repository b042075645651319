# SPDX-License-Identifier: Apache-2.0
"""vLLM's own engine serving the drafter on the ring, measured: a probe the worker installs in every vLLM process
of its run (``RINGKV_E2E_PROBE``), one engine run per process (``worker``), and the comparison of runs
(``runner``)."""
