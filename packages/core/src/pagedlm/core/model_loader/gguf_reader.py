"""Reading the header of a GGUF file: metadata key/values and the tensor directory.

The type constants (value types, ggml tensor types, block sizes) come from the ``gguf`` package.
The header itself is walked here with ``struct`` over a memory map instead of with
``gguf.GGUFReader``: that reader builds a numpy view for every part of every field, which for the
262,144-token vocabulary of Gemma 3 takes ~17 s on a laptop-class CPU, against ~0.3 s here. Tests
cross-check this reader against ``gguf.GGUFReader`` on small files.

Layout (GGUF v2/v3, little-endian): magic ``GGUF``, ``u32`` version, ``u64`` tensor count, ``u64``
key/value count, the key/values, the tensor infos (name, ``u32`` n_dims, ``u64`` dims innermost
first, ``u32`` ggml type, ``u64`` offset into the data section), then the data section, which
starts at the next multiple of ``general.alignment`` (default 32).

Every read is bounds-checked, so a truncated or corrupt file raises one ``ValueError`` naming the
file and what was wrong instead of an ``IndexError`` from deep inside.
"""

from __future__ import annotations

import mmap
import os
import struct
from dataclasses import dataclass, field
from typing import Any

import numpy as np

__all__ = ["GGUFFile", "GGUFTensorInfo", "import_gguf", "read_gguf"]

_MAGIC = b"GGUF"
#: value type id -> (struct format, numpy dtype) of the fixed-size GGUF value types
_SCALARS: dict[int, tuple[str, str]] = {
    0: ("<B", "<u1"), 1: ("<b", "<i1"), 2: ("<H", "<u2"), 3: ("<h", "<i2"), 4: ("<I", "<u4"),
    5: ("<i", "<i4"), 6: ("<f", "<f4"), 7: ("<?", "<u1"), 10: ("<Q", "<u8"), 11: ("<q", "<i8"),
    12: ("<d", "<f8"),
}
_STRING, _ARRAY, _BOOL = 8, 9, 7
#: ggml keeps at most four dimensions per tensor
_MAX_DIMS = 4


@dataclass(frozen=True)
class GGUFTensorInfo:
    """One entry of the tensor directory.

    ``shape`` is in torch/numpy order (outermost first): a GGUF matrix with dims ``[in, out]``
    (innermost first) has ``shape == (out, in)``, matching ``nn.Linear.weight``. Blocks of a
    quantized type run along the last (innermost) dimension.
    """

    name: str
    ggml_type: int
    shape: tuple[int, ...]
    #: absolute byte offset of the data in the file
    offset: int
    nbytes: int

    @property
    def type_name(self) -> str:
        return ggml_type_name(self.ggml_type)

    @property
    def numel(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))


