"""CUDA C++ kernels compiled at run time with NVRTC and launched through the driver API (ctypes).

For the few kernels Triton cannot express well (e.g. ``kernels/w4a16_mma.py``: tensor-core
fragments built from packed int4 in registers). NVRTC ships with torch's CUDA wheels
(``nvidia-cuda-nvrtc``), so nothing else is installed; sources include no headers (inline PTX for
what the CUDA headers would give), so no CUDA toolkit is needed either.

- :func:`nvrtc_library` finds ``libnvrtc`` (the soname torch has loaded, else the pip package's).
- :func:`compile_cubin` compiles a source to a CUBIN for one ``sm_XX`` (usable on a machine without
  a GPU: the compile-only tests run it on the CPU runner when the library is installed).
- :class:`Kernel` loads a CUBIN into a device's context once and launches it on torch's current
  stream, which a CUDA-graph capture records like any other launch.
"""

from __future__ import annotations

import ctypes
import glob
import os
import sys
from functools import cache
from typing import Any

import torch

__all__ = ["Kernel", "NvrtcUnavailable", "compile_cubin", "nvrtc_library"]


class NvrtcUnavailable(RuntimeError):
    """NVRTC could not be loaded in this process."""


@cache
def nvrtc_library() -> ctypes.CDLL:
    """The NVRTC shared library; :class:`NvrtcUnavailable` when there is none."""
    names = []
    if torch.version.cuda:
        names.append(f"libnvrtc.so.{torch.version.cuda.split('.')[0]}")
    names += ["libnvrtc.so.13", "libnvrtc.so.12", "libnvrtc.so"]
    # pip's nvidia-cuda-nvrtc(-cuXX) wheels, where torch has not loaded it yet
    for site in sys.path:
        names += sorted(glob.glob(os.path.join(site, "nvidia", "*", "lib", "libnvrtc.so.*[0-9]")))
    for name in names:
        try:
            return ctypes.CDLL(name)
        except OSError:
            continue
    raise NvrtcUnavailable("libnvrtc was not found (it comes with torch's CUDA wheels as nvidia-cuda-nvrtc)")


def _check_nvrtc(lib: ctypes.CDLL, code: int, what: str) -> None:
    if code:
        lib.nvrtcGetErrorString.restype = ctypes.c_char_p
        raise RuntimeError(f"NVRTC {what} failed: {lib.nvrtcGetErrorString(code).decode()}")


def compile_cubin(source: str, name: str, arch: int, defines: dict[str, int] | None = None) -> bytes:
    """Compile ``source`` for ``sm_{arch}`` (e.g. 90) with ``-D`` ``defines``; the CUBIN's bytes.
    A compile error raises ``RuntimeError`` with NVRTC's log."""
    lib = nvrtc_library()
    prog = ctypes.c_void_p()
    _check_nvrtc(lib, lib.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), f"{name}.cu".encode(),
                                             0, None, None), "nvrtcCreateProgram")
    try:
        opts = [f"--gpu-architecture=sm_{arch}", "--std=c++17"]
        opts += [f"-D{k}={int(v)}" for k, v in (defines or {}).items()]
        arr = (ctypes.c_char_p * len(opts))(*[o.encode() for o in opts])
        code = lib.nvrtcCompileProgram(prog, len(opts), arr)
        if code:
            size = ctypes.c_size_t()
            lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
            log = ctypes.create_string_buffer(size.value)
            lib.nvrtcGetProgramLog(prog, log)
            raise RuntimeError(f"NVRTC could not compile {name} ({defines}):\n{log.value.decode(errors='replace')}")
        size = ctypes.c_size_t()
        _check_nvrtc(lib, lib.nvrtcGetCUBINSize(prog, ctypes.byref(size)), "nvrtcGetCUBINSize")
        cubin = ctypes.create_string_buffer(size.value)
        _check_nvrtc(lib, lib.nvrtcGetCUBIN(prog, cubin), "nvrtcGetCUBIN")
        return cubin.raw
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(prog))


