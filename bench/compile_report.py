# SPDX-License-Identifier: Apache-2.0
"""Native compile report: every shipped kernel config compiled for sm_90 and sm_100 on a CPU machine, exactly as
a launch on that GPU would compile it, with registers, spill bytes, shared memory, CTAs per SM and the SASS
width of every K/V tile load.

How: each launch (``ring_attention`` on draft blocks and on prefill chunks, ``ring_write``) runs on CPU stand-in
tensors that have a real launch's shapes, strides and 16-byte-aligned buffers, in two layouts (``LAYOUTS``): compact
R-column ring rows, and what the vLLM plugin launches (full logical rows of vLLM's block table, its per-layer cache,
packed q/k/v; a table width that is a multiple of 16 specialises the attention kernel). The kernel's ``run`` is
intercepted and its arguments are bound by Triton's own binder for the target (``create_function_from_signature`` over
``native_specialize_impl``: ``tt.divisibility=16`` on pointers and ints divisible by 16, 1-valued ints as
constants, ``do_not_specialize`` honoured), then ``triton.compile`` builds the cubin. A bare ``ASTSource``
without that specialisation compiles a different, worse kernel (``design/performance.md``).
``cuobjdump --dump-resource-usage`` gives REG / STACK (local-memory spill bytes) / SHARED;
``nvdisasm --print-line-info`` attributes every global load to its source line, so the loads issued by
``_tiles.load_kv_tile`` (every K/V tile of the ring and of the batch's own rows) are counted by width.

Usage (the full sweep writes ``bench/results/compile_report.jsonl`` and the table in ``bench/README.md``)::

    .venv/bin/ringkv bench compile-report
    .venv/bin/ringkv bench compile-report --quick --out "$(mktemp -d)"   # the CI subset, no README
    .venv/bin/ringkv bench compile-report --vllm-source /path/to/site-packages  # + vLLM's kernel

vLLM's ``kernel_unified_attention`` is loaded at run time from its two source files (``vllm_unified.py``);
nothing of vLLM is copied here.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import inspect
import json
import os
import re
import subprocess
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any
from unittest import mock

import typer

from .records import REPO, environment

ARCHS = (90, 100)
README = REPO / "bench" / "README.md"
RESULTS = REPO / "bench" / "results"
BEGIN_MARK = "<!-- compile-report:begin -->"
END_MARK = "<!-- compile-report:end -->"
# gates (tests/bench/test_compile_report.py): the DFlash2 decode shape at 4 warps
DFLASH2 = {"op": "decode", "G": 4, "D": 128}
DFLASH2_MAX_REGS = 136


@dataclass(frozen=True)
class SmLimits:
    """Per-SM resources that bound resident CTAs (H100/H200 sm_90; B200 sm_100 has the same figures)."""

    regs: int = 65536
    smem_bytes: int = 228 * 1024
    threads: int = 2048
    ctas: int = 32
    # registers are allocated per warp in units of 256 (8 per thread)
    reg_unit_per_warp: int = 256


LIMITS = SmLimits()


def ctas_per_sm(regs: int, smem_bytes: int, num_warps: int, limits: SmLimits = LIMITS) -> int:
    """Resident CTAs per SM from registers per thread, shared memory per CTA (static + dynamic) and warps."""
    import triton

    regs_per_warp = triton.cdiv(max(regs, 1) * 32, limits.reg_unit_per_warp) * limits.reg_unit_per_warp
    by_regs = (limits.regs // regs_per_warp) // num_warps
    by_smem = limits.smem_bytes // smem_bytes if smem_bytes else limits.ctas
    by_threads = limits.threads // (32 * num_warps)
    return min(by_regs, by_smem, by_threads, limits.ctas)


def _tool(name: str) -> str:
    import triton

    return str(Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / name)


def _with_cubin(cubin: bytes, *command: str) -> str:
    with tempfile.NamedTemporaryFile(suffix=".cubin") as handle:
        handle.write(cubin)
        handle.flush()
        done = subprocess.run([*command, handle.name], capture_output=True, text=True, check=True)
    return done.stdout


def resource_usage(cubin: bytes) -> dict[str, int]:
    """``REG``, ``STACK`` (spill bytes) and static ``SHARED`` of the cubin's kernel (``cuobjdump``)."""
    text = _with_cubin(cubin, _tool("cuobjdump"), "--dump-resource-usage")
    line = next(line for line in text.splitlines() if "REG:" in line)
    return {key: int(value) for key, value in re.findall(r"(REG|STACK|SHARED):(\d+)", line)}


