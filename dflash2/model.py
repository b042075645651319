# SPDX-License-Identifier: Apache-2.0
"""A compact DFlash2 drafter in PyTorch; its K/V live in any ``DraftKVStore`` (the ring of the reference
harness, ``ringkv.dflash2.harness.ring_cache``, or a training batch).

Context K/V come from the target's features: the chosen target layers' hidden states are concatenated,
projected by ``fc``, normed by ``hidden_norm`` and fed to every layer's own ``k_proj``/``v_proj`` (then
``k_norm`` and NeoX RoPE at the absolute positions). A draft block is ``[anchor, mask x (B-1)]`` embedded by
the target's embedding; each layer is pre-norm attention + SwiGLU MLP, wrapped (DFlash2) in the two-tap
block-local grouped convolution; drafts are the target head's argmax at block positions ``1..B-1``.
Names follow the HF checkpoints (``layers.{i}.self_attn.q_proj.weight``, ...).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from .config import DFlashConfig, load_config


@dataclass(frozen=True)
class DraftBlocks:
    """N draft blocks of ``block`` tokens: block ``r`` belongs to request ``requests[r]`` and sits at positions
    ``context_lens[r] .. context_lens[r] + block - 1``; the same for every layer of one forward."""

    context_lens: Sequence[int]
    block: int
    requests: Sequence[int]


class DraftKVStore(Protocol):
    """Where the drafter's per-layer context K/V live and how a draft block attends over them."""

    def write(self, layer: int, request: int, positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store context rows ``k``/``v`` ``[T, Hkv, D]`` of ``request`` at absolute ``positions [T]``."""

    def attend(
        self, layer: int, q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor, blocks: DraftBlocks
    ) -> torch.Tensor:
        """``[N*B, Hq, D]``: each block's queries ``q [N*B, Hq, D]`` over its request's context and the blocks'
        own K/V ``k_new``/``v_new`` ``[N*B, Hkv, D]``."""


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight.float()).to(x.dtype)


def apply_rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """NeoX-style rotary embedding: ``x [T, H, D]`` rotated at absolute ``positions [T]``."""
    half = x.shape[-1] // 2
    inv_freq = 1.0 / (theta ** (torch.arange(0, half, device=x.device, dtype=torch.float64) / half))
    angles = positions.to(torch.float64)[:, None] * inv_freq[None, :]
    cos, sin = angles.cos().float()[:, None, :], angles.sin().float()[:, None, :]
    x1, x2 = x[..., :half].float(), x[..., half:].float()
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


class GroupedBlockConv(nn.Module):
    """DFlash2's dynamic grouped causal convolution over a draft block (taps never cross a block edge).

    ``kernel_projection`` gives per-token, per-group deltas for both sides (before / after the wrapped op);
    coefficient = ``base_kernel[side, tap] + delta``; output_t = sum_tap coef_tap * x_{t - tap}.
    """

    def __init__(self, hidden_size: int, taps: int, group_size: int, draft_block: int) -> None:
        super().__init__()
        if hidden_size % group_size:
            raise ValueError(f"conv_group_size={group_size} must divide hidden_size={hidden_size}")
        self.taps, self.group_size, self.draft_block = taps, group_size, draft_block
        self.num_groups = hidden_size // group_size
        self.base_kernel = nn.Parameter(torch.zeros(2, taps, hidden_size))
        self.kernel_projection = nn.Linear(hidden_size, 2 * taps * self.num_groups, bias=False)

    def _convolve(self, x: torch.Tensor, delta: torch.Tensor, side: int) -> torch.Tensor:
        # x: [T, hidden]; delta: [T, taps, groups]
        groups = x.unflatten(-1, (self.num_groups, self.group_size))
        coefficients = self.base_kernel[side].view(1, self.taps, self.num_groups, self.group_size) + delta[..., None]
        out = coefficients[:, 0] * groups
        offset = torch.arange(x.shape[0], device=x.device) % self.draft_block
        for tap in range(1, self.taps):
            shifted = F.pad(groups[:-tap], (0, 0, 0, 0, tap, 0))
            out = out + coefficients[:, tap] * shifted * (offset >= tap).view(-1, 1, 1)
        return out.flatten(-2)

    def prepare(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        coefficients = self.kernel_projection(x).view(x.shape[0], 2, self.taps, self.num_groups)
        return self._convolve(x, coefficients[:, 0], 0), coefficients[:, 1]

    def finish(self, x: torch.Tensor, coefficients: torch.Tensor) -> torch.Tensor:
        return self._convolve(x, coefficients, 1)


class SelfAttention(nn.Module):
    def __init__(self, config: DFlashConfig) -> None:
        super().__init__()
        hidden, heads, kv_heads, dim = config.hidden_size, config.num_q_heads, config.num_kv_heads, config.head_dim
        self.q_proj = nn.Linear(hidden, heads * dim, bias=config.attention_bias)
        self.k_proj = nn.Linear(hidden, kv_heads * dim, bias=config.attention_bias)
        self.v_proj = nn.Linear(hidden, kv_heads * dim, bias=config.attention_bias)
        self.o_proj = nn.Linear(heads * dim, hidden, bias=config.attention_bias)
        self.q_norm = RMSNorm(dim, config.rms_norm_eps)
        self.k_norm = RMSNorm(dim, config.rms_norm_eps)
        self.heads, self.kv_heads, self.dim, self.theta = heads, kv_heads, dim, config.rope_theta

    def keys_values(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K (normed, RoPE'd) and V ``[T, Hkv, D]`` of hidden states ``x [T, hidden]``."""
        k = self.k_norm(self.k_proj(x).view(-1, self.kv_heads, self.dim))
        return apply_rope(k, positions, self.theta), self.v_proj(x).view(-1, self.kv_heads, self.dim)

    def queries(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        q = self.q_norm(self.q_proj(x).view(-1, self.heads, self.dim))
        return apply_rope(q, positions, self.theta)


class SwiGLU(nn.Module):
    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DraftLayer(nn.Module):
    def __init__(self, config: DFlashConfig) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.input_layernorm = RMSNorm(hidden, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(hidden, config.rms_norm_eps)
        self.self_attn = SelfAttention(config)
        self.mlp = SwiGLU(hidden, config.intermediate_size)
        self.attention_conv = self.mlp_conv = None
        if config.is_dflash2:
            conv = (hidden, config.conv_kernel_size, config.conv_group_size, config.draft_block)
            self.attention_conv, self.mlp_conv = GroupedBlockConv(*conv), GroupedBlockConv(*conv)


class DFlash2Drafter(nn.Module):
    """The drafter. ``forward_block`` attends through a ``DraftKVCache`` that holds the context K/V."""

    def __init__(self, config: DFlashConfig, target_hidden_size: int | None = None) -> None:
        super().__init__()
        self.config = config
        features = len(config.target_layer_ids) * (target_hidden_size or config.hidden_size)
        self.fc = nn.Linear(features, config.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.layers = nn.ModuleList(DraftLayer(config) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    @classmethod
    def from_pretrained(cls, folder: str | Path, target_hidden_size: int | None = None) -> DFlash2Drafter:
        """Load ``config.json`` + ``model.safetensors`` (HF layout)."""
        from safetensors.torch import load_file

        folder = Path(folder)
        model = cls(load_config(folder), target_hidden_size)
        state = load_file(str(folder / "model.safetensors"))
        missing, unexpected = model.load_state_dict(state, strict=False)
        if missing or unexpected:
            raise ValueError(f"{folder}: checkpoint mismatch, missing {missing[:5]}, unexpected {unexpected[:5]}")
        return model

    def save_pretrained(self, folder: str | Path) -> None:
        import json

        from safetensors.torch import save_file

        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "config.json").write_text(json.dumps(self.config.to_dict(), indent=1))
        save_file({k: v.contiguous() for k, v in self.state_dict().items()}, str(folder / "model.safetensors"))

    def context_kv(self, target_features: torch.Tensor, positions: torch.Tensor) -> list[tuple[torch.Tensor, ...]]:
        """Per layer (K, V) ``[T, Hkv, D]`` of context rows from concatenated target features ``[T, F]``."""
        hidden = self.hidden_norm(self.fc(target_features))
        return [layer.self_attn.keys_values(hidden, positions) for layer in self.layers]

    def write_context(
        self, cache: DraftKVStore, request: int, target_features: torch.Tensor, positions: torch.Tensor
    ) -> None:
        """Store the context K/V at ``positions`` (dead ones are dropped by the cache)."""
        for index, (k, v) in enumerate(self.context_kv(target_features, positions)):
            cache.write(index, request, positions, k, v)

    def forward_block(
        self,
        cache: DraftKVStore,
        embeddings: torch.Tensor,
        context_lens: Sequence[int],
        block: int,
        requests: Sequence[int] | None = None,
    ) -> torch.Tensor:
        """Hidden states ``[N*B, hidden]`` of N draft blocks (``embeddings [N*B, hidden]``); block ``r`` belongs
        to request ``requests[r]`` (default ``r``) and sits at positions ``context_lens[r]`` to
        ``context_lens[r] + B - 1``."""
        requests = list(range(len(context_lens))) if requests is None else list(requests)
        if len(requests) != len(context_lens):
            raise ValueError(f"{len(requests)} request ids for {len(context_lens)} blocks; give one id per block")
        blocks = DraftBlocks(context_lens, block, requests)
        positions = torch.cat([torch.arange(p, p + block) for p in context_lens]).to(embeddings.device)
        hidden, residual = embeddings, None
        for index, layer in enumerate(self.layers):
            residual = hidden if residual is None else hidden + residual
            hidden = layer.input_layernorm(residual)
            if layer.attention_conv is not None:
                hidden, coefficients = layer.attention_conv.prepare(hidden)
            attn = layer.self_attn
            q = attn.queries(hidden, positions)
            k, v = attn.keys_values(hidden, positions)
            hidden = attn.o_proj(cache.attend(index, q, k, v, blocks).flatten(1))
            if layer.attention_conv is not None:
                hidden = layer.attention_conv.finish(hidden, coefficients)
            residual = hidden + residual
            hidden = layer.post_attention_layernorm(residual)
            if layer.mlp_conv is not None:
                hidden, coefficients = layer.mlp_conv.prepare(hidden)
            hidden = layer.mlp(hidden)
            if layer.mlp_conv is not None:
                hidden = layer.mlp_conv.finish(hidden, coefficients)
        return self.norm(hidden + residual)

    def draft(
        self,
        cache: DraftKVStore,
        anchors: torch.Tensor,
        context_lens: Sequence[int],
        embed: nn.Module,
        lm_head: nn.Module,
        requests: Sequence[int] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Greedy drafts ``[N, B-1]`` and their logits ``[N, B-1, vocab]`` for anchors ``[N]`` (the bonus
        tokens at positions ``context_lens`` of ``requests``, default ``0..N-1``), through the target's embedding
        and head."""
        block = self.config.draft_block
        tokens = torch.full((len(context_lens), block), self.config.mask_token_id, device=anchors.device)
        tokens[:, 0] = anchors
        hidden = self.forward_block(cache, embed(tokens.flatten()), context_lens, block, requests)
        logits = lm_head(hidden.view(len(context_lens), block, -1)[:, 1:])
        return logits.argmax(-1), logits
