# SPDX-License-Identifier: Apache-2.0
"""DFlash / DFlash2 drafter configuration, parsed from the raw ``config.json``.

transformers' ``Qwen3Config`` drops ``sliding_window`` unless ``use_sliding_window`` is set and derives
``layer_types`` from ``max_window_layers``, so the raw fields are read here. Each layer's (window, causal)
is resolved in the order of vLLM's ``_resolve_layer_attention`` / ``_dflash_layer_causal``:

* window: ``dflash_config.use_swa`` makes every layer sliding when ``layer_types`` has no sliding layer
  (or is absent); otherwise ``layer_types[i] == "sliding_attention"``. The window is
  ``dflash_config.swa_window_size``, else the top-level ``sliding_window``.
* causal: ``is_causal`` if present (all layers), else ``dflash_config.causal``, else causal iff the layer
  type is ``sliding_attention`` (no ``layer_types``: non-causal).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SLIDING = "sliding_attention"
FULL = "full_attention"


class DFlashConfigError(ValueError):
    """A config.json ringkv cannot serve; the message names the field."""


@dataclass(frozen=True)
class LayerAttention:
    """One drafter layer: ``window`` (None = full attention) and causality among its block keys."""

    window: int | None
    causal: bool

    @property
    def ring_backed(self) -> bool:
        return self.window is not None


@dataclass(frozen=True)
class DFlashConfig:
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    attention_bias: bool
    draft_block: int
    target_layer_ids: tuple[int, ...]
    mask_token_id: int
    conv_kernel_size: int | None
    conv_group_size: int | None
    layers: tuple[LayerAttention, ...]

    @property
    def num_speculative_tokens(self) -> int:
        """The speculative tokens the drafter was trained to fill: its draft block - 1."""
        return self.draft_block - 1

    @property
    def is_dflash2(self) -> bool:
        """DFlash2 adds the block-local grouped convolution around attention and MLP."""
        return self.conv_kernel_size is not None

    def to_dict(self) -> dict[str, Any]:
        """The fields a ``config.json`` needs to reproduce this config."""
        layer_types = [SLIDING if layer.window is not None else FULL for layer in self.layers]
        windows = {layer.window for layer in self.layers if layer.window is not None}
        causal = {layer.causal for layer in self.layers}
        config: dict[str, Any] = {
            "architectures": ["DFlash2DraftModel" if self.is_dflash2 else "DFlashDraftModel"],
            # what transformers' Qwen3Config (vLLM reads the drafter through it) needs besides the fields above
            "model_type": "qwen3", "hidden_act": "silu", "tie_word_embeddings": False,
            "hidden_size": self.hidden_size, "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers, "num_attention_heads": self.num_q_heads,
            "num_key_value_heads": self.num_kv_heads, "head_dim": self.head_dim, "vocab_size": self.vocab_size,
            "rms_norm_eps": self.rms_norm_eps, "rope_theta": self.rope_theta,
            "max_position_embeddings": self.max_position_embeddings, "attention_bias": self.attention_bias,
            "layer_types": layer_types,
            "dflash_config": {"block_size": self.draft_block, "target_layer_ids": list(self.target_layer_ids),
                              "mask_token_id": self.mask_token_id},
        }  # fmt: skip
        if windows:
            # Qwen3Config drops sliding_window unless use_sliding_window is set
            config.update(sliding_window=windows.pop(), use_sliding_window=True)
        if len(causal) == 1:
            config["is_causal"] = causal.pop()
        if self.is_dflash2:
            config["dflash_config"].update(conv_kernel_size=self.conv_kernel_size, conv_group_size=self.conv_group_size)
        return config


def _required(raw: dict[str, Any], name: str, source: str) -> Any:
    if raw.get(name) is None:
        raise DFlashConfigError(f"{source}: '{name}' is missing; ringkv reads it from the raw config.json")
    return raw[name]


def resolve_layer(raw: dict[str, Any], index: int) -> LayerAttention:
    """(window, causal) of layer ``index`` in vLLM's resolution order (module docstring)."""
    dflash = raw.get("dflash_config") or {}
    layer_types = raw.get("layer_types")
    use_swa = bool(dflash.get("use_swa", False))
    if layer_types is not None:
        unknown = sorted({t for t in layer_types if t not in (SLIDING, FULL)})
        if unknown:
            raise DFlashConfigError(f"layer_types has unknown entries {unknown}; expected {SLIDING!r} / {FULL!r}")
        if len(layer_types) != raw.get("num_hidden_layers", len(layer_types)):
            raise DFlashConfigError(
                f"layer_types has {len(layer_types)} entries for num_hidden_layers={raw['num_hidden_layers']}"
            )
    any_sliding = layer_types is not None and SLIDING in layer_types
    sliding = use_swa if layer_types is None or (use_swa and not any_sliding) else layer_types[index] == SLIDING
    window = None
    if sliding:
        window = dflash.get("swa_window_size", raw.get("sliding_window"))
        if window is None:
            raise DFlashConfigError(
                "a sliding layer needs dflash_config.swa_window_size or the top-level sliding_window"
            )
        window = int(window)
    if raw.get("is_causal") is not None:
        causal = bool(raw["is_causal"])
    elif dflash.get("causal") is not None:
        causal = bool(dflash["causal"])
    else:
        causal = bool(layer_types) and layer_types[index] == SLIDING
    return LayerAttention(window=window, causal=causal)