LOAD_OPCODE = re.compile(r"\b((?:LDG|LDGSTS|UTMALDG)(?:\.[A-Z0-9_]+)*)\b")
LINE_INFO = re.compile(r'//## File "([^"]+)", line (\d+)')


def global_loads(cubin: bytes) -> list[tuple[str, str, int]]:
    """Every global load of the SASS as ``(opcode, source file, source line)`` (``nvdisasm`` line info)."""
    text = _with_cubin(cubin, _tool("nvdisasm"), "--print-line-info")
    loads, where = [], ("?", 0)
    for line in text.splitlines():
        info = LINE_INFO.search(line)
        if info:
            where = (info.group(1), int(info.group(2)))
            continue
        match = LOAD_OPCODE.search(line.split(";")[0])
        if match:
            loads.append((match.group(1), *where))
    return loads


def kv_tile_lines() -> tuple[tuple[str, ...], range]:
    """Source file (its last two path parts: Triton's cache may hold a cubin compiled from another checkout of
    the same source) and lines of ``_tiles.load_kv_tile``: the K/V tile loads of every attention kernel."""
    from ringkv.kernels import _tiles

    lines, first = inspect.getsourcelines(_tiles.load_kv_tile.fn)
    return Path(inspect.getsourcefile(_tiles.load_kv_tile.fn)).parts[-2:], range(first, first + len(lines))


def mma_kind(ttgir: str) -> str:
    """The tensor-core instruction family ``tl.dot`` lowered to (from the TTGIR)."""
    if "tc_gen5_mma" in ttgir:
        return "tcgen05"
    if "warp_group_dot" in ttgir:
        return "wgmma"
    if "nvidia_mma" in ttgir:
        return "mma.sync"
    return "fma" if "tt.dot" in ttgir else "none"


@dataclass
class Compiled:
    """One compiled specialisation of one kernel for one arch."""

    kernel: str
    arch: int
    key: str
    num_warps: int
    num_stages: int
    regs: int
    spill_bytes: int
    smem_bytes: int
    ctas_per_sm: int
    mma: str
    loads: dict[str, int]
    kv_loads: dict[str, int] | None
    compile_s: float


class NativeLaunches:
    """Intercept launches of the given kernels: bind the arguments with Triton's binder for ``arch`` and record
    the specialisation key (``compile=False``) or compile and measure it (``compile=True``, memoised per key)."""

    def __init__(self, arch: int, *, compile: bool, kv_lines: tuple[tuple[str, ...], range] | None) -> None:
        from triton.backends.compiler import GPUTarget
        from triton.compiler import make_backend

        self.arch = arch
        self.target = GPUTarget("cuda", arch, 32)
        self.backend = make_backend(self.target)
        self.compile = compile
        self.kv_lines = kv_lines
        self.cache: dict[tuple[str, str], Compiled] = {}
        self.launched: list[tuple[str, str, tuple]] = []  # (kernel, key, grid) per launch
        # (kernel, key) -> the binder's specialisation of each runtime argument, e.g. "i32 D" (divisible by 16)
        self.specialised: dict[tuple[str, str], dict[str, str]] = {}

    def _run(self, kernel: Any) -> Callable[..., None]:
        import triton
        from triton import knobs
        from triton.compiler import ASTSource
        from triton.runtime.jit import compute_cache_key, create_function_from_signature

        binder = create_function_from_signature(kernel.signature, kernel.params, self.backend)
        name = kernel.fn.__name__

        def run(*args: Any, grid: Any, warmup: bool, **kwargs: Any) -> None:
            # the options JITFunction.run adds before binding
            kwargs["debug"] = kwargs.get("debug", kernel.debug) or knobs.runtime.debug
            kwargs["instrumentation_mode"] = knobs.compilation.instrumentation_mode
            bound, specialization, options = binder(*args, **kwargs)
            key = hashlib.sha256(compute_cache_key({}, specialization, options).encode()).hexdigest()[:12]
            self.launched.append((name, key, tuple(grid)))
            self.specialised.setdefault((name, key), {
                param.name: " ".join(str(part) for part in spec if part not in (None, ""))
                for param, spec in zip(kernel.params, specialization, strict=True) if not param.is_constexpr
            })  # fmt: skip
            if not self.compile or (name, key) in self.cache:
                return
            options, signature, constexprs, attrs = kernel._pack_args(self.backend, kwargs, bound, specialization,
                                                                      options)  # fmt: skip
            start = time.perf_counter()
            compiled = triton.compile(ASTSource(kernel, signature, constexprs, attrs), target=self.target,
                                      options=options.__dict__)  # fmt: skip
            self.cache[(name, key)] = self._measure(name, key, compiled, options, time.perf_counter() - start)

        return run

    def _measure(self, name: str, key: str, compiled: Any, options: Any, seconds: float) -> Compiled:
        cubin = compiled.asm["cubin"]
        usage = resource_usage(cubin)
        loads = global_loads(cubin)
        kv = None
        if self.kv_lines is not None:
            parts, lines = self.kv_lines
            kv = dict(Counter(op for op, file, line in loads if Path(file).parts[-2:] == parts and line in lines))
        smem = usage["SHARED"] + compiled.metadata.shared
        return Compiled(
            kernel=name, arch=self.arch, key=key, num_warps=options.num_warps, num_stages=options.num_stages,
            regs=usage["REG"], spill_bytes=usage["STACK"], smem_bytes=smem,
            ctas_per_sm=ctas_per_sm(usage["REG"], smem, options.num_warps), mma=mma_kind(compiled.asm["ttgir"]),
            loads=dict(Counter(op for op, _, _ in loads)), kv_loads=kv, compile_s=round(seconds, 2),
        )  # fmt: skip

    @contextlib.contextmanager
    def intercept(self, kernels: list[Any]) -> Iterator[NativeLaunches]:
        with contextlib.ExitStack() as stack:
            for kernel in kernels:
                stack.enter_context(mock.patch.object(kernel, "run", self._run(kernel)))
            yield self


