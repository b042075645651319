# SPDX-License-Identifier: Apache-2.0
"""The recall target (``recall_target``) and a DFlash drafter trained to recall with it, for vLLM's engine.

The drafter (vLLM's ``DFlashDraftModel`` format, every layer full attention, non-causal block) reads the target's
residual after its induction layer, which holds each position's token and the tokens 1..n before it. To draft
position ``k`` after an anchor it must find the context position whose token ``k`` back is the anchor (the source
of the segment being copied, about half the context back) and copy its token: possible only while its attention
reaches that far. It is trained on ``recall_batch`` sequences whose source lies up to ``MAX_RECALL_DISTANCE``
positions back: the context's positions jump by a random gap after the source (RoPE sees distances only, and the
features the drafter reads are local but for ``C``), so distances of thousands cost the training no more than
hundreds. Every step draws fresh sequences (the target runs once per step over them, each cut at many points), so
the accuracy training reports is on sequences the drafter had not seen: trained over a fixed bank of 208 sequences
instead (1,000 steps, lr 1e-3), it reached 1.00 on the bank and drafted nothing vLLM accepted on new prompts, having
memorized the bank's segments.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from ringkv.dflash2.config import FULL, DFlashConfig, parse_config
from ringkv.dflash2.model import DFlash2Drafter

from .engine_models import EngineModels, reuse_or_build
from .recall_target import RecallLayout, RecallTargetSpec, build_recall_target, recall_batch

# the residual after the induction layer (layer 1): E, P1..Pn and C (``recall_target``)
TARGET_LAYER_IDS = (1,)
MAX_RECALL_DISTANCE = 4800
SEGMENT = 48
MAX_BETWEEN = 512
TRAIN_RECORD = "train_record.json"


@dataclass(frozen=True)
class RecallModelSpec:
    target: RecallTargetSpec = field(default_factory=RecallTargetSpec)
    drafter_layers: int = 2
    drafter_q_heads: int = 4
    # as many KV heads as the target: one page size for every KV group (vLLM's hybrid allocator)
    drafter_kv_heads: int = 4
    draft_block: int = 4  # num_speculative_tokens + 1
    train_steps: int = 800
    batch: int = 16
    # draft blocks per sequence and step, each after another count of repeated tokens
    cuts: int = 15
    learning_rate: float = 1e-3
    seed: int = 0

    @property
    def num_speculative_tokens(self) -> int:
        return self.draft_block - 1


def recall_drafter_config(spec: RecallModelSpec) -> DFlashConfig:
    target = spec.target
    raw = {
        "architectures": ["DFlashDraftModel"], "hidden_size": target.hidden_size,
        "intermediate_size": 2 * target.hidden_size, "num_hidden_layers": spec.drafter_layers,
        "num_attention_heads": spec.drafter_q_heads, "num_key_value_heads": spec.drafter_kv_heads,
        "head_dim": target.head_dim, "vocab_size": target.vocab_size, "rms_norm_eps": 1e-6,
        "rope_theta": target.rope_theta, "max_position_embeddings": target.max_positions, "is_causal": False,
        "layer_types": [FULL] * spec.drafter_layers,
        "dflash_config": {"block_size": spec.draft_block, "target_layer_ids": list(TARGET_LAYER_IDS),
                          "mask_token_id": target.vocab_size - 1},
    }  # fmt: skip
    return parse_config(raw, source="RecallModelSpec")


class _CutBatch:
    """A training ``DraftKVStore``: N sequences, each with its whole context K/V written once (``L`` rows at
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
    """Sequences of one layout whose segment is repeated whole, and the target's features for them: a training
    example cuts one at any point of its repeat (the features of a prefix are the prefix of the features)."""

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


def train_recall_drafter(
    spec: RecallModelSpec, target, progress: Callable[[int, float, list[float]], None] | None = None
) -> tuple[DFlash2Drafter, list[float]]:
    """Train a fresh drafter on recall sequences (``_fresh_group``): each step a new group, every sequence cut after
    ``cuts`` random counts ``r`` of its repeated tokens (one draft block per cut, anchored on the ``r``-th), the
    context positions jumping by a random gap after the source so that the recall distance spans ``SEGMENT ..
    MAX_RECALL_DISTANCE``; returns the drafter and its token accuracy per draft position over the last 50 steps.
    ``progress(step, loss, accuracy per draft position)`` after every step."""
    config = recall_drafter_config(spec)
    torch.manual_seed(spec.seed)
    drafter = DFlash2Drafter(config, target_hidden_size=spec.target.hidden_size)
    embed, head = target.get_input_embeddings(), target.get_output_embeddings()
    optimizer = torch.optim.AdamW(drafter.parameters(), lr=spec.learning_rate)
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, spec.learning_rate, total_steps=spec.train_steps)
    generator = torch.Generator().manual_seed(spec.seed)
    block = spec.draft_block
    correct = torch.zeros(block - 1)
    for step in range(spec.train_steps):
        group = _fresh_group(spec, target, generator)
        # r in 1 .. SEGMENT - block + 1 repeated tokens: anchor segment[r - 1], labels segment[r : r + block - 1]
        cuts = torch.randperm(SEGMENT - block + 1, generator=generator)[: spec.cuts].sort().values + 1
        labels_at = cuts[:, None] + torch.arange(block - 1)
        layout, n = group.layout, group.tokens.shape[0]
        source_end = layout.before + layout.segment
        gap = int(torch.randint(0, MAX_RECALL_DISTANCE - layout.recall_distance + 1, (1,), generator=generator))
        length = group.tokens.shape[1] - 1
        positions = torch.arange(length)
        positions[source_end:] += gap
        store = _CutBatch(n, positions)
        drafter.write_context(store, 0, group.features[:, :length].reshape(n * length, -1), positions.repeat(n))
        anchors = source_end + layout.between + cuts - 1  # [K] token indices of the anchors
        query = torch.full((n, len(cuts), block), config.mask_token_id)
        query[:, :, 0] = group.tokens[:, anchors]
        starts = (anchors + gap).tolist() * n
        hidden = drafter.forward_block(store, embed(query.flatten()).detach(), starts, block)
        logits = head(hidden.view(n, len(cuts), block, -1)[:, :, 1:])
        labels = group.segments[:, labels_at]  # [n, K, block - 1]
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        schedule.step()
        accuracy = (logits.argmax(-1) == labels).float().mean((0, 1))
        if step >= spec.train_steps - 50:
            correct += accuracy
        if progress is not None:
            progress(step, float(loss.detach()), accuracy.tolist())
    return drafter.eval(), (correct / min(50, spec.train_steps)).tolist()


def build_recall_models(
    folder: str | Path,
    spec: RecallModelSpec | None = None,
    progress: Callable[[int, float, list[float]], None] | None = None,
) -> EngineModels:
    """Build (or reuse, when ``folder`` holds the same spec) the recall target and its drafter; the returned
    ``train_accuracy`` is the drafter's mean accuracy over its draft positions (per position, and the build's
    seconds: ``folder/TRAIN_RECORD``)."""
    spec = spec or RecallModelSpec()
    folder = Path(folder)

    def build() -> float:
        start = time.perf_counter()
        target = build_recall_target(spec.target, folder / "target")
        drafter, per_position = train_recall_drafter(spec, target, progress)
        # no embeddings or head in the checkpoint: vLLM's DFlash drafter shares the target's
        drafter.save_pretrained(folder / "drafter")
        record = {"accuracy_per_position": per_position, "seconds": time.perf_counter() - start}
        (folder / TRAIN_RECORD).write_text(json.dumps(record))
        return sum(per_position) / len(per_position)

    return reuse_or_build(folder, "recall_models.json", spec, spec, build)
