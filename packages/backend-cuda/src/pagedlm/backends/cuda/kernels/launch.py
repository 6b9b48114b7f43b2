"""Every Triton launch of this package goes through :func:`launch`, so start-up can compile the
kernels in parallel instead of one at a time.

Triton compiles a kernel variant the first time it is launched, and a launch waits for its
compile; a model's first forward therefore compiles its kernels one after the other. On a
machine whose Triton cache is empty that took most of a cold start (11 of 21 s for Qwen3-0.6B on
an H200: about 14 variants at 0.5-1.5 s each). Inside :func:`compile_only`, a launch instead
hands its variant to a thread pool and returns without running anything (Triton's
``AsyncCompileMode``, whose compiler passes and ``ptxas`` run outside the GIL); the pool builds
the variant's launch stub too. Leaving the block waits for all of them. The runner does one such
pass over the shapes it will run before it runs them, so the start-up waits for the slowest
compile rather than their sum.

NOTE: inside :func:`compile_only` nothing is launched, so every output of a Triton op is
uninitialised memory. A forward run there is for its launches only: its results must not be
used, and nothing in it may index memory with them.

Programmatic dependent launch (PDL, Hopper and later): a decode step at batch 1 is a chain of
~11 short kernels a layer, each launched only when the one before it has finished. With
:func:`pdl_options` a kernel is launched so that it may start while its predecessor still runs
(``launch_pdl``, a dependency edge of the CUDA graph too); it then calls :func:`pdl_wait` before
it touches memory the predecessor may write, so results are those of the serial order. Only
constant inputs (the weights) may be read before that call.
"""

from __future__ import annotations

import functools
import os
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

import triton
import triton.language as tl
from triton.runtime import driver

from pagedlm.core.utils.cores import usable_cores

__all__ = ["compile_only", "launch", "pdl_enabled", "pdl_options", "pdl_wait", "prefetch_rows_l2"]

_COMPILE_ONLY: ContextVar[bool] = ContextVar("pagedlm_triton_compile_only", default=False)


def launch(kernel: Any, grid: tuple[int, ...], *args: Any, **kwargs: Any) -> None:
    """``kernel[grid](*args, **kwargs)``; inside :func:`compile_only`, only queue its compile."""
    if _COMPILE_ONLY.get():
        kernel.warmup(*args, grid=grid, **kwargs)
    else:
        kernel[grid](*args, **kwargs)


@functools.cache
def pdl_enabled(device_index: int) -> bool:
    """Whether kernels on CUDA device ``device_index`` launch with PDL: compute capability 9.0 or
    later, and ``PAGEDLM_CUDA_PDL`` not ``0`` (default ``1``; any other value is an error)."""
    value = os.environ.get("PAGEDLM_CUDA_PDL", "1")
    if value not in ("0", "1"):
        raise ValueError(f"PAGEDLM_CUDA_PDL={value!r}: allowed values are 0 (serial launches) and 1 (PDL)")
    if value == "0" or os.environ.get("TRITON_INTERPRET") == "1":
        return False
    import torch

    return torch.cuda.get_device_capability(device_index)[0] >= 9


def pdl_options(device: Any) -> dict[str, bool]:
    """Launch keywords for a kernel written with :func:`pdl_wait`: its ``USE_PDL`` constexpr and,
    where :func:`pdl_enabled`, Triton's ``launch_pdl`` option."""
    if getattr(device, "type", None) != "cuda":
        return {"USE_PDL": False}
    index = device.index if device.index is not None else _current_device()
    if not pdl_enabled(index):
        return {"USE_PDL": False}
    return {"USE_PDL": True, "launch_pdl": True}


def _current_device() -> int:
    import torch

    return torch.cuda.current_device()