@contextlib.contextmanager
def cpu_stand_ins(num_sms: int = 132) -> Iterator[None]:
    """Let the launchers take CPU tensors as if they were on an H200 (132 SMs): the device check passes and the
    split-KV choice sees the GPU's SM count. Everything else (validation, configs, grids) runs unchanged."""
    from ringkv.kernels import attention, validation, write

    def same_device(named: dict) -> Any:
        return next(iter(named.values())).device

    with (
        mock.patch.object(validation, "check_same_device", same_device),
        mock.patch.object(write, "check_same_device", same_device),
        mock.patch.object(attention, "device_sms", lambda device: num_sms),
    ):
        yield


def ringkv_kernels() -> list[Any]:
    from ringkv.kernels import attention, write

    return [attention._ring_attention_kernel, attention._combine_splits_kernel, write._ring_write_kernel]


# ----------------------------------------------------------------------------------------------------------------
# launches on stand-in tensors (shapes and strides of a real launch; the pool holds only one ring: the kernels
# specialise on strides, never on the number of blocks)

WINDOW, BLOCK_SIZE, NUM_KV_HEADS, DRAFT_BLOCK, CONTEXT = 2048, 16, 8, 8, 262_136
# the fp8 ring the report compiles (vLLM's kv_cache_dtype name); rows without "kv" are bf16 rings
FP8_CASES = "fp8_e4m3"
# Each launch in two layouts (the rows' "layout"):
# - "compact": compact R-column ring rows (VarlenBatch table_period=R, R = 130) over contiguous
#   [num_blocks, bs, Hkv, D] caches: the kernel API's ring (tests, harness, gpu_check);
# - "plugin": what RingKVImpl launches (integration/vllm): full logical block-table rows (table_period=None, entry
#   j = ring[j mod R] or the null block, ``vllm_batch``) of vLLM's [num_reqs, cdiv(max_model_len, bs)] table, its
#   per-layer cache [num_blocks, Hkv, bs, D + Dv] split into K/V views (``split_kv_cache``), q/k/v views of one packed
#   qkv projection, split scratch from a ``SplitWorkspace``, context rows stored by ``store_rows``. The kernel then
#   reads table_period = stride_bt_r = the table width; a width that is a multiple of 16 specialises both
#   (tt.divisibility=16) into another kernel, any other width compiles the compact layout's
#   (``layout_specialisation``).
LAYOUTS = ("compact", "plugin")
# the plugin's table: max_model_len 262,144 (CONTEXT + a draft block) -> cdiv(262,144, bs) = 16,384 columns, a
# multiple of 16
PLUGIN_TABLE_WIDTH = 262_144 // BLOCK_SIZE


