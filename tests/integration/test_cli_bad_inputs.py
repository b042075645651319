# SPDX-License-Identifier: Apache-2.0
"""Every door a user touches refuses bad input the same way: one line on stderr naming the value and the fix,
exit code 2, nothing run and nothing written."""

from __future__ import annotations

import json

import pytest
from ringkv.integration.cli import app
from typer.testing import CliRunner

FOLDER = "a-folder"


def drafter_folder(tmp_path, **drop) -> str:
    """A DFlash drafter config.json (without the keys in ``drop``) in its own folder."""
    config = {
        "architectures": ["DFlashDraftModel"], "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 128,
        "layer_types": ["sliding_attention"] * 2, "sliding_window": 2048, "is_causal": False,
        "dflash_config": {"block_size": 8, "target_layer_ids": [0, 1], "mask_token_id": 127},
    }  # fmt: skip
    for key in drop:
        config.pop(key)
    folder = tmp_path / "drafter"
    folder.mkdir(exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    return str(folder)


# a value one flag refuses: the error names the flag and the value
BAD_VALUES = {
    "demo": [("--last-position", "3"), ("--last-position", str(1 << 31))],
    "admission": [
        ("--pool-blocks", "0"), ("--pool-blocks", "-5"), ("--target-groups", "0"), ("--window", "0"),
        ("--drafter-kv-block-size", "0"), ("--num-speculative-tokens", "0"), ("--num-speculative-tokens", "64"),
        ("--max-model-len", "0"), ("--max-num-batched-tokens", "0"), ("--decode-steps", "-1"),
        ("--target-kv-block-size", "100"),
    ],
    "smoke": [("--draft-block", "0"), ("--draft-block", "65"), ("--steps", "0"), ("--chunk", "0"),
              ("--kv-cache-dtype", "fp4"), ("--kv-cache-dtype", "bfloat16")],
    "e2e": [("--kv-block-size", "48"), ("--window", "4"), ("--chunk", "1"), ("--decode-tokens", "0"),
            ("--kv-cache-dtype", "int8")],
    "plan {drafter}": [("--kv-block-size", "0"), ("--num-speculative-tokens", "64"), ("--dtype-bytes", "3")],
}  # fmt: skip
CASES = [
    *(([*cmd.split(), flag, value], f"{flag} {value}") for cmd, values in BAD_VALUES.items() for flag, value in values),
    (["admission", "--prompt-tokens", "300000"], "300000 tokens"),
    (["admission", "--decode-steps", "40000"], "lower --decode-steps"),
    (["admission", "--plot", FOLDER], "is a folder"),
    (["smoke", "--context", "100"], "--context 100 is below --window 2048"),
    (["smoke", "--window", "4"], "--window 4 must be >= --draft-block 8"),
    (["smoke", "--context", str((1 << 31) - 8)], "largest position"),
    (["e2e", "--context", "10"], "--context 10 is below --window 64"),
    (["e2e", "--plot", FOLDER], "is a folder"),
    (["plan", "no-such-drafter"], "no-such-drafter does not exist"),
    (["plan", "{drafter_without_head_dim}"], "'head_dim' is missing"),
    (["plan", "{drafter_not_json}"], "config.json"),
    (["bench", "cpu-figures", "--out", "a-file"], "--out a-file is a file"),
    # flags the glossary renamed: refused with the new name, never read as another meaning
    (["smoke", "--block-size", "8"], "--block-size was renamed --draft-block"),
    (["e2e", "--block-size=32"], "--block-size was renamed --kv-block-size"),
    (["admission", "--target-block-size", "2304"], "--target-block-size was renamed --target-kv-block-size"),
    (["admission", "--drafter-block-size", "16"], "--drafter-block-size was renamed --drafter-kv-block-size"),
    (["bench", "load", "--drafter-block-size", "16"], "--drafter-block-size was renamed --drafter-kv-block-size"),
    (["bench", "load", "--target-block-size", "576"], "--target-block-size was renamed --target-kv-block-size"),
]


@pytest.mark.parametrize(("args", "message"), CASES, ids=[" ".join(a)[:60] for a, _ in CASES])
def test_bad_input_is_one_line_exit_2_and_writes_nothing(args, message, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / FOLDER).mkdir()
    (tmp_path / "a-file").write_text("")
    paths = {"drafter": drafter_folder(tmp_path), "drafter_without_head_dim": None, "drafter_not_json": None}
    if "{drafter_without_head_dim}" in args:
        paths["drafter_without_head_dim"] = drafter_folder(tmp_path, head_dim=True)
    if "{drafter_not_json}" in args:
        (tmp_path / "broken").mkdir()
        (tmp_path / "broken" / "config.json").write_text("{not json")
        paths["drafter_not_json"] = str(tmp_path / "broken")
    args = [arg.format(**paths) if arg.startswith("{") else arg for arg in args]
    before = sorted(p.name for p in tmp_path.rglob("*"))
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ringkv: error: "), result.stderr
    assert message in lines[0]
    assert sorted(p.name for p in tmp_path.rglob("*")) == before, "a refused command wrote a file"
