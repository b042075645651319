# SPDX-License-Identifier: Apache-2.0
"""vLLM's private internals are reached only through ``integration/vllm/_compat.py``: read from the source with
``ast`` (nothing imported), no other plugin module reads or writes an ``_underscored`` attribute, except the ones
listed here, each ringkv's own or a public Python API. (The vLLM functions ringkv wraps, private ones included, are
named by string in ``patches.PATCHES``, the table of every change ringkv makes in vLLM.)"""

from __future__ import annotations

import ast
from pathlib import Path

PLUGIN = Path(__file__).resolve().parents[2] / "integration" / "vllm"

# (module, attribute): why it is not a private vLLM attribute
EXCEPTIONS = {
    ("backend_step.py", "_local"): "ContextSlots' own thread-local step cache",
    ("eviction.py", "_by_pool"): "CachedTails' own registry of registries",
    ("metadata.py", "_build"): "RingKVMetadataBuilder's own build step",
    ("selection.py", "_asdict"): "a NamedTuple's public method (vLLM's selector config)",
}


def private_attributes(path: Path) -> set[str]:
    """Every ``x._name`` attribute the module's code reads or writes (docstrings and comments aside; dunders too)."""
    tree = ast.parse(path.read_text(), str(path))
    return {
        node.attr
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")
    }


def found_outside_compat() -> set[tuple[str, str]]:
    return {
        (path.name, attribute)
        for path in sorted(PLUGIN.glob("*.py"))
        if path.name != "_compat.py"
        for attribute in private_attributes(path)
    }


def test_no_plugin_module_but_compat_touches_a_private_attribute():
    unlisted = sorted(found_outside_compat() - set(EXCEPTIONS))
    assert not unlisted, (
        f"private attributes reached outside _compat.py: {unlisted}; give each vLLM internal a named helper in "
        "integration/vllm/_compat.py (or list ringkv's own attribute in EXCEPTIONS, saying why)"
    )


def test_every_listed_exception_is_still_there():
    stale = sorted(set(EXCEPTIONS) - found_outside_compat())
    assert not stale, f"EXCEPTIONS lists attributes no module uses any more: {stale}; remove them"


def test_the_walk_finds_a_private_access(tmp_path):
    """The check reads attribute accesses in code, not names in docstrings."""
    module = tmp_path / "module.py"
    module.write_text('"""Wraps ``Pool._evict``."""\n\ndef f(pool):\n    pool._maybe_evict_cached_block(None)\n')
    assert private_attributes(module) == {"_maybe_evict_cached_block"}