def _caches(
    num_blocks: int, head_dim: int, dtype: Any, kv_cache_dtype: str = "auto", layout: str = "compact"
) -> dict[str, Any]:
    """Ring cache views (``k_cache``, ``v_cache``) of ``dtype``, or of the fp8 type a vLLM ``kv_cache_dtype``
    names, with the layer's scales (``k_scale``, ``v_scale``); ``layout="plugin"``: K/V views of vLLM's per-layer
    cache (an fp8 one allocated as uint8, as vLLM does)."""
    import torch
    from ringkv.integration.vllm.backend_step import split_kv_cache
    from ringkv.kernels.kv_quant import fp8_dtype_of

    fp8 = fp8_dtype_of(kv_cache_dtype)
    if layout == "plugin":
        kv_cache = torch.empty(num_blocks, NUM_KV_HEADS, BLOCK_SIZE, 2 * head_dim, dtype=torch.uint8 if fp8 else dtype)
        k_cache, v_cache = split_kv_cache(kv_cache, head_dim, fp8)
    else:
        shape = (num_blocks, BLOCK_SIZE, NUM_KV_HEADS, head_dim)
        k_cache, v_cache = torch.empty(shape, dtype=fp8 or dtype), torch.empty(shape, dtype=fp8 or dtype)
    scales = {"k_scale": torch.ones(1), "v_scale": torch.ones(1)} if fp8 else {}
    return {"k_cache": k_cache, "v_cache": v_cache, **scales}


def _qkv(tokens: int, group: int, head_dim: int, layout: str) -> tuple[Any, Any, Any]:
    """``q [T, Hkv * G, D]``, ``k_new`` / ``v_new [T, Hkv, D]`` in bf16; ``layout="plugin"``: views of one packed
    ``[T, (Hq + 2 Hkv) D]`` projection, as vLLM's models split it."""
    import torch

    heads = (NUM_KV_HEADS * group, NUM_KV_HEADS, NUM_KV_HEADS)
    if layout == "compact":
        return tuple(torch.empty(tokens, h, head_dim, dtype=torch.bfloat16) for h in heads)
    qkv = torch.empty(tokens, sum(heads) * head_dim, dtype=torch.bfloat16)
    parts = qkv.split([h * head_dim for h in heads], dim=-1)
    return tuple(part.view(tokens, h, head_dim) for part, h in zip(parts, heads, strict=True))


def _batch(query_len: int, seq_len: int, num_reqs: int, ring: int, mode: Any, layout: str, width: int) -> Any:
    """``num_reqs`` requests of ``query_len`` queries ending at ``seq_len``: compact ring rows of ``ring`` columns,
    or (plugin) ``vllm_batch`` over full rows ``width`` columns wide (block ids never specialise: zeros)."""
    import torch
    from ringkv.integration.vllm.backend_step import vllm_batch
    from ringkv.kernels import VarlenBatch

    query_start_loc = torch.arange(0, num_reqs * query_len + 1, query_len, dtype=torch.int32)
    seq_lens = torch.full((num_reqs,), seq_len, dtype=torch.int32)
    if layout == "plugin":
        batch = vllm_batch(query_start_loc, seq_lens, torch.zeros(num_reqs, width, dtype=torch.int32), query_len,
                           seq_len)  # fmt: skip
        assert batch.mode is mode, f"vllm_batch chose {batch.mode} for {query_len} queries per request, not {mode}"
        return batch
    return VarlenBatch(query_start_loc, seq_lens, torch.zeros(num_reqs, ring, dtype=torch.int32), query_len, seq_len,
                       table_period=ring, mode=mode)  # fmt: skip


def _scratch(layout: str) -> dict[str, Any]:
    """The plugin's split scratch: views of a ``SplitWorkspace`` (its metadata builder holds one)."""
    from ringkv.kernels.attention import SplitWorkspace

    return {"workspace": SplitWorkspace()} if layout == "plugin" else {}


def launch_decode(
    num_reqs: int, group: int, head_dim: int, context: int = CONTEXT, kv_cache_dtype: str = "auto",
    layout: str = "compact", width: int = PLUGIN_TABLE_WIDTH,
) -> None:  # fmt: skip
    """``ring_attention`` on N draft blocks of 8 after ``context`` positions at the DFlash2 ring (W 2048, bs 16,
    R 130), bf16, non-causal (``kv_cache_dtype``: an fp8 ring, vLLM's name; ``layout``: ``LAYOUTS``, ``width``: the
    plugin's table width)."""
    from ringkv.kernels import BatchMode, RingPlan, ring_attention

    ring = RingPlan(WINDOW, BLOCK_SIZE, DRAFT_BLOCK).ring_blocks
    q, k_new, v_new = _qkv(num_reqs * DRAFT_BLOCK, group, head_dim, layout)
    batch = _batch(DRAFT_BLOCK, context + DRAFT_BLOCK, num_reqs, ring, BatchMode.DRAFT_BLOCK, layout, width)
    caches = _caches(ring + 1, head_dim, q.dtype, kv_cache_dtype, layout)
    ring_attention(q, k_new, v_new, batch=batch, window=WINDOW, causal=False, **caches, **_scratch(layout))


