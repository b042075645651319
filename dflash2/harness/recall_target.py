# SPDX-License-Identifier: Apache-2.0
"""A tiny target whose next token needs context far behind it: a hand-built induction (recall) Qwen3 that copies
the token which followed the previous occurrence of its current token, at any distance vLLM serves.

Its weights are constructed, not trained. Every token ``t`` has a unit code ``e_t`` (64 dims, random, seeded);
the residual stream holds named subspaces (``Residual``): ``E`` the current token's code, ``P1..Pn`` the codes of
the tokens 1..n positions back, ``C`` the copied code, and a constant 1.

- Layer 0, head ``j - 1`` (offset ``j``): queries and keys read only the constant, so the score is a function of
  the distance ``d = q - k`` alone: NeoX RoPE over the 16 fastest frequencies ``th_i`` with weights ``a_i`` gives
  ``sum_i a_i cos(th_i (d - j))``, 1 at ``d = j`` and at most ``1 - POSITION_MARGIN`` at any other ``d`` below
  16,384 (``a_0 = 1/2``, the rest shared evenly: checked numerically), scaled to a ``SCORE_GAP``-nat gap. The
  head copies ``E`` of the key into ``Pj``.
- Layer 1, head 0 (induction): the query is ``E``, the key ``P1``, both in the RoPE pairs whose frequency turns
  less than ~0.01 rad over ``max_positions`` (``rope_theta`` 1e12: position-free), so a query matches the key
  just after each earlier occurrence of its own token, however far back; it copies that key's ``E`` into ``C``.
- Layer 2 is empty, so the DFlash features (``target_layer_ids`` ``(1,)``: the residual after layer 1) are the
  same in transformers' ``hidden_states`` and vLLM's auxiliary hidden states (vLLM's last one is not normed).
- The head reads ``C``: the greedy next token is the copied one.

Tokens 0..2 are special and the last is the drafter's mask token. The rest split into ``recall`` tokens (the
segment a prompt repeats, distinct within it) and ``filler`` tokens, so a repeated segment token's only earlier
occurrence is its source: ``recall_prompt`` lays one out with the source at mid-context.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch

FIRST_TOKEN = 3
# a_0: the fastest frequency's share of the distance score (the other 15 pairs share the rest evenly)
POSITION_PAIRS = 16
POSITION_MARGIN = 0.2
# logit gap (nats) between the wanted key and any other, for the distance heads and the induction head
SCORE_GAP = 30.0
INDUCTION_SCORE = 100.0


@dataclass(frozen=True)
class RecallTargetSpec:
    """The target's shapes. ``offsets``: the codes of the tokens 1..offsets back kept in the residual (the
    drafter reads them); ``recall_tokens``: how many token ids the repeated segments draw from."""

    vocab_size: int = 512
    code_dim: int = 64
    offsets: int = 3
    num_heads: int = 4
    head_dim: int = 128
    rope_theta: float = 1e12
    max_positions: int = 16384
    recall_tokens: int = 128
    seed: int = 0

    @property
    def hidden_size(self) -> int:
        # E, P1..Pn, C, and one more code's width whose first column holds the constant
        return self.code_dim * (self.offsets + 3)

    @property
    def filler_tokens(self) -> tuple[int, int]:
        """``[first, end)`` of the filler ids: after the recall ids, before the mask token."""
        return FIRST_TOKEN + self.recall_tokens, self.vocab_size - 1


@dataclass(frozen=True)
class Residual:
    """Column ranges of the residual stream's subspaces."""

    code_dim: int
    offsets: int

    def code(self, index: int) -> slice:
        """0: E, 1..offsets: P1..Pn, offsets + 1: C."""
        return slice(index * self.code_dim, (index + 1) * self.code_dim)

    @property
    def copied(self) -> slice:
        return self.code(self.offsets + 1)

    @property
    def constant(self) -> int:
        return (self.offsets + 2) * self.code_dim


def frequencies(spec: RecallTargetSpec) -> torch.Tensor:
    """NeoX RoPE's ``th_i = theta^(-2i/D)``, as transformers and vLLM compute them (float64 here)."""
    return spec.rope_theta ** (-torch.arange(0, spec.head_dim, 2, dtype=torch.float64) / spec.head_dim)


