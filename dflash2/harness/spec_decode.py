# SPDX-License-Identifier: Apache-2.0
"""Greedy speculative decoding with the DFlash2 drafter on ring KV, against a transformers target.

Each step drafts ``B - 1`` tokens after the bonus token, the target verifies ``[bonus, drafts]`` and keeps
the longest agreeing prefix plus its own next token; the drafter's context K/V are written for the accepted
rows only (from the target's features of this verify pass). Greedy verification makes the output exactly
the target's own greedy decoding.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from ringkv.dflash2.model import DFlash2Drafter
from torch import nn

from .ring_cache import DraftKVCache


class TargetModel:
    """A Hugging Face causal LM exposing the hidden states the drafter reads (``hidden_states[id + 1]``)."""

    def __init__(self, model: nn.Module, layer_ids: tuple[int, ...]) -> None:
        self.model, self.layer_ids = model.eval(), layer_ids

    @property
    def embed(self) -> nn.Module:
        return self.model.get_input_embeddings()

    @property
    def lm_head(self) -> nn.Module:
        return self.model.get_output_embeddings()

    @torch.no_grad()
    def __call__(self, tokens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """(logits ``[L, vocab]``, concatenated features ``[L, len(layer_ids) * hidden]``) of ``tokens``."""
        device = next(self.model.parameters()).device
        out = self.model(torch.tensor([tokens], device=device), output_hidden_states=True)
        features = torch.cat([out.hidden_states[i + 1][0] for i in self.layer_ids], dim=-1)
        return out.logits[0], features


def greedy_reference(target: TargetModel, prompt: list[int], max_new_tokens: int) -> list[int]:
    """The target alone, one greedy token per forward."""
    tokens = list(prompt)
    for _ in range(max_new_tokens):
        logits, _ = target(tokens)
        tokens.append(int(logits[-1].argmax()))
    return tokens[len(prompt) :]


@dataclass
class SpecDecodeResult:
    tokens: list[int]
    accepted_per_step: list[int] = field(default_factory=list)
    # per step: the drafter's logits [B-1, vocab] for its drafts
    draft_logits: list[torch.Tensor] = field(default_factory=list)


@torch.no_grad()
def speculative_generate(
    target: TargetModel,
    drafter: DFlash2Drafter,
    cache: DraftKVCache,
    prompt: list[int],
    max_new_tokens: int,
    request: int = 0,
) -> SpecDecodeResult:
    """Generate ``max_new_tokens`` tokens with drafts from ``drafter`` over ``cache`` (request ``request``)."""
    block = drafter.config.draft_block
    tokens = list(prompt)
    logits, features = target(tokens)
    drafter.write_context(cache, request, features, torch.arange(len(tokens)))
    bonus = int(logits[-1].argmax())
    result = SpecDecodeResult(tokens=[])
    while len(result.tokens) < max_new_tokens:
        context_len = len(tokens)
        drafts, draft_logits = drafter.draft(
            cache, torch.tensor([bonus]), [context_len], target.embed, target.lm_head, requests=[request]
        )
        if draft_logits is not None:
            result.draft_logits.append(draft_logits[0])
        drafts = drafts[0].tolist()
        logits, features = target([*tokens, bonus, *drafts])
        predictions = logits[context_len : context_len + block].argmax(-1).tolist()
        accepted = 0
        while accepted < block - 1 and drafts[accepted] == predictions[accepted]:
            accepted += 1
        new_rows = [bonus, *drafts[:accepted]]
        positions = torch.arange(context_len, context_len + len(new_rows))
        drafter.write_context(cache, request, features[context_len : context_len + len(new_rows)], positions)
        tokens.extend(new_rows)
        result.tokens.extend(new_rows)
        result.accepted_per_step.append(accepted)
        bonus = predictions[accepted]
    result.tokens = result.tokens[:max_new_tokens]
    return result
