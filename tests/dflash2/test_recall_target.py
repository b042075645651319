# SPDX-License-Identifier: Apache-2.0
"""The hand-built recall target (``recall_target.py``) in transformers: it copies a segment from half the context
back, token after token, and a prompt's layout puts the segment's source where ``RecallLayout`` says."""

from __future__ import annotations

import pytest
import torch
from ringkv.dflash2.harness.recall_target import RecallTargetSpec, build_recall_target, recall_batch, recall_layout

SPEC = RecallTargetSpec()


@pytest.fixture(scope="module")
def target():
    return build_recall_target(SPEC)


@pytest.mark.parametrize("context", [256, 1500], ids=["4 windows", "past 1024 back"])
def test_the_target_copies_the_segment_from_half_the_context_back(target, context):
    layout = recall_layout(context)
    tokens, segments = recall_batch(SPEC, layout, 1, torch.Generator().manual_seed(context))
    follow = segments[:, layout.repeated : layout.repeated + 16]
    with torch.no_grad():
        logits = target(torch.cat([tokens, follow], 1)).logits[0, context - 1 : context - 1 + 16]
    assert logits.argmax(-1).tolist() == follow[0].tolist()
    top = logits.topk(2).values
    assert float((top[:, 0] - top[:, 1]).min()) > 5, "the copied token must win by a clear margin"


def test_a_layout_puts_the_source_at_mid_context_and_repeats_its_start_at_the_end():
    layout = recall_layout(1024)
    assert layout.length == 1024 and layout.before == 512 and layout.recall_distance == 1024 // 2 - 4
    tokens, segments = recall_batch(SPEC, layout, 3, torch.Generator().manual_seed(0))
    source = slice(layout.before, layout.before + layout.segment)
    assert torch.equal(tokens[:, source], segments)
    assert torch.equal(tokens[:, -layout.repeated :], segments[:, : layout.repeated])
    # the segment's tokens are distinct, and no filler token is a segment token
    assert all(len(set(row.tolist())) == layout.segment for row in segments)
    first, end = SPEC.filler_tokens
    filler = torch.cat([tokens[:, : layout.before], tokens[:, source.stop : -layout.repeated]], 1)
    assert bool(((filler >= first) & (filler < end)).all()) and bool((segments < first).all())
    with pytest.raises(ValueError, match="too short"):
        recall_layout(64)