@cache
def _libcuda() -> ctypes.CDLL:
    return ctypes.CDLL("libcuda.so.1")


def _check_cu(code: int, what: str) -> None:
    if code:
        msg = ctypes.c_char_p()
        _libcuda().cuGetErrorString(code, ctypes.byref(msg))
        raise RuntimeError(f"{what} failed: CUDA error {code} ({(msg.value or b'?').decode()})")


class _LaunchAttribute(ctypes.Structure):
    # CUlaunchAttribute: an id, padding to 8 bytes, a 64-byte value union (an int for ours)
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", ctypes.c_int),
                ("value_pad", ctypes.c_char * 60)]


class _LaunchConfig(ctypes.Structure):
    # CUlaunchConfig
    _fields_ = [("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3), ("shared_mem", ctypes.c_uint),
                ("stream", ctypes.c_void_p), ("attrs", ctypes.POINTER(_LaunchAttribute)),
                ("num_attrs", ctypes.c_uint)]


_PROGRAMMATIC_STREAM_SERIALIZATION = 6  # CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION


class Kernel:
    """An ``extern "C"`` kernel of a CUBIN, loaded into ``device``'s (primary) context.

    NOTE: one instance per device: a loaded module belongs to the context it was loaded in.
    """

    def __init__(self, cubin: bytes, name: str, device: torch.device) -> None:
        self.name = name
        self.device = device
        # NOTE: the module load is not a stream operation, but a CUDA-graph capture in torch's
        # global mode may still refuse it: kernels are built before capturing (at weight loading)
        torch.cuda.init()
        with torch.cuda.device(device):  # cudaSetDevice makes the device's primary context current
            self._module = ctypes.c_void_p()
            _check_cu(_libcuda().cuModuleLoadData(ctypes.byref(self._module), cubin), f"loading {name}")
            self._func = ctypes.c_void_p()
            _check_cu(_libcuda().cuModuleGetFunction(ctypes.byref(self._func), self._module, name.encode()),
                      f"finding {name}")

    def prefer_shared_memory(self) -> None:
        """Ask for the largest shared-memory carveout of L1 (more resident blocks for kernels
        that stage their loads there)."""
        carveout_attribute = 9  # CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT
        _check_cu(_libcuda().cuFuncSetAttribute(self._func, carveout_attribute, 100), f"configuring {self.name}")

    def __call__(self, grid: tuple[int, int, int], block: int, *args: Any, pdl: bool = False) -> None:
        """Launch on torch's current stream of the kernel's device. ``args``: tensors (passed as
        their data pointers), ``None`` (a null pointer) and Python ints (C ``int``). ``pdl``: a
        programmatic dependent launch (the kernel may start before its predecessor ends, and
        must execute ``griddepcontrol.wait`` before reading what that one writes; see
        ``kernels/launch.py``)."""
        held = []
        for a in args:
            if isinstance(a, torch.Tensor):
                held.append(ctypes.c_void_p(a.data_ptr()))
            elif a is None:
                held.append(ctypes.c_void_p(0))
            else:
                held.append(ctypes.c_int(a))
        params = (ctypes.c_void_p * len(held))(*[ctypes.cast(ctypes.byref(h), ctypes.c_void_p) for h in held])
        stream = ctypes.c_void_p(torch.cuda.current_stream(self.device).cuda_stream)
        if not pdl:
            _check_cu(_libcuda().cuLaunchKernel(self._func, grid[0], grid[1], grid[2], block, 1, 1, 0, stream,
                                                params, None), f"launching {self.name}")
            return
        attr = _LaunchAttribute(id=_PROGRAMMATIC_STREAM_SERIALIZATION, value=1)
        config = _LaunchConfig(grid=(ctypes.c_uint * 3)(*grid), block=(ctypes.c_uint * 3)(block, 1, 1),
                               shared_mem=0, stream=stream, attrs=ctypes.pointer(attr), num_attrs=1)
        _check_cu(_libcuda().cuLaunchKernelEx(ctypes.byref(config), self._func, params, None),
                  f"launching {self.name}")
