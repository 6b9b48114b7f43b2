"""CPU graphs: a forward pass recorded once and replayed without its Python.

A decode step of a small model on the CPU spends as long in Python (module calls, op wrappers,
tensor allocation: ~25 calls a layer, 10-30 us each) as in its kernels. :class:`CpuGraph`
records, while one forward runs, every C kernel call (through :func:`launch`, which every
wrapper in this package calls its kernels with) and every aten op (through a
``TorchDispatchMode``), keeping each op's output tensor alive. :meth:`CpuGraph.replay` then runs
the same calls on the same buffers: the C kernels on the pointers they were given, the aten ops
into the tensors they returned (their ``out=`` overload where it exists).

The caller keeps the inputs in tensors it refills in place before each replay, as with CUDA
graphs. NOTE: what is not an op is not recorded. A value the forward read on the host (a shape,
``.item()``, a Python attribute) is baked into the graph; a capture fails on an op that returns
a scalar to Python, and the runner checks a replay against an eager forward before trusting it
(``pagedlm.backends.cpu.model_runner``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["CaptureError", "CpuGraph", "launch"]

#: the graph being captured on this process, if any (the engine core steps on one thread)
_capturing: CpuGraph | None = None

_ALLOCATIONS = frozenset(
    op for op in (
        getattr(torch.ops.aten.empty, "memory_format", None), torch.ops.aten.empty_like.default,
        torch.ops.aten.new_empty.default, torch.ops.aten.empty_strided.default,
        torch.ops.aten.new_empty_strided.default,
    ) if op is not None
)


class CaptureError(RuntimeError):
    """The forward did something a replay could not repeat (the runner then stays eager)."""


def launch(kernel: Callable[..., int], *args: Any) -> int:
    """``kernel(*args)``, recorded into the graph being captured (every C kernel call of the
    CPU backend goes through here). ``args`` are what ctypes passes: pointers and scalars."""
    rc = kernel(*args)
    if _capturing is not None:
        _capturing._calls.append(functools.partial(_checked, kernel, args, rc))
    return rc


def _checked(kernel: Callable[..., int], args: tuple, expected: int) -> None:
    rc = kernel(*args)
    if rc != expected:
        raise RuntimeError(f"a CPU graph's kernel {getattr(kernel, '__name__', kernel)} returned {rc} on replay "
                           f"(it returned {expected} when captured)")


class CpuGraph:
    """One recorded forward. ``capture(fn)`` runs ``fn()``; its result (a tensor or a tuple of
    tensors) is the graph's output, refilled by every ``replay()``."""

    def __init__(self) -> None:
        self._calls: list[Callable[[], Any]] = []
        self._keep: list[Any] = []  # every tensor a recorded call reads or writes
        self.output: Any = None

    def capture(self, fn: Callable[[], Any]) -> Any:
        global _capturing
        if _capturing is not None:
            raise CaptureError("a CPU graph is already being captured")
        _capturing = self
        try:
            with _AtenRecorder(self):
                out = fn()
        except BaseException:
            self._calls.clear()
            self._keep.clear()
            raise
        finally:
            _capturing = None
        outs = out if isinstance(out, tuple) else (out,)
        if not all(isinstance(o, torch.Tensor) for o in outs):
            raise CaptureError(f"a CPU graph's forward must return tensors, not {type(out).__name__}")
        self.output = out
        return out

    @property
    def num_calls(self) -> int:
        return len(self._calls)

    def replay(self) -> Any:
        assert self.output is not None, "replay before capture"
        for call in self._calls:
            call()
        return self.output

    def _record_aten(self, func: torch._ops.OpOverload, args: tuple, kwargs: dict, out: Any) -> None:
        self._keep.append((args, kwargs, out))
        if func in _ALLOCATIONS or func.is_view:
            return  # the buffer (or the alias) stays; nothing to recompute
        outs = out if isinstance(out, (tuple, list)) else (out,)
        if not all(isinstance(o, torch.Tensor) for o in outs):
            raise CaptureError(f"{func} returned {type(out).__name__} to Python during a CPU graph capture "
                               "(a value read on the host would be baked into the graph)")
        if any(a.is_write for a in func._schema.arguments):
            self._calls.append(functools.partial(func, *args, **kwargs))  # in place or out=: as it was
            return
        out_variant = _out_variant(func) if isinstance(out, torch.Tensor) else None
        if out_variant is not None:
            self._calls.append(functools.partial(out_variant, *args, **kwargs, out=out))
            return
        self._calls.append(functools.partial(_copy_into, func, args, kwargs, outs))


@functools.cache
def _out_variant(func: torch._ops.OpOverload) -> torch._ops.OpOverload | None:
    """The ``out=`` overload taking exactly ``func``'s arguments (``mul.Tensor`` -> ``mul.out``), or None."""
    want = [(a.name, str(a.type)) for a in func._schema.arguments]
    for name in func.overloadpacket.overloads():
        candidate = getattr(func.overloadpacket, name)
        args = candidate._schema.arguments
        outs, ins = [a.name for a in args if a.is_out], [(a.name, str(a.type)) for a in args if not a.is_out]
        if outs == ["out"] and ins == want:
            return candidate
    return None


def _copy_into(func: Callable[..., Any], args: tuple, kwargs: dict, outs: tuple[torch.Tensor, ...]) -> None:
    fresh = func(*args, **kwargs)
    for dst, src in zip(outs, fresh if isinstance(fresh, (tuple, list)) else (fresh,), strict=True):
        dst.copy_(src)


class _AtenRecorder(TorchDispatchMode):
    def __init__(self, graph: CpuGraph) -> None:
        super().__init__()
        self.graph = graph

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self.graph._record_aten(func, args, kwargs, out)
        return out
