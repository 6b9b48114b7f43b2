"""The CPU platform's GGUF ops (``gguf_mul_mat``, ``gguf_get_rows``): C kernels built at first use.

``gguf_kernels.c`` (and ``gguf_q8_act.c`` / ``gguf_amx.c``, the opt-in int8-activation path)
is compiled with the system C compiler (``$CC``, else ``gcc``/``cc``) the first time a GGUF layer
runs, into ``$PAGEDLM_CACHE_ROOT/cpu_kernels/gguf_<hash>.so``; the hash covers the sources, the
compiler flags and the compiler's version, so an edit or another CPU's flags build a new
file. The build writes a temporary file and renames it into place, so parallel processes (pytest
workers) never load a half-written library. The library is loaded with ctypes (which releases the
GIL during the call) and called on the tensors' ``data_ptr()``.

Flags: ``-mavx2 -mfma -mf16c`` when the CPU has them, plus ``-mavx512f`` where it has AVX-512F
(512-bit batch tiles and Q8_0 decode; else the portable scalar code), ``-fopenmp``
for threads (the loaded libgomp is torch's; see the C file), ``-ffp-contract=off`` (the decode
rounds like the torch reference). The thread count is torch's (``torch.get_num_threads()``).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from pagedlm.backends.cpu.kernels.graph import launch
from pagedlm.backends.cpu.platform import gguf_int8_activations
from pagedlm.core import envs
from pagedlm.core.logger import init_logger

logger = init_logger(__name__)

__all__ = ["gguf_get_rows", "gguf_mul_mat", "kernel_library"]

_SOURCES = tuple(Path(__file__).with_name(f)
                 for f in ("gguf_kernels.c", "gguf_batch.c", "gguf_q8_act.c", "gguf_amx.c", "gguf_vnni.c",
                           "attention_decode.c", "norm_rope.c"))
#: what the build reads: the sources and the header they share (all of it goes into the hash)
_BUILD_INPUTS = (*_SOURCES, Path(__file__).with_name("gguf_common.h"))
#: the ggml types of the int8-activation path: Q8_0, Q4_K, Q6_K
_INT8_ACT_TYPES = frozenset({8, 12, 14})
_BASE_FLAGS = ("-O3", "-shared", "-fPIC", "-fopenmp", "-ffp-contract=off", "-std=gnu11")


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


#: the builds, best first: name -> (the CPU flags it needs, the compiler flags it adds)
BUILDS = {
    "avx512": ({"avx2", "fma", "f16c", "avx512f"}, ("-mavx2", "-mfma", "-mf16c", "-mavx512f")),
    "avx2": ({"avx2", "fma", "f16c"}, ("-mavx2", "-mfma", "-mf16c")),
    "scalar": (set(), ()),
}


@functools.cache
def available_builds() -> tuple[str, ...]:
    """The builds this CPU runs, best first (``"scalar"`` always)."""
    have = _cpu_flags()
    return tuple(name for name, (needs, _) in BUILDS.items() if needs <= have)


def _compiler() -> str:
    for name in (os.environ.get("CC"), "gcc", "cc"):
        if name and shutil.which(name):
            return name
    raise RuntimeError("the CPU GGUF kernels need a C compiler (gcc or cc on PATH, or $CC); none was found")


def _build(path: Path, cc: str, flags: tuple[str, ...]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=path.parent)
    os.close(fd)
    try:
        cmd = [cc, *flags, *map(str, _SOURCES), "-o", tmp, "-lm"]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"building the CPU GGUF kernels failed ({' '.join(cmd)}):\n{proc.stderr[-4000:]}")
        os.replace(tmp, path)  # atomic: a concurrent builder's identical file is replaced whole
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def kernel_library() -> ctypes.CDLL:
    """The compiled kernels for this CPU (built now if this source/flags/compiler has no cached build)."""
    return _library(available_builds()[0])


@functools.cache
def _library(build: str) -> ctypes.CDLL:
    """One of ``BUILDS`` (only those in ``available_builds()`` run here; tests compare them)."""
    cc = _compiler()
    flags = (*_BASE_FLAGS, *BUILDS[build][1])
    version = subprocess.run([cc, "--version"], capture_output=True, text=True).stdout
    text = "\0".join((*(f.read_text() for f in _BUILD_INPUTS), *flags, version))
    key = hashlib.sha256(text.encode()).hexdigest()[:16]
    path = Path(envs.cache_root()) / "cpu_kernels" / f"gguf_{key}.so"
    if not path.exists():
        logger.info("building the CPU GGUF kernels (%s) into %s", build, path)
        _build(path, cc, flags)
    lib = ctypes.CDLL(str(path))
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.pagedlm_gguf_mul_mat.argtypes = [ctypes.c_int, ptr, i64, i64, ptr, i64, ptr, i64, ctypes.c_int]
    lib.pagedlm_gguf_mul_mat.restype = ctypes.c_int
    lib.pagedlm_gguf_get_rows.argtypes = [ctypes.c_int, ptr, i64, i64, ptr, i64, ptr, ctypes.c_int]
    lib.pagedlm_gguf_get_rows.restype = ctypes.c_int
    lib.pagedlm_gguf_supports.argtypes = [ctypes.c_int]
    lib.pagedlm_gguf_mul_mat_q8_act.argtypes = [ctypes.c_int, ptr, i64, i64, ptr, i64, ptr, i64, ctypes.c_int]
    lib.pagedlm_gguf_mul_mat_q8_act.restype = ctypes.c_int
    lib.pagedlm_gguf_mul_mat_amx.argtypes = [ctypes.c_int, ptr, i64, i64, ptr, i64, ptr, i64, ctypes.c_int]
    lib.pagedlm_gguf_mul_mat_amx.restype = ctypes.c_int
    lib.pagedlm_gguf_amx_init.restype = ctypes.c_int
    lib.pagedlm_gguf_mul_mat_vnni.argtypes = [ctypes.c_int, ptr, i64, i64, ptr, i64, ptr, i64, ctypes.c_int]
    lib.pagedlm_gguf_mul_mat_vnni.restype = ctypes.c_int
    lib.pagedlm_gguf_vnni_compiled.restype = ctypes.c_int
    return lib


@functools.cache
def amx_available() -> bool:
    """Whether the int8-activation path may run on AMX tiles here: the CPU lists AMX-INT8 (and the
    AVX-512 the kernel's bookkeeping uses) and the kernel grants the process the tile state."""
    if not {"amx_tile", "amx_int8", "avx512f", "avx512bw", "avx512vl", "f16c", "fma"} <= _cpu_flags():
        return False
    return kernel_library().pagedlm_gguf_amx_init() == 0


@functools.cache
def vnni_available() -> bool:
    """Whether decode rows of the int8-activation path run on AVX-512 VNNI (``gguf_vnni.c``): the
    CPU lists it (with the AVX-512 BW/VL it uses) and the compiler built it."""
    if not {"avx512f", "avx512bw", "avx512vl", "avx512_vnni", "f16c", "fma"} <= _cpu_flags():
        return False
    return kernel_library().pagedlm_gguf_vnni_compiled() == 1


def supported_types() -> frozenset[int]:
    """ggml type ids these kernels compute on (the others dequantize at load)."""
    return frozenset({2, 3, 6, 7, 8, 12, 13, 14})


def gguf_mul_mat(x: torch.Tensor, qweight: torch.Tensor, qtype: int, out_features: int,
                 int8_activations: bool | None = None) -> torch.Tensor:
    """The ``gguf_mul_mat`` op (contract in pagedlm.core.layers.custom_ops). ``int8_activations``
    (None: ``PAGEDLM_CPU_GGUF_INT8_ACTIVATIONS``) sends Q8_0, Q4_K and Q6_K weights through
    activations rounded to int8 per 32 values and integer dot products: for 1-4 rows ``gguf_vnni.c``
    where the CPU has AVX-512 VNNI, else ``gguf_q8_act.c``; ``gguf_amx.c`` (AMX tiles) for more
    where the CPU has AMX-INT8 (else the exact path)."""
    m, k = x.shape
    xf = x.contiguous() if x.dtype == torch.float32 else x.to(torch.float32).contiguous()
    if not qweight.is_contiguous():
        raise ValueError("gguf_mul_mat: qweight must be contiguous")
    out = torch.empty(m, out_features, dtype=torch.float32)
    if int8_activations is None:
        int8_activations = gguf_int8_activations()
    lib = kernel_library()
    if int8_activations and qtype in _INT8_ACT_TYPES and m > 4 and amx_available():
        kernel = lib.pagedlm_gguf_mul_mat_amx
    elif int8_activations and qtype in _INT8_ACT_TYPES and 1 <= m <= 4:
        kernel = lib.pagedlm_gguf_mul_mat_vnni if vnni_available() else lib.pagedlm_gguf_mul_mat_q8_act
    else:
        kernel = lib.pagedlm_gguf_mul_mat
    rc = launch(kernel, qtype, qweight.data_ptr(), out_features, k, xf.data_ptr(), m, out.data_ptr(), out_features,
                torch.get_num_threads())
    if rc:
        raise ValueError(f"gguf_mul_mat: ggml type {qtype} with K={k} is not supported by the CPU kernels (rc={rc})")
    return out if x.dtype == torch.float32 else out.to(x.dtype)


def gguf_get_rows(qweight: torch.Tensor, qtype: int, ids: torch.Tensor, embedding_dim: int) -> torch.Tensor:
    """The ``gguf_get_rows`` op (contract in pagedlm.core.layers.custom_ops)."""
    idx = ids.reshape(-1).to(torch.int64).contiguous()
    out = torch.empty(idx.numel(), embedding_dim, dtype=torch.float32)
    rc = launch(kernel_library().pagedlm_gguf_get_rows, qtype, qweight.data_ptr(), qweight.shape[0], embedding_dim,
                idx.data_ptr(), idx.numel(), out.data_ptr(), torch.get_num_threads())
    if rc == -3:
        raise ValueError(f"gguf_get_rows: a token id is outside [0, {qweight.shape[0]})")
    if rc:
        raise ValueError(f"gguf_get_rows: ggml type {qtype} with {embedding_dim} values per row is not supported")
    return out.reshape(*ids.shape, embedding_dim)
