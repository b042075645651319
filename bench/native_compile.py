# SPDX-License-Identifier: Apache-2.0
"""Native compilation on a CPU machine, through the JIT's own specialisation: a launch of a ``@triton.jit`` kernel
is intercepted, its arguments are bound by Triton's binder for the target (``create_function_from_signature`` over
``native_specialize_impl``: ``tt.divisibility=16`` on pointers and ints divisible by 16, 1-valued ints as
constants, ``do_not_specialize`` honoured), then ``triton.compile`` builds the cubin with the ``ptxas`` of the
Triton wheel. A bare ``ASTSource`` without that specialisation compiles a different kernel: no
``tt.divisibility`` hints, so 2-byte K/V loads.

The wheel's ``cuobjdump --dump-resource-usage`` gives REG / STACK (local-memory spill bytes) / SHARED;
``nvdisasm --print-line-info`` attributes every global load to its source line. Nothing here knows ringkv's
kernels: ``compile_launches.py`` says what is launched.
"""

from __future__ import annotations

import contextlib
import hashlib
import inspect
import re
import subprocess
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from unittest import mock

ARCHS = (90, 100)


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


def source_lines(function: Any) -> tuple[tuple[str, ...], range]:
    """Source file (its last two path parts: Triton's cache may hold a cubin compiled from another checkout of
    the same source) and lines of a ``@triton.jit`` function, to find its loads in the SASS line info."""
    lines, first = inspect.getsourcelines(function.fn)
    return Path(inspect.getsourcefile(function.fn)).parts[-2:], range(first, first + len(lines))


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
    the specialisation key (``compile=False``) or compile and measure it (``compile=True``, memoised per key).
    ``kv_lines`` (``source_lines``): the K/V tile loads, counted apart by width."""

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
