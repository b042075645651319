# SPDX-License-Identifier: Apache-2.0
"""Tiny random-weight DFlash2 drafters (and their target) for tests and the CPU smoke; no downloads."""

from __future__ import annotations

import torch
from ringkv.dflash2.config import DFlashConfig, parse_config
from ringkv.dflash2.model import DFlash2Drafter


def tiny_config(
    *,
    window: int = 16,
    draft_block: int = 4,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_q_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int = 16,
    vocab_size: int = 128,
    target_layer_ids: tuple[int, ...] = (0, 2),
    layer_types: list[str] | None = None,
    is_causal: bool = False,
) -> DFlashConfig:
    """A DFlash2 config in the fixture's style (all layers sliding, non-causal), scaled down."""
    return parse_config({
        "architectures": ["DFlash2DraftModel"], "hidden_size": hidden_size, "intermediate_size": 2 * hidden_size,
        "num_hidden_layers": num_layers, "num_attention_heads": num_q_heads, "num_key_value_heads": num_kv_heads,
        "head_dim": head_dim, "vocab_size": vocab_size, "rms_norm_eps": 1e-6, "rope_theta": 10_000.0,
        "max_position_embeddings": 1 << 20, "layer_types": layer_types or ["sliding_attention"] * num_layers,
        "sliding_window": window, "is_causal": is_causal,
        "dflash_config": {"block_size": draft_block, "target_layer_ids": list(target_layer_ids),
                          "mask_token_id": vocab_size - 1, "conv_kernel_size": 2, "conv_group_size": 16},
    }, source="tiny_config")  # fmt: skip


def random_drafter(config: DFlashConfig, seed: int = 0, target_hidden_size: int | None = None) -> DFlash2Drafter:
    """Seeded random weights; convolution kernels near the identity so the block path stays well scaled."""
    torch.manual_seed(seed)
    drafter = DFlash2Drafter(config, target_hidden_size)
    with torch.no_grad():
        for layer in drafter.layers:
            for conv in (layer.attention_conv, layer.mlp_conv):
                if conv is not None:
                    conv.base_kernel.normal_(0.0, 0.1)
                    conv.base_kernel[:, 0] += 1.0
                    conv.kernel_projection.weight.mul_(0.1)
    return drafter.eval()


def tiny_target(vocab_size: int = 128, hidden_size: int = 64, num_layers: int = 3, seed: int = 0):
    """A random-weight transformers Qwen3 causal LM (fp32, CPU)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    config = Qwen3Config(
        vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        max_position_embeddings=4096, tie_word_embeddings=False,
    )  # fmt: skip
    return Qwen3ForCausalLM(config).eval()
