# SPDX-License-Identifier: Apache-2.0
"""The one way ringkv replaces a vLLM function: at most once per process, however often the plugin is loaded
(vLLM runs ``register()`` in every process, and tests call it again). The replacement carries a marker and
``__wrapped__`` (the original), so a second install sees the marker and leaves it, and ``wrap_count`` can tell
how many ringkv wraps are stacked (one, or none). What is wrapped, and why, is listed in ``patches.py``."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

MARKER = "_ringkv_wrapped"

WrapperFactory = Callable[[Callable[..., Any]], Callable[..., Any]]


def wrap_once(owner: Any, attribute: str, make_wrapper: WrapperFactory) -> bool:
    """Replace ``owner.attribute`` by ``make_wrapper(original)`` unless ringkv's wrap is already there; whether it
    wrapped now. ``original`` is what ``getattr`` returns (bound to the class for a classmethod), and the wrapper
    is installed the way the original was defined (a classmethod stays one)."""
    original = getattr(owner, attribute)
    if getattr(original, MARKER, False):
        return False
    wrapper = functools.update_wrapper(make_wrapper(original), original)
    setattr(wrapper, MARKER, True)
    defined = inspect.getattr_static(owner, attribute)
    if isinstance(defined, classmethod):
        wrapper = classmethod(wrapper)
    elif isinstance(defined, staticmethod):
        wrapper = staticmethod(wrapper)
    setattr(owner, attribute, wrapper)
    return True


def wrap_count(owner: Any, attribute: str) -> int:
    """How many ringkv wraps ``owner.attribute`` carries, following ``__wrapped__`` (0 or 1 unless broken)."""
    count, function = 0, getattr(owner, attribute)
    while function is not None:
        count += bool(getattr(function, MARKER, False))
        function = getattr(function, "__wrapped__", None)
    return count
