# SPDX-License-Identifier: Apache-2.0
"""The recall drafter (``recall_drafter``): it drafts the segment exactly wherever its source lies, and nothing
once the source is out of its sight; its evaluation store (``recall_models._CutBatch``): draft blocks cut at several
points of one shared context see exactly what a block alone over that context's prefix sees (positions jumping by a
gap)."""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F
from ringkv.dflash2.config import parse_config
from ringkv.dflash2.harness.recall_drafter import build_recall_drafter
from ringkv.dflash2.harness.recall_models import RecallModelSpec, _CutBatch, drafter_accuracy
from ringkv.dflash2.harness.recall_target import RecallLayout, RecallTargetSpec, build_recall_target, recall_batch
from ringkv.dflash2.model import DFlash2Drafter

CONFIG = {
    "architectures": ["DFlashDraftModel"], "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "vocab_size": 50, "is_causal": False,
    "layer_types": ["full_attention"] * 2,
    "dflash_config": {"block_size": 4, "target_layer_ids": [0], "mask_token_id": 49},
}  # fmt: skip


class _Prefix:
    """One request's context, every key seen (the reference: a block alone over a prefix)."""

    def write(self, layer, request, positions, k, v) -> None:
        self.kv = getattr(self, "kv", {})
        self.kv[layer] = (k, v)

    def attend(self, layer, q, k_new, v_new, blocks) -> torch.Tensor:
        k, v = self.kv[layer]
        keys, values = torch.cat([k, k_new]).transpose(0, 1), torch.cat([v, v_new]).transpose(0, 1)
        out = F.scaled_dot_product_attention(q.transpose(0, 1), keys, values, enable_gqa=True)
        return out.transpose(0, 1)


def test_blocks_cut_in_one_shared_context_equal_each_block_over_its_prefix():
    torch.manual_seed(0)
    drafter = DFlash2Drafter(parse_config(CONFIG)).eval()
    sequences, length, block, gap, source_end = 2, 24, 4, 1000, 6
    features = torch.randn(sequences, length, 64)
    embeddings = torch.randn(sequences, length, 64)
    positions = torch.arange(length)
    positions[source_end:] += gap
    cuts = [9, 15, 20]  # anchor indices: the context before each
    store = _CutBatch(sequences, positions)
    with torch.no_grad():
        drafter.write_context(store, 0, features.reshape(-1, 64), positions.repeat(sequences))
        block_inputs = embeddings[:, cuts][:, :, None].expand(-1, -1, block, -1).reshape(-1, 64)
        starts = [int(positions[c]) for c in cuts] * sequences
        shared = drafter.forward_block(store, block_inputs, starts, block).view(sequences, len(cuts), block, 64)
        for s in range(sequences):
            for i, cut in enumerate(cuts):
                alone = _Prefix()
                drafter.write_context(alone, 0, features[s, :cut], positions[:cut])
                inputs = embeddings[s, cut][None].expand(block, -1)
                want = drafter.forward_block(alone, inputs, [int(positions[cut])], block)
                torch.testing.assert_close(shared[s, i], want, rtol=0, atol=1e-5)


@pytest.fixture(scope="module")
def recall():
    spec = RecallModelSpec(groups=2, batch=2, cuts=6)
    return spec, build_recall_target(spec.target), build_recall_drafter(spec.target, spec.draft_block)


def test_the_drafter_drafts_the_segment_at_every_position_wherever_its_source_lies(recall):
    """Fresh sequences, the source up to ``MAX_RECALL_DISTANCE`` back: every draft position exact."""
    spec, target, drafter = recall
    assert drafter_accuracy(spec, target, drafter) == [1.0] * spec.num_speculative_tokens


@pytest.mark.parametrize("source_seen", [True, False])
def test_the_drafts_need_the_source_half_the_context_back(recall, source_seen):
    """The same context with the source's rows left out (what a window short of it leaves): no draft is right."""
    spec, target, drafter = recall
    layout = RecallLayout(before=700, segment=48, between=1201, repeated=20)
    tokens, segments = recall_batch(spec.target, layout, 2, torch.Generator().manual_seed(3))
    with torch.no_grad():
        features = target(tokens, output_hidden_states=True).hidden_states[2]
    anchor = layout.length - 1  # the last repeated token, segment[19]: drafts segment[20:23]
    kept = torch.arange(anchor)
    if not source_seen:
        kept = kept[(kept < layout.before) | (kept >= layout.before + layout.segment)]
    store = _CutBatch(2, kept)
    block = spec.draft_block
    query = torch.full((2, block), drafter.config.mask_token_id)
    query[:, 0] = tokens[:, anchor]
    embed, head = target.get_input_embeddings(), target.get_output_embeddings()
    with torch.no_grad():
        drafter.write_context(store, 0, features[:, kept].reshape(-1, features.shape[-1]), kept.repeat(2))
        hidden = drafter.forward_block(store, embed(query.flatten()), [anchor] * 2, block)
        drafts = head(hidden.view(2, block, -1)[:, 1:]).argmax(-1)
    right = drafts == segments[:, 20 : 20 + block - 1]
    assert bool(right.all()) if source_seen else not bool(right.any())


def test_a_draft_block_longer_than_the_offsets_the_target_keeps_is_refused():
    message = "draft_block=5: the drafter reads P1..P3, so give 2 <= draft_block <= 4"
    with pytest.raises(ValueError, match=re.escape(message)):
        build_recall_drafter(RecallTargetSpec(), 5)
