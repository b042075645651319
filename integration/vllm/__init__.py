# SPDX-License-Identifier: Apache-2.0
"""ringkv's vLLM plugin. ``register()`` is the ``vllm.general_plugins`` entry point (it runs in every vLLM
process): it installs what ringkv changes in vLLM, listed in one table (``patches.PATCHES``): the ring KV spec and
manager, the ring attention backend as ``CUSTOM`` and ``RINGKV``, the prefix-hit cap that keeps prefix caching
exact with rings (``prefix_cache.py``), the ordering fix for Model Runner V2's DFlash context store
(``speculator.py``), and the rest."""

from __future__ import annotations

from .names import BACKEND_PATH

__all__ = ["BACKEND_PATH", "register"]

_registered = False


def register() -> None:
    """Register ringkv with vLLM (idempotent: each entry of ``patches.PATCHES`` is installed at most once)."""
    global _registered
    if _registered:
        return
    from .patches import install

    install()
    _registered = True