def launch_prefill(
    chunk: int, group: int, head_dim: int, kv_cache_dtype: str = "auto", layout: str = "compact",
    width: int = PLUGIN_TABLE_WIDTH,
) -> None:  # fmt: skip
    """``ring_attention`` of one causal prefill chunk after 8192 positions of history (the kernel only: a target
    layer's write after it is the ``ring_write`` kernel of ``launch_write``, same tensors)."""
    from ringkv.kernels import BatchMode, RingPlan, ring_attention

    ring = RingPlan(WINDOW, BLOCK_SIZE, 1).ring_blocks
    q, k_new, v_new = _qkv(chunk, group, head_dim, layout)
    batch = _batch(chunk, 8192 + chunk, 1, ring, BatchMode.PREFILL_CHUNK, layout, width)
    caches = _caches(ring + 1, head_dim, q.dtype, kv_cache_dtype, layout)
    ring_attention(q, k_new, v_new, batch=batch, window=WINDOW, causal=True, **caches, **_scratch(layout))


def launch_write(head_dim: int, kv_cache_dtype: str = "auto", layout: str = "compact") -> None:
    """``ring_write`` of 64 rows (a decode step's context rows for 8 requests); plugin: ``store_rows``
    (``do_kv_cache_update``) of K/V views of a packed projection (G 4) into vLLM's cache."""
    import torch
    from ringkv.integration.vllm.backend_step import store_rows
    from ringkv.kernels import ring_write

    caches = _caches(131, head_dim, torch.bfloat16, kv_cache_dtype, layout)
    slots = torch.arange(64, dtype=torch.int64)
    if layout == "plugin":
        _, k_new, v_new = _qkv(64, 4, head_dim, layout)
        store_rows(k_new, v_new, slot_mapping=slots, **caches)
        return
    rows = torch.empty(64, NUM_KV_HEADS, head_dim, dtype=torch.bfloat16)
    ring_write(rows, rows.clone(), slot_mapping=slots, **caches)


@dataclass(frozen=True)
class Case:
    op: str
    shape: dict[str, Any]
    launch: Callable[[], None]


def cases(quick: bool) -> list[Case]:
    """The shipped configs in both ``LAYOUTS``: decode N x G x D (B = 8), prefill C x G x D, ring_write D, bf16 and
    fp8 rings; quick = the CI subset (the DFlash2 shape G4 D128 everywhere, bf16 compact also G4 D256)."""
    all_groups_dims = [(g, d) for g in (1, 4, 8) for d in (64, 128, 256)]
    batch_sizes = (1, 8, 64, 256)
    chunks = (512, 8192)
    write_dims = (64, 128, 256)
    if quick:
        batch_sizes, chunks, write_dims = (1, 256), (8192,), (128,)
    out = []
    for layout in LAYOUTS:
        # an fp8 e4m3 ring under bf16 compute, gated as bf16
        for kv in ("auto", FP8_CASES):
            groups_dims = all_groups_dims
            if quick:
                groups_dims = [(4, 128), (4, 256)] if (layout, kv) == ("compact", "auto") else [(4, 128)]
            tags = {**({"kv": kv} if kv != "auto" else {}), "layout": layout}
            out += [Case("decode", {"N": n, "G": g, "D": d, **tags},
                         lambda n=n, g=g, d=d, kv=kv, layout=layout: launch_decode(n, g, d, kv_cache_dtype=kv,
                                                                                   layout=layout))
                    for g, d in groups_dims for n in batch_sizes]  # fmt: skip
            out += [Case("prefill", {"C": c, "G": g, "D": d, **tags},
                         lambda c=c, g=g, d=d, kv=kv, layout=layout: launch_prefill(c, g, d, kv, layout))
                    for g, d in groups_dims for c in chunks]  # fmt: skip
            out += [Case("write", {"D": d, **tags}, lambda d=d, kv=kv, layout=layout: launch_write(d, kv, layout))
                    for d in write_dims]  # fmt: skip
    return out


def report_rows(case_list: list[Case], archs: tuple[int, ...]) -> list[dict]:
    """Compile every case for every arch; one row per (case, arch, kernel launched)."""
    kv_lines = kv_tile_lines()
    rows = []
    for arch in archs:
        native = NativeLaunches(arch, compile=True, kv_lines=kv_lines)
        with cpu_stand_ins(), native.intercept(ringkv_kernels()):
            for case in case_list:
                first = len(native.launched)
                case.launch()
                for kernel, key, grid in native.launched[first:]:
                    compiled = native.cache[(kernel, key)]
                    rows.append({"provider": "ringkv", "op": case.op, **case.shape, "grid": list(grid),
                                 **dataclasses.asdict(compiled)})  # fmt: skip
    return rows


