# SPDX-License-Identifier: Apache-2.0
"""Generated markdown between two marker lines of a hand-written page: the compile report's table in
bench/README.md (``compile_rows.py``), the vLLM version matrix in docs/compatibility.md (``ci/compat_table.py``)
and the table of what ringkv changes in vLLM in docs/vllm-plugin.md (``ci/patch_table.py``)."""

from __future__ import annotations


def splice(text: str, begin: str, end: str, body: str, *, where: str = "the text") -> str:
    """``text`` with what stands between ``begin`` and ``end`` replaced by a newline and ``body``, exactly (a
    ``body`` ending with a newline keeps ``end`` on a line of its own); the markers and the rest stay as they are.
    Each marker must stand once, ``begin`` first: otherwise a ValueError naming the marker, ``where`` and the fix."""
    for marker, place in ((begin, "above"), (end, "below")):
        count = text.count(marker)
        if count != 1:
            problem = f"has no {marker!r} marker" if count == 0 else f"has {count} {marker!r} markers"
            raise ValueError(f"{where} {problem}: keep one, on a line of its own {place} the generated section")
    start, stop = text.index(begin) + len(begin), text.index(end)
    if stop < start:
        raise ValueError(
            f"{where} has {end!r} before {begin!r}: put {begin!r} above the generated section and {end!r} below it"
        )
    return text[:start] + "\n" + body + text[stop:]
