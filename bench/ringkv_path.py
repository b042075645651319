# SPDX-License-Identifier: Apache-2.0
"""Make ``ringkv.*`` importable from a bare checkout (the GPU machine has no install of it)."""

from __future__ import annotations

import importlib
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PACKAGES = {"kernels": "kernels", "dflash2": "dflash2", "integration": "integration"}


def ensure_ringkv_importable() -> list[Path]:
    """Import ``ringkv.kernels``; if it is not installed, map the repo folders under a temporary ``ringkv/``.

    Returns the paths a child process needs on ``PYTHONPATH`` (the shim, if any, and the repo root).
    """
    paths = [REPO]
    try:
        importlib.import_module("ringkv.kernels")
    except ImportError:
        shim = Path(tempfile.gettempdir()) / "ringkv_shim"
        (shim / "ringkv").mkdir(parents=True, exist_ok=True)
        for name, folder in PACKAGES.items():
            link = shim / "ringkv" / name
            if not link.exists():
                link.symlink_to(REPO / folder, target_is_directory=True)
        sys.path.insert(0, str(shim))
        importlib.invalidate_caches()
        importlib.import_module("ringkv.kernels")
        paths.insert(0, shim)
    if str(REPO) not in sys.path:
        sys.path.append(str(REPO))
    return paths