def parse_config(raw: dict[str, Any], source: str = "config.json") -> DFlashConfig:
    """A ``DFlashConfig`` from a raw config dict; every problem is a ``DFlashConfigError`` naming the field."""
    dflash = raw.get("dflash_config") or {}
    num_layers = int(_required(raw, "num_hidden_layers", source))
    draft_block = int(dflash.get("block_size", raw.get("block_size", 16)))
    layers = tuple(resolve_layer(raw, i) for i in range(num_layers))
    for i, layer in enumerate(layers):
        if layer.window is not None and layer.window < draft_block:
            raise DFlashConfigError(
                f"{source}: layer {i} window {layer.window} is smaller than the draft block size {draft_block}; "
                "a draft block must fit its own window (B <= W)"
            )
    rope = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    rope_theta = float(raw.get("rope_theta", rope.get("rope_theta", 10_000.0)))
    if rope.get("rope_type", rope.get("type", "default")) not in ("default", None):
        raise DFlashConfigError(f"{source}: rope type {rope.get('rope_type', rope.get('type'))!r} is not supported")
    conv_taps = dflash.get("conv_kernel_size")
    return DFlashConfig(
        hidden_size=int(_required(raw, "hidden_size", source)),
        intermediate_size=int(_required(raw, "intermediate_size", source)),
        num_layers=num_layers,
        num_q_heads=int(_required(raw, "num_attention_heads", source)),
        num_kv_heads=int(raw.get("num_key_value_heads") or _required(raw, "num_attention_heads", source)),
        head_dim=int(_required(raw, "head_dim", source)),
        vocab_size=int(_required(raw, "vocab_size", source)),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        rope_theta=rope_theta,
        max_position_embeddings=int(raw.get("max_position_embeddings", 262_144)),
        attention_bias=bool(raw.get("attention_bias", False)),
        draft_block=draft_block,
        target_layer_ids=tuple(int(i) for i in _required(dflash, "target_layer_ids", f"{source} dflash_config")),
        mask_token_id=int(_required(dflash, "mask_token_id", f"{source} dflash_config")),
        conv_kernel_size=None if conv_taps is None else int(conv_taps),
        conv_group_size=None if conv_taps is None else int(_required(dflash, "conv_group_size", source)),
        layers=layers,
    )


def load_config(path: str | Path) -> DFlashConfig:
    """Parse ``path`` (a ``config.json`` or the checkpoint folder holding it)."""
    path = Path(path)
    if path.is_dir():
        path = path / "config.json"
    try:
        raw = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as error:
        raise DFlashConfigError(
            f"{path}: not a readable JSON config ({error}); give the drafter's config.json"
        ) from error
    if not isinstance(raw, dict):
        raise DFlashConfigError(f"{path}: a JSON {type(raw).__name__}, not an object; give the drafter's config.json")
    return parse_config(raw, source=str(path))
