# SPDX-License-Identifier: Apache-2.0
"""A word-level tokenizer with a chat template for the tiny engine target, so vLLM's OpenAI server can chat.

Ids 0, 1, 2 are the special tokens pad, bos, eos (``engine_models``); every other id ``i`` is the word
``t{i}``, the drafter's mask token (the last id) included, so any reply decodes to text that reads back as the
same ids. Whitespace splits words, decoding joins them with spaces. The template writes each message as its
role marker (``t3`` user, ``t4`` assistant, ``t5`` system) followed by its content, and adds no generation
prompt: the chain target's next token depends on the last token alone, so a fixed marker at the end would make
every reply the same chain.
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from .engine_models import FIRST_TOKEN

PAD, BOS, EOS = "<pad>", "<s>", "</s>"
# each message starts with its role's marker token
ROLE_MARKERS = {"user": 3, "assistant": 4, "system": 5}
CHAT_TEMPLATE = (
    "{%- set markers = " + json.dumps({role: f"t{i}" for role, i in ROLE_MARKERS.items()}) + " -%}"
    "{%- for message in messages -%}{{ markers[message['role']] ~ ' ' ~ message['content'] ~ ' ' }}{%- endfor -%}"
)


def words(token_ids: list[int]) -> str:
    """Text that the tokenizer reads back as ``token_ids`` (ids from ``FIRST_TOKEN`` on)."""
    return " ".join(f"t{i}" for i in token_ids)


def word_level_tokenizer(vocab_size: int) -> Tokenizer:
    vocab = {PAD: 0, BOS: 1, EOS: 2} | {f"t{i}": i for i in range(FIRST_TOKEN, vocab_size)}
    # an unknown word reads as pad, which no template or reply produces
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token=PAD))
    tokenizer.add_special_tokens([PAD, BOS, EOS])
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.decoder = decoders.WordPiece(cleanup=False)
    return tokenizer


def save_chat_tokenizer(target: str | Path, vocab_size: int) -> None:
    """Write ``tokenizer.json`` and ``tokenizer_config.json`` (a ``PreTrainedTokenizerFast`` with the chat
    template) into the target's folder."""
    target = Path(target)
    word_level_tokenizer(vocab_size).save(str(target / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast", "pad_token": PAD, "bos_token": BOS, "eos_token": EOS,
        "unk_token": PAD, "model_max_length": 1 << 20, "chat_template": CHAT_TEMPLATE,
    }  # fmt: skip
    (target / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
