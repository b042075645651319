# SPDX-License-Identifier: Apache-2.0
"""A tiny DFlash2 drafter that vLLM's ``DFlash2DraftModel`` (``qwen3_dflash2.py``, vLLM 0.34) loads, trained
offline in seconds to agree with ``engine_models``' chain target part of the time.

vLLM's DFlash2 is DFlash (``fc`` + ``hidden_norm`` over the target's features feeding every layer's context K/V,
the target's embedding and head) plus, per layer, the grouped block convolutions ``attention_conv`` / ``mlp_conv``
(``base_kernel [2, taps, hidden]``, ``kernel_projection``) and a candidate selector: the head's top-k tokens per
draft position, re-scored by ``unary + (predecessor_codebook[previous] * hidden_projection(h)) .
successor_codebook[candidate]`` and walked greedily from the anchor. ringkv's ``DFlash2Drafter`` has the same
layers (names included); ``CandidateSelector`` below is the selector, trained on the full vocabulary with the
true previous token (what the walk sees while its drafts are right). Trained like the DFlash drafter
(``engine_models.train_drafter``): through its context K/V, so a ring that serves the wrong K/V collapses its
acceptance.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch
from ringkv.dflash2.config import SLIDING, DFlashConfig, parse_config
from ringkv.dflash2.model import DFlash2Drafter
from torch import nn

from .engine_models import EngineModels, EngineModelSpec, build_target, reuse_or_build, train_drafter

ARCHITECTURE = "DFlash2DraftModel"


@dataclass(frozen=True)
class DFlash2ModelSpec:
    """The chain target and drafter shapes (``models``; ``models.drafter_window`` is the sliding layers'
    window), each drafter layer's kind, and DFlash2's convolution and selector sizes."""

    models: EngineModelSpec = field(default_factory=lambda: EngineModelSpec(draft_block=4))
    layer_types: tuple[str, ...] = (SLIDING, SLIDING)
    conv_kernel_size: int = 2
    conv_group_size: int = 32
    selector_rank: int = 16
    selector_top_k: int = 4


class CandidateSelector(nn.Module):
    """vLLM's ``CandidateSelector`` weights (checkpoint names ``candidate_selector.*``) and its edge score."""

    def __init__(self, hidden_size: int, vocab_size: int, rank: int) -> None:
        super().__init__()
        self.predecessor_codebook = nn.Parameter(0.1 * torch.randn(vocab_size, rank))
        self.successor_codebook = nn.Parameter(0.1 * torch.randn(vocab_size, rank))
        self.hidden_projection = nn.Linear(hidden_size, rank, bias=False)

    def edge_logits(self, hidden: torch.Tensor, previous: torch.Tensor) -> torch.Tensor:
        weighted = self.predecessor_codebook[previous] * self.hidden_projection(hidden)
        return weighted @ self.successor_codebook.T


def drafter_config(spec: DFlash2ModelSpec) -> tuple[DFlashConfig, dict]:
    """ringkv's parsed config and the raw ``config.json`` vLLM reads (the selector's keys included)."""
    shape = spec.models
    if len(spec.layer_types) != shape.drafter_layers:
        raise ValueError(f"{len(spec.layer_types)} layer types for {shape.drafter_layers} drafter layers")
    raw = {
        "architectures": [ARCHITECTURE], "model_type": "qwen3", "hidden_act": "silu", "tie_word_embeddings": False,
        "hidden_size": shape.hidden_size, "intermediate_size": 2 * shape.hidden_size,
        "num_hidden_layers": shape.drafter_layers, "num_attention_heads": shape.num_q_heads,
        "num_key_value_heads": shape.num_kv_heads, "head_dim": shape.head_dim, "vocab_size": shape.vocab_size,
        "rms_norm_eps": 1e-6, "rope_theta": 10_000.0, "max_position_embeddings": shape.max_positions,
        "attention_bias": False, "is_causal": False, "layer_types": list(spec.layer_types),
        "dflash_config": {"block_size": shape.draft_block, "target_layer_ids": list(shape.target_layer_ids),
                          "mask_token_id": shape.vocab_size - 1, "conv_kernel_size": spec.conv_kernel_size,
                          "conv_group_size": spec.conv_group_size, "selector_rank": spec.selector_rank,
                          "selector_top_k": spec.selector_top_k},
    }  # fmt: skip
    if SLIDING in spec.layer_types:
        # Qwen3Config drops sliding_window unless use_sliding_window is set
        raw.update(sliding_window=shape.drafter_window, use_sliding_window=True)
    return parse_config(raw, source="DFlash2ModelSpec"), raw


def identity_convolutions(drafter: DFlash2Drafter) -> None:
    """Start every grouped convolution as the identity (tap 0 = 1), so training starts from DFlash."""
    with torch.no_grad():
        for layer in drafter.layers:
            for conv in (layer.attention_conv, layer.mlp_conv):
                conv.base_kernel.zero_()
                conv.base_kernel[:, 0] = 1.0


def save_drafter(folder: Path, raw_config: dict, drafter: DFlash2Drafter, selector: CandidateSelector) -> None:
    """``config.json`` + ``model.safetensors`` in the names vLLM's DFlash2 loader maps (no embedding or head:
    vLLM shares the target's)."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(raw_config, indent=1))
    weights = dict(drafter.state_dict())
    weights.update({f"candidate_selector.{name}": value for name, value in selector.state_dict().items()})
    save_file({name: value.detach().contiguous() for name, value in weights.items()}, str(folder / "model.safetensors"))


def build_dflash2_models(folder: str | Path, spec: DFlash2ModelSpec | None = None) -> EngineModels:
    """Build (or reuse, when ``folder`` holds the same spec) the chain target and the DFlash2 drafter."""
    spec = spec or DFlash2ModelSpec()
    folder = Path(folder)

    def build() -> float:
        target = build_target(spec.models, folder / "target")
        config, raw = drafter_config(spec)
        torch.manual_seed(spec.models.seed)
        drafter = DFlash2Drafter(config, target_hidden_size=spec.models.hidden_size)
        identity_convolutions(drafter)
        selector = CandidateSelector(spec.models.hidden_size, spec.models.vocab_size, spec.selector_rank)
        drafter, accuracy = train_drafter(spec.models, target, config, drafter, selector)
        save_drafter(folder / "drafter", raw, drafter, selector)
        return accuracy

    return reuse_or_build(folder, "dflash2_models.json", spec, spec.models, build)