def position_weights() -> torch.Tensor:
    return torch.tensor([0.5] + [0.5 / (POSITION_PAIRS - 1)] * (POSITION_PAIRS - 1), dtype=torch.float64)


def content_pairs(spec: RecallTargetSpec) -> torch.Tensor:
    """The ``code_dim / 2`` slowest RoPE pairs but the very last: at most ~0.01 rad over ``max_positions``."""
    half = spec.head_dim // 2
    pairs = torch.arange(half - 1 - spec.code_dim // 2, half - 1)
    turn = float(frequencies(spec)[pairs[0]]) * spec.max_positions
    if turn >= 0.05:
        raise ValueError(f"the content pairs turn {turn:.3f} rad over {spec.max_positions} positions; raise rope_theta")
    return pairs


def token_codes(spec: RecallTargetSpec) -> torch.Tensor:
    generator = torch.Generator().manual_seed(spec.seed)
    codes = torch.randn(spec.vocab_size, spec.code_dim, generator=generator, dtype=torch.float64)
    return codes / codes.norm(dim=1, keepdim=True)


def norm_weight(score: float, head_dim: int) -> float:
    """The q/k norm weight ``w`` that makes unit-direction q and k score ``score``: q_norm scales q to RMS
    ``w`` (norm ``w sqrt(D)``), so ``q.k / sqrt(D) = w^2 sqrt(D) cos``."""
    return math.sqrt(score / math.sqrt(head_dim))


def set_distance_head(attention, spec: RecallTargetSpec, head: int, offset: int, constant: int) -> None:
    """Head ``head`` of ``attention`` (a Qwen3-style attention module, weights zeroed) scores a key by its distance
    alone, ``offset`` back scoring ``SCORE_GAP`` nats above any other distance below ``max_positions``: queries and
    keys read only the residual's ``constant`` column, on the ``POSITION_PAIRS`` fastest RoPE pairs (module
    docstring)."""
    theta, amplitude = frequencies(spec), position_weights().sqrt()
    pairs, half = torch.arange(POSITION_PAIRS), spec.head_dim // 2
    rows = head * spec.head_dim + pairs
    attention.q_proj.weight[rows, constant] = (amplitude * torch.cos(offset * theta[pairs])).float()
    attention.q_proj.weight[rows + half, constant] = (-amplitude * torch.sin(offset * theta[pairs])).float()
    attention.k_proj.weight[rows, constant] = amplitude.float()
    # q/k norms are per head_dim, shared by the heads
    weight = norm_weight(SCORE_GAP / POSITION_MARGIN, spec.head_dim)
    for norm in (attention.q_norm, attention.k_norm):
        norm.weight[pairs], norm.weight[pairs + half] = weight, weight


def set_content_match(attention, spec: RecallTargetSpec, head: int, query: slice, key: slice) -> None:
    """Head ``head`` of ``attention`` (weights zeroed) matches the query row's code in residual columns ``query``
    with the key row's code in ``key``, position-free (``content_pairs``): ``INDUCTION_SCORE`` nats for equal codes."""
    content, half = content_pairs(spec), spec.head_dim // 2
    dims = torch.cat([content, content + half])
    identity = torch.eye(spec.code_dim)
    attention.q_proj.weight[head * spec.head_dim + dims, query] = identity
    attention.k_proj.weight[head * spec.head_dim + dims, key] = identity
    for norm in (attention.q_norm, attention.k_norm):
        norm.weight[dims] = norm_weight(INDUCTION_SCORE, spec.head_dim)


def build_recall_target(spec: RecallTargetSpec, folder: Path | None = None):
    """The induction target (module docstring) as a transformers ``Qwen3ForCausalLM``, saved to ``folder``."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    hidden, heads, head_dim = spec.hidden_size, spec.num_heads, spec.head_dim
    if spec.offsets >= heads:
        raise ValueError(f"offsets={spec.offsets} needs a layer-0 head each; give num_heads > offsets")
    config = Qwen3Config(
        vocab_size=spec.vocab_size, hidden_size=hidden, intermediate_size=hidden, num_hidden_layers=3,
        num_attention_heads=heads, num_key_value_heads=heads, head_dim=head_dim,
        max_position_embeddings=spec.max_positions, rope_parameters={"rope_type": "default",
        "rope_theta": spec.rope_theta}, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
        use_sliding_window=False, layer_types=["full_attention"] * 3, rms_norm_eps=1e-6,
    )  # fmt: skip
    config.architectures = ["Qwen3ForCausalLM"]
    model = Qwen3ForCausalLM(config).float().eval()
    residual = Residual(spec.code_dim, spec.offsets)
    codes = token_codes(spec)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.zero_()
        for norm in [model.model.norm] + [
            n for layer in model.model.layers for n in (layer.input_layernorm, layer.post_attention_layernorm)
        ]:
            norm.weight.fill_(1.0)  # fmt: skip
        embed = torch.zeros(spec.vocab_size, hidden, dtype=torch.float64)
        embed[:, residual.code(0)] = codes
        embed[:, residual.constant] = 1.0
        model.model.embed_tokens.weight.copy_(embed)

        # layer 0: the distance heads; input RMS: E and the constant, each of norm 1
        distance = model.model.layers[0].self_attn
        scale = math.sqrt(hidden / 2)
        for head in range(spec.offsets):
            offset = head + 1
            set_distance_head(distance, spec, head, offset, residual.constant)
            values = head * head_dim + torch.arange(spec.code_dim)
            distance.v_proj.weight[values, residual.code(0)] = torch.eye(spec.code_dim) / scale
            distance.o_proj.weight[residual.code(offset), values] = torch.eye(spec.code_dim)

        # layer 1: the induction head; input RMS: E, P1..Pn and the constant, each of norm 1
        induction = model.model.layers[1].self_attn
        scale = math.sqrt(hidden / (spec.offsets + 2))
        set_content_match(induction, spec, 0, residual.code(0), residual.code(1))
        values = torch.arange(spec.code_dim)
        induction.v_proj.weight[values, residual.code(0)] = torch.eye(spec.code_dim) / scale
        induction.o_proj.weight[residual.copied, values] = torch.eye(spec.code_dim)

        # the head reads C (after the final norm, C has norm ~1 / RMS): logits = 5 * RMS-scaled cos
        head = torch.zeros(spec.vocab_size, hidden, dtype=torch.float64)
        head[:, residual.copied] = 5.0 * codes
        model.lm_head.weight.copy_(head)
    if folder is not None:
        model.save_pretrained(folder)
    return model


@dataclass(frozen=True)
class RecallLayout:
    """``[filler: before][segment][filler: between][segment[:repeated]]``: the segment's tokens are distinct
    recall tokens, so from the repeat on the target copies the segment, each copied token reaching back
    ``recall_distance`` positions to its source."""

    before: int
    segment: int
    between: int
    repeated: int

    @property
    def length(self) -> int:
        return self.before + self.segment + self.between + self.repeated

    @property
    def recall_distance(self) -> int:
        """Positions from a copied token back to its source: ``segment + between``."""
        return self.segment + self.between


def recall_layout(context: int, segment: int = 48, repeated: int = 4) -> RecallLayout:
    """A prompt of ``context`` tokens with the segment's source starting at mid-context (past any sinks of up
    to ``context / 2`` tokens), so a copy reaches back about ``context / 2``."""
    before = context // 2
    between = context - before - segment - repeated
    if between < 0:
        raise ValueError(f"context {context} is too short for a segment of {segment}; give >= {2 * (segment + 4)}")
    return RecallLayout(before, segment, between, repeated)


def recall_batch(
    spec: RecallTargetSpec, layout: RecallLayout, count: int, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """``count`` sequences of ``layout``: tokens ``[count, layout.length]`` and their segments
    ``[count, layout.segment]`` (what follows the repeat is the rest of its segment)."""
    first, end = spec.filler_tokens
    segments = torch.rand(count, spec.recall_tokens, generator=generator).argsort(1)[:, : layout.segment]
    segments = segments + FIRST_TOKEN

    def filler(length: int) -> torch.Tensor:
        return torch.randint(first, end, (count, length), generator=generator)

    tokens = torch.cat([filler(layout.before), segments, filler(layout.between), segments[:, : layout.repeated]], 1)
    return tokens, segments