@triton.jit
def pdl_wait(USE_PDL: tl.constexpr):
    """Wait for the previous kernel of the stream to finish (its writes visible), then let the
    next kernel start launching.

    NOTE: every program of a PDL kernel calls this before its first access to memory a previous
    kernel may write (inputs, and outputs: the allocator may hand out a buffer an earlier kernel
    still reads), and before it exits. A kernel whose programs all returned without waiting
    could count as finished while its own predecessor still runs, and the next one would wait
    on it for nothing."""
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def prefetch_rows_l2(ptr, row0, last_row, stride, col, nbytes, ROWS: tl.constexpr, THREADS: tl.constexpr):
    """Ask L2 for ``nbytes`` of each row ``row0 .. min(row0 + ROWS - 1, last_row)`` of the
    row-major matrix at ``ptr`` (``stride`` elements a row) from element ``col`` (Hopper's bulk
    prefetch, one instruction a row; nothing waits for it).

    A kernel calls it before :func:`pdl_wait` for weights (constant through a forward), so they
    stream into L2 while the previous kernel finishes. ``THREADS`` is the program's thread count,
    so each thread holds one element of the index vector and no row is asked for twice (rows
    past ``THREADS`` are not asked for). ``nbytes`` must be a multiple of 16 and the rows'
    addresses 16-byte aligned (the launchers check)."""
    t = tl.arange(0, THREADS)
    row = tl.minimum(row0 + t, last_row).to(tl.int64)
    addr = ptr + row * stride + col
    size = tl.where((t < ROWS) & (row0 + t <= last_row), nbytes, 0)
    tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.ne.s32 p, $2, 0; @p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
        "=r,l,r", [addr, size], dtype=tl.int32, is_pure=False, pack=1,
    )


class _CompilePool(ThreadPoolExecutor):
    """Also builds each compiled variant's launch stub: a small C module that Triton otherwise
    builds with the system's C compiler at the variant's first launch (0.1-0.4 s each, one after
    the other; a stub needs no device, and Triton keeps it on disk, so the launch finds it)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.compiled: list[Any] = []

    def submit(self, fn, /, *args, **kwargs):  # type: ignore[override]
        def compile_and_build_launcher():
            kernel = fn(*args, **kwargs)
            driver.active.launcher_cls(kernel.src, kernel.metadata)
            self.compiled.append(kernel)
            return kernel

        return super().submit(compile_and_build_launcher)


def _leave_async_compile(mode: Any) -> None:
    """Make sure ``mode`` is no longer Triton's active compile mode. NOTE: Triton 3.6 leaves it
    active when a compile in the block failed, and every later :func:`compile_only` of the
    process (the next ``LLM(...)``) then failed with "Another AsyncCompileMode is already active"
    (seen on an H200, 2026-12-04)."""
    from triton.runtime import _async_compile

    if _async_compile.active_mode.get() is mode:
        _async_compile.active_mode.set(None)


class CompileStats:
    """What a :func:`compile_only` block did: ``num_variants`` compiled or loaded from Triton's
    disk cache (variants already in memory are not counted), in ``seconds`` of wall time."""

    def __init__(self) -> None:
        self.num_variants = 0
        self.seconds = 0.0


@contextmanager
def compile_only(max_workers: int | None = None) -> Iterator[CompileStats]:
    """Within the block, :func:`launch` queues compiles on ``max_workers`` threads (default: the
    cores this process may use, at most 16) instead of launching; on leaving, waits for them all
    (and raises the first compile error)."""
    if max_workers is None:
        max_workers = max(1, min(16, usable_cores()))
    stats = CompileStats()
    start = time.perf_counter()
    with _CompilePool(max_workers, thread_name_prefix="triton-compile") as pool:
        mode = triton.AsyncCompileMode(pool)
        try:
            with mode:
                token = _COMPILE_ONLY.set(True)
                try:
                    yield stats
                finally:
                    _COMPILE_ONLY.reset(token)
                    stats.num_variants = len(mode.raw_futures)
        finally:
            _leave_async_compile(mode)
    # each variant's module is loaded onto the device here, in the start-up's compile pass,
    # rather than at its first launch
    for kernel in pool.compiled:
        init = getattr(kernel, "_init_handles", None)
        if init is not None:
            init()
    stats.seconds = time.perf_counter() - start
