# SPDX-License-Identifier: Apache-2.0
"""The plugin's error classes, in a leaf module: each says what the ring cannot serve and names the fix."""

from __future__ import annotations


class RingConfigError(ValueError):
    """A vLLM configuration the ring cannot serve correctly; the message names the fix."""


class RingSelectionError(ValueError):
    """The ring backend was selected where it cannot run; the message names the fix."""