def keys_over_batch(max_reqs: int, groups_dims: list[tuple[int, int]], arch: int = 90) -> dict[str, dict[str, int]]:
    """Distinct specialisations (= compiled kernels) per decode shape, layout and kernel over N = 1..max_reqs
    requests, each batch at another context length (positions must not specialise either)."""
    found: dict[str, dict[str, set[str]]] = {}
    native = NativeLaunches(arch, compile=False, kv_lines=None)
    with cpu_stand_ins(), native.intercept(ringkv_kernels()):
        for layout in LAYOUTS:
            for group, head_dim in groups_dims:
                first = len(native.launched)
                for num_reqs in range(1, max_reqs + 1):
                    launch_decode(num_reqs, group, head_dim, context=num_reqs * 1021 % CONTEXT, layout=layout)
                shape = f"G{group}-D{head_dim}" + ("" if layout == "compact" else f"-{layout}")
                per_kernel = found.setdefault(shape, {})
                for kernel, key, _ in native.launched[first:]:
                    per_kernel.setdefault(kernel, set()).add(key)
    return {shape: {kernel: len(keys) for kernel, keys in kernels.items()} for shape, kernels in found.items()}


def layout_specialisation(arch: int = 90) -> dict[str, dict[str, Any]]:
    """How the plugin's launch specialises against the compact layout's, at the DFlash2 decode shape (N 8) and a
    prefill chunk, for a table width that is a multiple of 16 (max_model_len 262,144) and one that is not (262,160):
    per kernel, whether it is the compact layout's compiled kernel, and the runtime arguments specialised otherwise
    (``[compact, plugin]``: type and ``D``, divisible by 16)."""
    native = NativeLaunches(arch, compile=False, kv_lines=None)
    launches = {
        "decode": lambda **kw: launch_decode(8, DFLASH2["G"], DFLASH2["D"], **kw),
        "prefill": lambda **kw: launch_prefill(8192, DFLASH2["G"], DFLASH2["D"], **kw),
    }
    out: dict[str, dict[str, Any]] = {}

    def keys(launch: Callable[..., None], **kwargs: Any) -> list[tuple[str, str]]:
        first = len(native.launched)
        launch(**kwargs)
        return [(kernel, key) for kernel, key, _ in native.launched[first:]]

    with cpu_stand_ins(), native.intercept(ringkv_kernels()):
        for op, launch in launches.items():
            compact = keys(launch)
            for width in (PLUGIN_TABLE_WIDTH, PLUGIN_TABLE_WIDTH + 1):
                plugin = keys(launch, layout="plugin", width=width)
                entry = out.setdefault(f"{op} width {width}", {})
                for (kernel, base), (_, key) in zip(compact, plugin, strict=True):
                    before, after = native.specialised[(kernel, base)], native.specialised[(kernel, key)]
                    entry[kernel] = {
                        "same_kernel": key == base,
                        "differs": {p: [before[p], after[p]] for p in before if before[p] != after[p]},
                    }
    return out


# ----------------------------------------------------------------------------------------------------------------
# vLLM's kernel_unified_attention, for comparison


def vllm_rows(source: Path, archs: tuple[int, ...], batch_sizes: tuple[int, ...]) -> list[dict]:
    """``unified_attention`` (its own launcher's choices) at the DFlash2 decode shape: 2D path, B = 8 queries per
    request, ``window_size=(W-1, W-1)`` (non-causal), a periodic block-table row as ``table_period=None``."""
    import torch

    from .vllm_unified import load_unified_attention

    unified = load_unified_attention(source)
    head_dim, group = 128, 4
    rows = []
    for arch in archs:
        native = NativeLaunches(arch, compile=True, kv_lines=None)
        with native.intercept([unified.kernel_unified_attention]):
            for num_reqs in batch_sizes:
                tokens = num_reqs * DRAFT_BLOCK
                q = torch.empty(tokens, NUM_KV_HEADS * group, head_dim, dtype=torch.bfloat16)
                caches = _caches(131, head_dim, torch.bfloat16)
                k_cache, v_cache = caches["k_cache"], caches["v_cache"]
                first = len(native.launched)
                unified.unified_attention(
                    q=q, k=k_cache, v=v_cache, out=torch.empty_like(q),
                    cu_seqlens_q=torch.arange(0, tokens + 1, DRAFT_BLOCK, dtype=torch.int32),
                    max_seqlen_q=DRAFT_BLOCK, seqused_k=torch.full((num_reqs,), CONTEXT + 8, dtype=torch.int32),
                    max_seqlen_k=CONTEXT + 8, softmax_scale=head_dim**-0.5, causal=False,
                    window_size=(WINDOW - 1, WINDOW - 1), block_table=torch.zeros(num_reqs, 16384, dtype=torch.int32),
                    softcap=0, q_descale=None, k_descale=None, v_descale=None,
                )  # fmt: skip
                for kernel, key, grid in native.launched[first:]:
                    rows.append({"provider": "vllm-triton", "op": "decode", "N": num_reqs, "G": group, "D": head_dim,
                                 "grid": list(grid), **dataclasses.asdict(native.cache[(kernel, key)])})  # fmt: skip
    return rows


