# SPDX-License-Identifier: Apache-2.0
"""The recall target (``recall_target``) and its recall drafter (``recall_drafter``), both constructed, checked and
saved for vLLM's engine.

The drafter's accuracy per draft position is measured here in PyTorch on fresh ``recall_batch`` sequences whose
source lies up to ``MAX_RECALL_DISTANCE`` positions back (the context's positions jump by a random gap after the
source: RoPE sees distances only). A drafter trained from random weights did not learn the recall on CPU: over a
fixed bank of 208 sequences it reached training accuracy 1.00 by memorizing their segments and drafted nothing vLLM
accepted on new prompts; on fresh sequences (800 steps at lr 1e-3, 160 at 1e-2, 2,000 on an easy layout) it
stayed near chance (0.00 to 0.09), and so did three probes given the anchor's code in every block slot (a one-hop
lookup; 160 to 220 steps, lr 1e-3 to 1e-2, loss 5.96 to 5.98); so the drafter's weights are constructed as the
target's are, and its accuracy is measured.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from ringkv.dflash2.model import DFlash2Drafter

from .engine_models import EngineModels, reuse_or_build
from .recall_drafter import TARGET_LAYER_IDS, build_recall_drafter
from .recall_target import RecallLayout, RecallTargetSpec, build_recall_target, recall_batch

MAX_RECALL_DISTANCE = 4800
SEGMENT = 48
MAX_BETWEEN = 512
ACCURACY_RECORD = "accuracy_record.json"


@dataclass(frozen=True)
class RecallModelSpec:
    target: RecallTargetSpec = field(default_factory=RecallTargetSpec)
    draft_block: int = 4  # num_speculative_tokens + 1
    # the accuracy check: groups of ``batch`` fresh sequences, each cut after ``cuts`` counts of repeated tokens
    groups: int = 4
    batch: int = 4
    cuts: int = 15
    seed: int = 0

    @property
    def num_speculative_tokens(self) -> int:
        return self.draft_block - 1


class _CutBatch:
    """An evaluation ``DraftKVStore``: N sequences, each with its whole context K/V written once (``L`` rows at
    ``positions``) and ``K`` draft blocks cut at different points of it (blocks of one sequence contiguous). Full
    attention: a block's queries see the context keys before the block's first position and the keys of their own
    block (non-causal)."""

    def __init__(self, num_sequences: int, positions: torch.Tensor) -> None:
        self.n, self.positions = num_sequences, positions
        self.kv: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def write(self, layer: int, request: int, positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        # k, v: [N * L, Hkv, D] -> [N, L, Hkv, D]
        self.kv[layer] = (k.view(self.n, -1, *k.shape[1:]), v.view(self.n, -1, *v.shape[1:]))

    def attend(self, layer, q, k_new, v_new, blocks) -> torch.Tensor:
        k_ctx, v_ctx = self.kv[layer]
        n, block = self.n, blocks.block
        rows = q.shape[0] // n  # K * B queries per sequence
        starts = torch.tensor(blocks.context_lens).view(n, -1)[0]  # [K]: the same cuts in every sequence
        # [K*B, L]: context keys before the query's block; [K*B, K*B]: the query's own block
        seen_context = self.positions[None, :] < starts.repeat_interleave(block)[:, None]
        own = torch.arange(rows) // block
        mask = torch.cat([seen_context, own[:, None] == own[None, :]], 1)
        # SDPA layout [N, H, L, D]
        keys = torch.cat([k_ctx, k_new.view(n, rows, *k_new.shape[1:])], 1).transpose(1, 2)
        values = torch.cat([v_ctx, v_new.view(n, rows, *v_new.shape[1:])], 1).transpose(1, 2)
        queries = q.view(n, rows, *q.shape[1:]).transpose(1, 2)
        out = F.scaled_dot_product_attention(queries, keys, values, attn_mask=mask, enable_gqa=True)
        return out.transpose(1, 2).reshape(q.shape)


@dataclass(frozen=True)
class _Group:
    """Sequences of one layout whose segment is repeated whole, and the target's features for them: an example
    cuts one at any point of its repeat (the features of a prefix are the prefix of the features)."""

    layout: RecallLayout
    tokens: torch.Tensor  # [n, length]
    segments: torch.Tensor  # [n, segment]
    features: torch.Tensor  # [n, length, features]


def _fresh_group(spec: RecallModelSpec, target, generator: torch.Generator) -> _Group:
    """Fresh sequences of one random layout: filler before (0..32) and between (0..512) the segment and its whole
    repeat, so some examples see hundreds of distracting keys; their features from one run of the target."""

    def draw(low: int, high: int) -> int:
        return int(torch.randint(low, high + 1, (1,), generator=generator))

    layout = RecallLayout(before=draw(0, 32), segment=SEGMENT, between=draw(0, MAX_BETWEEN), repeated=SEGMENT)
    tokens, segments = recall_batch(spec.target, layout, spec.batch, generator)
    with torch.no_grad():
        states = target(tokens, output_hidden_states=True).hidden_states
    features = torch.cat([states[i + 1] for i in TARGET_LAYER_IDS], -1)
    return _Group(layout, tokens, segments, features)


def drafter_accuracy(spec: RecallModelSpec, target, drafter: DFlash2Drafter) -> list[float]:
    """The drafter's token accuracy per draft position on ``spec.groups`` fresh groups (``_fresh_group``), every
    sequence cut after ``cuts`` random counts ``r >= draft_block - 1`` of its repeated tokens (one draft block per
    cut, anchored on the ``r``-th), the context's positions jumping by a random gap after the source so that the
    recall distance spans ``SEGMENT .. MAX_RECALL_DISTANCE``."""
    generator = torch.Generator().manual_seed(spec.seed)
    embed, head = target.get_input_embeddings(), target.get_output_embeddings()
    block, mask_token = spec.draft_block, drafter.config.mask_token_id
    correct, total = torch.zeros(block - 1), 0
    for _ in range(spec.groups):
        group = _fresh_group(spec, target, generator)
        # r in block - 1 .. SEGMENT - block + 1: anchor segment[r - 1], labels segment[r : r + block - 1]
        counts = SEGMENT - 2 * block + 3
        cuts = torch.randperm(counts, generator=generator)[: spec.cuts].sort().values + block - 1
        labels_at = cuts[:, None] + torch.arange(block - 1)
        layout, n = group.layout, group.tokens.shape[0]
        source_end = layout.before + layout.segment
        gap = int(torch.randint(0, MAX_RECALL_DISTANCE - layout.recall_distance + 1, (1,), generator=generator))
        length = group.tokens.shape[1] - 1
        positions = torch.arange(length)
        positions[source_end:] += gap
        store = _CutBatch(n, positions)
        anchors = source_end + layout.between + cuts - 1  # [K] token indices of the anchors
        query = torch.full((n, len(cuts), block), mask_token)
        query[:, :, 0] = group.tokens[:, anchors]
        with torch.no_grad():
            drafter.write_context(store, 0, group.features[:, :length].reshape(n * length, -1), positions.repeat(n))
            hidden = drafter.forward_block(store, embed(query.flatten()), (anchors + gap).tolist() * n, block)
            drafts = head(hidden.view(n, len(cuts), block, -1)[:, :, 1:]).argmax(-1)
        correct += (drafts == group.segments[:, labels_at]).float().sum((0, 1))
        total += n * len(cuts)
    return (correct / total).tolist()


def build_recall_models(folder: str | Path, spec: RecallModelSpec | None = None) -> EngineModels:
    """Build (or reuse, when ``folder`` holds the same spec) the recall target and its drafter; the returned
    ``train_accuracy`` is the drafter's mean accuracy over its draft positions on fresh sequences
    (``drafter_accuracy``; per position, and the build's seconds: ``folder/ACCURACY_RECORD``)."""
    spec = spec or RecallModelSpec()
    folder = Path(folder)

    def build() -> float:
        start = time.perf_counter()
        target = build_recall_target(spec.target, folder / "target")
        drafter = build_recall_drafter(spec.target, spec.draft_block)
        per_position = drafter_accuracy(spec, target, drafter)
        # no embeddings or head in the checkpoint: vLLM's DFlash drafter shares the target's
        drafter.save_pretrained(folder / "drafter")
        sequences = spec.groups * spec.batch
        record = {"accuracy_per_position": per_position, "sequences": sequences, "seconds": time.perf_counter() - start}
        (folder / ACCURACY_RECORD).write_text(json.dumps(record))
        return sum(per_position) / len(per_position)

    return reuse_or_build(folder, "recall_models.json", spec, spec, build)
