# SPDX-License-Identifier: Apache-2.0
"""A DFlash drafter that recalls with the recall target (``recall_target``), its weights constructed as the
target's are: every layer full attention, non-causal block, so each draft needs a key about the recall distance
back (half the context in ``recall_layout``'s prompts) and a window that does not reach it costs the draft.

It reads the target's residual after the induction layer (``E``, ``P1..Pn``, ``C``, the constant). Its own residual
uses the target's subspaces (``Residual``): block rows carry their token's code in ``E``; ``fc`` lays a context row's
``E`` into ``C`` (so block rows, whose ``C`` is empty, contribute no value to the lookup) and its ``Pj`` into
``Pj``. For a block ``[anchor, mask x (B - 1)]`` at position ``p`` whose anchor is ``segment[r - 1]``:

- Layer 0, head ``j - 1`` (offset ``j``): the target's distance head, over block and context keys alike (the
  constant alone, so the score is a function of ``q - k``): block row ``k`` reads the code of the token ``j``
  before it, the anchor for ``j = k``, a mask for ``j < k``, the context token at ``p + k - j`` for ``j > k``, and
  writes it into ``Pj`` (``Oj``).
- Layer 1, head ``j - 1``: a position-free match of ``Oj`` against the keys' ``Pj`` (the target's induction
  pairs), copying the matched context row's token into ``C``. For ``j = k`` the match is the source row whose
  ``Pk`` is the anchor: its token is ``segment[r - 1 + k]``, the draft. For ``j > k`` the query is
  ``segment[r - 1 + k - j]`` and its source row, ``j`` further, holds the same draft. For ``j < k`` (a mask)
  nothing in the context matches; block rows holding that mask in ``Pj`` score as high and add no value (their
  ``C`` is empty), as does the query's own row for ``j > k``.
- The MLPs are zero; the target's head reads ``C``.

A draft is exact while the window holds the source (and ``r >= B - 1``: the ``j > k`` queries read repeated
tokens, as every prompt of ``recall_layout`` gives); past it the lookup finds nothing and the draft is the
context's noise.
"""

from __future__ import annotations

import math

import torch
from ringkv.dflash2.config import FULL, DFlashConfig, parse_config
from ringkv.dflash2.model import DFlash2Drafter

from .recall_target import RecallTargetSpec, Residual, set_content_match, set_distance_head

# the residual after the induction layer (layer 1): E, P1..Pn and C (``recall_target``)
TARGET_LAYER_IDS = (1,)
DRAFTER_LAYERS = 2
# the target's head count: one page size for every KV group (vLLM's hybrid allocator)
DRAFTER_HEADS = 4


def recall_drafter_config(target: RecallTargetSpec, draft_block: int) -> DFlashConfig:
    """The drafter's config: ``draft_block`` = speculative tokens + 1, at most the target's ``offsets`` + 1."""
    if not 2 <= draft_block <= target.offsets + 1:
        raise ValueError(
            f"draft_block={draft_block}: the drafter reads P1..P{target.offsets}, so give 2 <= draft_block <= "
            f"{target.offsets + 1} (or a target with more offsets)"
        )
    raw = {
        "architectures": ["DFlashDraftModel"], "hidden_size": target.hidden_size,
        "intermediate_size": 2 * target.hidden_size, "num_hidden_layers": DRAFTER_LAYERS,
        "num_attention_heads": DRAFTER_HEADS, "num_key_value_heads": DRAFTER_HEADS, "head_dim": target.head_dim,
        "vocab_size": target.vocab_size, "rms_norm_eps": 1e-6, "rope_theta": target.rope_theta,
        "max_position_embeddings": target.max_positions, "is_causal": False, "layer_types": [FULL] * DRAFTER_LAYERS,
        "dflash_config": {"block_size": draft_block, "target_layer_ids": list(TARGET_LAYER_IDS),
                          "mask_token_id": target.vocab_size - 1},
    }  # fmt: skip
    return parse_config(raw, source="recall_drafter_config")


def build_recall_drafter(target: RecallTargetSpec, draft_block: int) -> DFlash2Drafter:
    """The constructed drafter (module docstring)."""
    config = recall_drafter_config(target, draft_block)
    drafter = DFlash2Drafter(config, target_hidden_size=target.hidden_size).float().eval()
    residual = Residual(target.code_dim, target.offsets)
    hidden, head_dim = target.hidden_size, target.head_dim
    identity = torch.eye(target.code_dim)
    # RMS scale of a row's unit subspaces: block rows hold E and the constant; context rows C, P1..Pn, the constant
    block_scale, context_scale = math.sqrt(hidden / 2), math.sqrt(hidden / (target.offsets + 2))
    with torch.no_grad():
        for parameter in drafter.parameters():
            parameter.zero_()
        for norm in [drafter.hidden_norm, drafter.norm] + [
            n for layer in drafter.layers for n in (layer.input_layernorm, layer.post_attention_layernorm)
        ]:
            norm.weight.fill_(1.0)  # fmt: skip
        drafter.fc.weight[residual.copied, residual.code(0)] = identity
        for offset in range(1, target.offsets + 1):
            drafter.fc.weight[residual.code(offset), residual.code(offset)] = identity
        drafter.fc.weight[residual.constant, residual.constant] = 1.0

        distance, lookup = drafter.layers[0].self_attn, drafter.layers[1].self_attn
        values = torch.arange(target.code_dim)
        for offset in range(1, draft_block):
            head_values = (offset - 1) * head_dim + values
            set_distance_head(distance, target, offset - 1, offset, residual.constant)
            distance.v_proj.weight[head_values, residual.code(0)] = identity / block_scale
            distance.v_proj.weight[head_values, residual.copied] = identity / context_scale
            distance.o_proj.weight[residual.code(offset), head_values] = identity

            set_content_match(lookup, target, offset - 1, residual.code(offset), residual.code(offset))
            lookup.v_proj.weight[head_values, residual.copied] = identity / context_scale
            lookup.o_proj.weight[residual.copied, head_values] = identity
    return drafter
