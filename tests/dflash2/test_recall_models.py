# SPDX-License-Identifier: Apache-2.0
"""The recall drafter's training store (``recall_models._CutBatch``): draft blocks cut at several points of one
shared context see exactly what a block alone over that context's prefix sees (positions jumping by a gap)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from ringkv.dflash2.config import parse_config
from ringkv.dflash2.harness.recall_models import _CutBatch
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


def test_every_training_step_draws_sequences_it_has_not_seen(monkeypatch):
    """A fixed bank of sequences let the drafter memorize their segments (training accuracy 1.00, nothing accepted
    on new prompts): each step must draw its own, so the accuracy training reports is on unseen sequences."""
    from ringkv.dflash2.harness import recall_models
    from ringkv.dflash2.harness.recall_target import RecallTargetSpec, build_recall_target

    target_spec = RecallTargetSpec(vocab_size=64, recall_tokens=50, max_positions=4096)
    spec = recall_models.RecallModelSpec(target=target_spec, train_steps=3, batch=2, cuts=2)
    drawn = []
    fresh_group = recall_models._fresh_group

    def spy(*args):
        group = fresh_group(*args)
        drawn.append(group.segments)
        return group

    monkeypatch.setattr(recall_models, "_fresh_group", spy)
    recall_models.train_recall_drafter(spec, build_recall_target(target_spec))
    assert len(drawn) == 3
    assert all(not torch.equal(a, b) for i, a in enumerate(drawn) for b in drawn[i + 1 :])