# ----------------------------------------------------------------------------------------------------------------
# gates and the README table


def load_bits(op: str) -> int:
    """Width of a SASS global load: ``LDG.E.128`` 128, ``LDG.E.U16`` 16, plain ``LDG.E`` 32."""
    digits = re.sub(r"\D", "", op.split(".")[-1])
    return int(digits) if digits else 32


def widest_kv_load_bits(row: dict) -> int:
    """The widest K/V tile load a kernel can issue: 128 bits, unless the ring tile (``BLOCK_SIZE`` keys x D) is
    smaller than 16 bytes per thread: an fp8 tile of 16 x 64 is 1 KB, 64 bits for each of 4 warps' threads."""
    tile_bytes = BLOCK_SIZE * row["D"] * (1 if "kv" in row else 2)
    return min(128, 8 * tile_bytes // (32 * row["num_warps"]))


def gate_failures(rows: list[dict]) -> list[str]:
    """The CI gates: no spills anywhere; every K/V tile load as wide as the tile allows (128-bit but for fp8
    tiles under 16 bytes per thread, ``widest_kv_load_bits``); the DFlash2 decode shape <= 136 registers at 4
    warps (>= 3 CTAs per SM)."""
    failures = []
    for row in rows:
        if row["provider"] != "ringkv":
            continue
        shape = json.dumps({k: row[k] for k in ("N", "C", "G", "D", "kv", "layout") if k in row})
        name = f"{row['kernel']} {row['op']} {shape} sm_{row['arch']}"
        if row["spill_bytes"]:
            failures.append(f"{name}: {row['spill_bytes']} bytes of spills")
        kv = row["kv_loads"] or {}
        widest = widest_kv_load_bits(row)
        narrow = {op: n for op, n in kv.items() if load_bits(op) < widest}
        if narrow:
            failures.append(f"{name}: K/V tile loads narrower than {widest} bits {narrow}")
        if row["kernel"] == "_ring_attention_kernel" and not kv:
            failures.append(f"{name}: no K/V tile load found in the SASS line info")
        dflash2 = row["kernel"] == "_ring_attention_kernel" and all(row.get(k) == v for k, v in DFLASH2.items())
        if dflash2 and (row["num_warps"] != 4 or row["regs"] > DFLASH2_MAX_REGS or row["ctas_per_sm"] < 3):
            failures.append(f"{name}: {row['regs']} registers x {row['num_warps']} warps, "
                            f"{row['ctas_per_sm']} CTAs/SM (want <= {DFLASH2_MAX_REGS} x 4, >= 3)")  # fmt: skip
    return failures


def _loads_text(loads: dict[str, int] | None) -> str:
    if not loads:
        return "-"
    return ", ".join(f"{n}x {op.replace('.E.BYPASS', '').replace('.E', '')}" for op, n in sorted(loads.items()))


def markdown_table(rows: list[dict]) -> str:
    """One line per (provider, kernel, shape, layout) with sm_90 and sm_100 side by side; batch sizes that compiled
    to the same kernel are merged, and so are the layouts where they compiled to the same kernels
    (``compact = plugin``)."""
    merged: dict[tuple, dict] = {}
    for row in rows:
        size = "N" if "N" in row else "C" if "C" in row else None
        shape = tuple((k, row[k]) for k in ("G", "D", "kv") if k in row)
        ident = (row["provider"], row["op"], row["kernel"], shape, row.get("layout", "-"))
        entry = merged.setdefault(ident, {"sizes": set(), "arch": {}, "keys": set()})
        if size:
            entry["sizes"].add(f"{size}={row[size]}")
        entry["keys"].add((row["arch"], row["key"]))
        entry["arch"].setdefault(row["arch"], row)
    # per shape (first seen first): the compact layout's line, then the plugin's, or one line where both compiled to
    # the same kernels; vLLM's rows have no layout
    ordered: dict[tuple, dict] = {}
    for ident in dict.fromkeys(key[:-1] for key in merged):
        compact, plugin = merged.get((*ident, "compact")), merged.get((*ident, "plugin"))
        if compact and plugin and compact["keys"] == plugin["keys"]:
            ordered[(*ident, "compact = plugin")] = {**compact, "sizes": compact["sizes"] | plugin["sizes"]}
        else:
            ordered.update({key: entry for key, entry in merged.items() if key[:-1] == ident})
    lines = [
        "| provider | kernel | shape | layout | sizes (one kernel) | sm_90 regs / spill B / smem KB / CTAs per SM | "
        "sm_90 MMA | K/V tile loads (sm_90) | sm_100 regs / spill B / smem KB / CTAs per SM | sm_100 MMA |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]

    def res(row: dict | None) -> str:
        if row is None:
            return "-"
        return f"{row['regs']} / {row['spill_bytes']} / {row['smem_bytes'] / 1024:.0f} / {row['ctas_per_sm']}"

    for (provider, op, kernel, shape, layout), entry in ordered.items():
        kernels_per_arch = Counter(arch for arch, _ in entry["keys"])
        sizes = ", ".join(sorted(entry["sizes"], key=lambda s: int(s.split("=")[1])))
        if any(n > 1 for n in kernels_per_arch.values()):
            sizes += f" ({max(kernels_per_arch.values())} kernels)"
        sm90, sm100 = entry["arch"].get(90), entry["arch"].get(100)
        kv = _loads_text(sm90["kv_loads"]) if sm90 else "-"
        if sm90 and sm90["kv_loads"] is None:
            kv = "all global loads: " + _loads_text(sm90["loads"])
        name = f"{op} {kernel.strip('_')}"
        lines.append(
            f"| {provider} | {name} | {' '.join(v if k == 'kv' else f'{k}{v}' for k, v in shape) or '-'} | {layout} | "
            f"{sizes or '-'} | {res(sm90)} | "
            f"{sm90['mma'] if sm90 else '-'} | {kv} | {res(sm100)} | {sm100['mma'] if sm100 else '-'} |"
        )
    return "\n".join(lines)


def write_readme_section(body: str) -> None:
    text = README.read_text()
    start, end = text.index(BEGIN_MARK) + len(BEGIN_MARK), text.index(END_MARK)
    README.write_text(text[:start] + "\n" + body + "\n" + text[end:])


def compile_report(
    quick: Annotated[bool, typer.Option(help="the CI subset (no README update)")] = False,
    arch: Annotated[list[int] | None, typer.Option(help="compute capabilities to compile for")] = None,
    out: Annotated[Path, typer.Option(help="folder for compile_report.jsonl")] = RESULTS,
    readme: Annotated[bool, typer.Option(help="rewrite the table in bench/README.md (full sweep only)")] = True,
    vllm_source: Annotated[
        Path | None,
        typer.Option(help="site-packages of a vllm install, or a folder with its two Triton unified-attention files"),
    ] = None,
    keys_max_reqs: Annotated[int, typer.Option(help="count compiled decode kernels over N = 1..this (0: skip)")] = 0,
) -> None:
    """Compile the shipped kernels natively, write JSON rows and the README table, and check the gates."""
    os.environ.pop("TRITON_INTERPRET", None)  # compiled kernels, not the interpreter
    archs = tuple(arch or ARCHS)
    rows = report_rows(cases(quick), archs)
    if vllm_source is not None:
        try:
            rows += vllm_rows(vllm_source, archs, (8,) if quick else (1, 8, 256))
        except Exception as error:  # recorded, never fatal: the comparison is optional
            rows.append({"provider": "vllm-triton", "error": repr(error)[:500]})
    summary: dict[str, Any] = {
        "environment": environment(), "gate_failures": gate_failures(rows), "layouts": layout_specialisation(),
    }  # fmt: skip
    if keys_max_reqs:
        shapes = [(4, 128), (4, 256), (8, 128)] if quick else [(g, d) for g in (1, 4, 8) for d in (64, 128, 256)]
        summary["kernels_over_batch"] = {"max_reqs": keys_max_reqs, **keys_over_batch(keys_max_reqs, shapes)}
    out.mkdir(parents=True, exist_ok=True)
    with (out / "compile_report.jsonl").open("w") as handle:
        for row in rows:
            handle.write(json.dumps({**row, **summary["environment"]}) + "\n")
    (out / "compile_report_summary.json").write_text(json.dumps(summary, indent=1))
    table = markdown_table([row for row in rows if "error" not in row])
    typer.echo(table)
    for failure in summary["gate_failures"]:
        typer.echo(f"GATE FAILED: {failure}", err=True)
    if readme and not quick:
        write_readme_section(table)
    if summary["gate_failures"]:
        raise typer.Exit(1)