@dataclass
class GGUFFile:
    """A parsed GGUF header plus a copy-on-write memory map of the whole file.

    ``metadata`` maps keys to Python scalars, strings, lists of strings, or numpy arrays (numeric
    arrays). Use as a context manager, or call :meth:`close`, to release the map.
    """

    path: str
    version: int
    metadata: dict[str, Any]
    tensors: list[GGUFTensorInfo]
    alignment: int
    _map: mmap.mmap | None = field(default=None, repr=False)

    def tensor_bytes(self, info: GGUFTensorInfo) -> np.ndarray:
        """``[nbytes]`` uint8 view of a tensor's data (writable copy-on-write memory, no copy)."""
        if self._map is None:
            raise ValueError(f"{self.path} is closed")
        return np.frombuffer(self._map, dtype=np.uint8, count=info.nbytes, offset=info.offset)

    def get(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(key, default)

    @property
    def architecture(self) -> str:
        arch = self.metadata.get("general.architecture")
        if not isinstance(arch, str):
            raise ValueError(f"{self.path}: GGUF metadata has no general.architecture")
        return arch

    def close(self) -> None:
        if self._map is not None:
            try:
                self._map.close()
            except BufferError:
                # A tensor view is still alive (e.g. in the traceback of an error being raised);
                # the map is released with the last view instead of masking that error.
                pass
            self._map = None

    def __enter__(self) -> GGUFFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def import_gguf() -> Any:
    """The ``gguf`` package, or a ``ValueError`` saying how to install it."""
    try:
        import gguf
    except ImportError as e:
        raise ValueError(
            f"reading GGUF files needs the `gguf` package ({e}); install it with `pip install gguf` "
            "(pagedlm-models-gemma[default-model] brings it along)"
        ) from e
    return gguf


def ggml_type_name(ggml_type: int) -> str:
    try:
        return import_gguf().GGMLQuantizationType(ggml_type).name
    except ValueError:
        return f"<unknown ggml type {ggml_type}>"


class _Cursor:
    """Sequential, bounds-checked reads from the mapped file."""

    def __init__(self, buf: mmap.mmap, path: str) -> None:
        self.buf = buf
        self.size = len(buf)
        self.pos = 0
        self.path = path

    def _need(self, n: int, what: str) -> None:
        if n < 0 or self.pos + n > self.size:
            raise ValueError(
                f"{self.path} is truncated or corrupt: reading {what} needs {n} bytes at offset {self.pos}, "
                f"but the file has {self.size} bytes"
            )

    def unpack(self, fmt: str, what: str) -> Any:
        n = struct.calcsize(fmt)
        self._need(n, what)
        (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += n
        return value

    def string(self, what: str) -> str:
        n = self.unpack("<Q", f"the length of {what}")
        self._need(n, what)
        raw = self.buf[self.pos : self.pos + n]
        self.pos += n
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            # Some vocabularies store raw byte tokens that are not valid UTF-8 on their own.
            return raw.decode("utf-8", errors="replace")

    def _strings(self, count: int, key: str) -> list[str]:
        """``count`` length-prefixed strings; the hot loop of a 262k-token vocabulary, so it skips
        the per-read bookkeeping of :meth:`string` and checks bounds once per element inline."""
        buf, pos, size = self.buf, self.pos, self.size
        out: list[str] = []
        unpack_len = struct.Struct("<Q").unpack_from
        append = out.append
        for i in range(count):
            if pos + 8 > size:
                self.pos = pos
                self._need(8, f"the length of element {i} of {key!r}")
            (n,) = unpack_len(buf, pos)
            pos += 8
            end = pos + n
            if end > size:
                self.pos = pos
                self._need(n, f"element {i} of {key!r}")
            raw = buf[pos:end]
            try:
                append(raw.decode("utf-8"))
            except UnicodeDecodeError:
                append(raw.decode("utf-8", errors="replace"))
            pos = end
        self.pos = pos
        return out

    def value(self, vtype: int, key: str) -> Any:
        if vtype == _STRING:
            return self.string(f"the value of {key!r}")
        if vtype == _ARRAY:
            etype = self.unpack("<I", f"the element type of {key!r}")
            count = self.unpack("<Q", f"the length of {key!r}")
            if etype == _STRING:
                return self._strings(count, key)
            if etype == _ARRAY:
                return [self.value(_ARRAY, f"{key}[{i}]") for i in range(count)]
            if etype not in _SCALARS:
                raise ValueError(f"{self.path} is corrupt: {key!r} is an array of unknown value type {etype}")
            dtype = np.dtype(_SCALARS[etype][1])
            self._need(count * dtype.itemsize, f"the values of {key!r}")
            arr = np.frombuffer(self.buf, dtype=dtype, count=count, offset=self.pos).copy()
            self.pos += count * dtype.itemsize
            return arr.astype(bool) if etype == _BOOL else arr
        if vtype not in _SCALARS:
            raise ValueError(f"{self.path} is corrupt: {key!r} has unknown value type {vtype}")
        value = self.unpack(_SCALARS[vtype][0], f"the value of {key!r}")
        return bool(value) if vtype == _BOOL else value


def read_gguf(path: str | os.PathLike[str]) -> GGUFFile:
    """Parse the header of the GGUF file at ``path`` and map its data section.

    Raises ``ValueError`` (naming the file) for a missing, non-GGUF, big-endian, unsupported-version,
    truncated or otherwise corrupt file, and for tensors whose data would lie outside the file or
    whose type is unknown to the ``gguf`` package.
    """
    gguf = import_gguf()
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise ValueError(f"GGUF file {path!r} does not exist")
    with open(path, "rb") as f:
        if os.fstat(f.fileno()).st_size < 24:
            raise ValueError(f"{path} is not a GGUF file: only {os.fstat(f.fileno()).st_size} bytes long")
        # ACCESS_COPY: writable pages that are never written back, so torch can wrap them without
        # copying or warning about read-only memory; the file itself is never modified.
        buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    try:
        return _parse(buf, path, gguf.GGML_QUANT_SIZES, gguf.GGMLQuantizationType)
    except BaseException:
        buf.close()
        raise


def _parse(buf: mmap.mmap, path: str, quant_sizes: dict, qtypes: Any) -> GGUFFile:
    cur = _Cursor(buf, path)
    magic = buf[:4]
    if magic != _MAGIC:
        raise ValueError(f"{path} is not a GGUF file (magic bytes {magic!r}, expected {_MAGIC!r})")
    cur.pos = 4
    version = cur.unpack("<I", "the version")
    if version not in (2, 3):
        if version & 0xFFFF == 0 and version >> 16 in (2, 3):
            raise ValueError(f"{path} is a big-endian GGUF file; only little-endian files are supported")
        raise ValueError(f"{path} has GGUF version {version}; supported versions: 2, 3")
    n_tensors = cur.unpack("<Q", "the tensor count")
    n_kv = cur.unpack("<Q", "the metadata count")
    # Each entry takes at least a few bytes, so absurd counts are corruption, not huge models.
    if n_tensors > cur.size // 8 or n_kv > cur.size // 8:
        raise ValueError(f"{path} is corrupt: header claims {n_tensors} tensors and {n_kv} metadata entries")

    metadata: dict[str, Any] = {}
    for i in range(n_kv):
        key = cur.string(f"metadata key #{i}")
        vtype = cur.unpack("<I", f"the value type of {key!r}")
        metadata[key] = cur.value(vtype, key)

    raw_infos = []
    for i in range(n_tensors):
        name = cur.string(f"the name of tensor #{i}")
        n_dims = cur.unpack("<I", f"the rank of tensor {name!r}")
        if not 1 <= n_dims <= _MAX_DIMS:
            raise ValueError(f"{path} is corrupt: tensor {name!r} has {n_dims} dimensions (1..{_MAX_DIMS} allowed)")
        dims = [cur.unpack("<Q", f"the dimensions of tensor {name!r}") for _ in range(n_dims)]
        ggml_type = cur.unpack("<I", f"the type of tensor {name!r}")
        offset = cur.unpack("<Q", f"the offset of tensor {name!r}")
        raw_infos.append((name, dims, ggml_type, offset))

    alignment = metadata.get("general.alignment", 32)
    if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
        raise ValueError(f"{path} is corrupt: general.alignment={alignment!r} is not a power of two")
    data_start = -(-cur.pos // alignment) * alignment

    tensors = []
    for name, dims, ggml_type, offset in raw_infos:
        try:
            qtype = qtypes(ggml_type)
        except ValueError:
            raise ValueError(
                f"{path}: tensor {name!r} has ggml type {ggml_type}, which the installed gguf package does not "
                "know; the file may be corrupt or newer than gguf (try `pip install -U gguf`)"
            ) from None
        block, type_size = quant_sizes[qtype]
        if dims[0] % block:
            raise ValueError(
                f"{path} is corrupt: tensor {name!r} ({qtype.name}) has a row of {dims[0]} values, not a "
                f"multiple of the block size {block}"
            )
        numel = int(np.prod(dims, dtype=np.int64))
        nbytes = numel // block * type_size
        start = data_start + offset
        if start + nbytes > cur.size:
            raise ValueError(
                f"{path} is truncated: tensor {name!r} ({qtype.name}, shape {tuple(reversed(dims))}) needs bytes "
                f"{start}..{start + nbytes}, but the file ends at {cur.size}"
            )
        tensors.append(GGUFTensorInfo(name, int(ggml_type), tuple(int(d) for d in reversed(dims)), start, nbytes))
    return GGUFFile(path, version, metadata, tensors, alignment, buf)
