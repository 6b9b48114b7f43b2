"""Finding, reading and assigning checkpoint weights.

Weights are streamed as ``(name, tensor)`` pairs with HF parameter names; nothing here knows
about a particular architecture. Models map names onto their own parameters with
:func:`load_weights_by_name`.
"""

from __future__ import annotations

import glob
import json
import os
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from pagedlm.core.platforms.interface import HOST

__all__ = [
    "LazyWeight",
    "default_weight_loader",
    "find_weight_files",
    "initialize_dummy_weights",
    "load_weights_by_name",
    "pt_weights_iterator",
    "safetensors_weights_iterator",
    "set_weight_attrs",
]

_SAFETENSORS_INDEX = "model.safetensors.index.json"
_PT_INDEX = "pytorch_model.bin.index.json"
# Pickle files that sit beside weights in HF directories but hold no model weights.
_NON_WEIGHT_PICKLES = ("training_args.bin", "optimizer.pt", "scheduler.pt", "rng_state.pth", "trainer_state.pt")


def set_weight_attrs(param: torch.Tensor, attrs: dict[str, Any]) -> None:
    """Attach loader metadata (e.g. ``weight_loader``) to a parameter."""
    for key, value in attrs.items():
        if hasattr(param, key) and key != "weight_loader":
            raise AttributeError(f"parameter already has attribute {key!r}")
        setattr(param, key, value)


def default_weight_loader(param: torch.Tensor, loaded_weight: torch.Tensor, shard_id: Any = None) -> None:
    """Copy a whole (unsharded) checkpoint tensor into ``param``, casting dtype and device."""
    if shard_id is not None:
        raise ValueError(f"this parameter is not sharded; got shard_id={shard_id!r}")
    if tuple(param.shape) != tuple(loaded_weight.shape):
        raise ValueError(
            f"checkpoint tensor has shape {tuple(loaded_weight.shape)}, parameter expects {tuple(param.shape)}"
        )
    param.data.copy_(loaded_weight)


# -- locating files -----------------------------------------------------------------------------


def _files_from_index(model_dir: str, index_name: str) -> list[str] | None:
    path = os.path.join(model_dir, index_name)
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        weight_map = json.load(f).get("weight_map", {})
    files = sorted({os.path.join(model_dir, name) for name in weight_map.values()})
    missing = [p for p in files if not os.path.isfile(p)]
    if missing:
        raise ValueError(f"{index_name} in {model_dir} names files that do not exist: {missing}")
    return files


def find_weight_files(model_dir: str, load_format: str) -> list[str]:
    """The checkpoint files to read for ``load_format`` ``"auto"``, ``"safetensors"`` or ``"pt"``.

    Safetensors: ``model.safetensors``, else the files of ``model.safetensors.index.json``,
    else every ``*.safetensors`` (Mistral's ``consolidated*`` duplicates excluded).
    ``"auto"`` refuses a directory holding only pickle checkpoints.
    """
    if load_format in ("auto", "safetensors"):
        single = os.path.join(model_dir, "model.safetensors")
        if os.path.isfile(single):
            return [single]
        indexed = _files_from_index(model_dir, _SAFETENSORS_INDEX)
        if indexed:
            return indexed
        found = sorted(
            p for p in glob.glob(os.path.join(model_dir, "*.safetensors"))
            if not os.path.basename(p).startswith("consolidated")
        )
        if found:
            return found
        pickles = _pickle_files(model_dir)
        if pickles and load_format == "auto":
            names = ", ".join(os.path.basename(p) for p in pickles)
            raise ValueError(
                f"{model_dir} holds only pickle checkpoints ({names}); pickle files can run arbitrary code "
                'when loaded, so they are refused unless you pass load_format="pt" (read with '
                "torch.load(weights_only=True)). Converting the checkpoint to safetensors is preferred."
            )
        raise ValueError(f"no *.safetensors weights found in {model_dir} (load_format={load_format!r})")
    if load_format == "pt":
        pickles = _pickle_files(model_dir)
        if not pickles:
            raise ValueError(f'no *.bin / *.pt weights found in {model_dir} (load_format="pt")')
        return pickles
    raise ValueError(f"load_format={load_format!r} does not read weight files")


def _pickle_files(model_dir: str) -> list[str]:
    indexed = _files_from_index(model_dir, _PT_INDEX)
    if indexed:
        return indexed
    found = glob.glob(os.path.join(model_dir, "*.bin")) + glob.glob(os.path.join(model_dir, "*.pt"))
    return sorted(p for p in found if os.path.basename(p) not in _NON_WEIGHT_PICKLES)


# -- reading --------------------------------------------------------------------------------------


_SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}


class LazyWeight:
    """A checkpoint tensor that is read from disk only as far as it is indexed.

    Tensor-parallel weight loaders take ``weight[start:end]`` / ``weight[:, start:end]`` /
    ``weight.narrow(dim, start, n)`` of the full checkpoint tensor; on a ``LazyWeight`` those read
    just that slice (safetensors ``get_slice``), so a rank never holds a full copy of a weight it
    shards. Anything else (``param.copy_(w)``, ``w.float()``, ``torch.cat([w])``) reads the whole
    tensor once, through ``__torch_function__`` / attribute fallback, so code written for plain
    tensors keeps working. Valid while its weights iterator has not moved past it.
    """

    __slots__ = ("_slice", "_handle", "name", "shape", "dtype", "_full")
    #: bytes read through all LazyWeights of this process (tests check that ranks read shares)
    bytes_read = 0

    def __init__(self, handle: Any, name: str) -> None:
        self._handle = handle
        self._slice = handle.get_slice(name)
        self.name = name
        self.shape = torch.Size(self._slice.get_shape())
        self.dtype = _SAFETENSORS_DTYPES.get(self._slice.get_dtype())
        self._full: torch.Tensor | None = None

    def _count(self, t: torch.Tensor) -> torch.Tensor:
        LazyWeight.bytes_read += t.numel() * t.element_size()
        return t

    def __getitem__(self, index: Any) -> torch.Tensor:
        if self._full is not None:
            return self._full[index]
        return self._count(self._slice[index])

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        index = (slice(None),) * (dim % len(self.shape)) + (slice(start, start + length),)
        return self[index]

    def materialize(self) -> torch.Tensor:
        if self._full is None:
            self._full = self._count(self._handle.get_tensor(self.name))
        return self._full

    def dim(self) -> int:
        return len(self.shape)

    def size(self, dim: int | None = None) -> Any:
        return self.shape if dim is None else self.shape[dim]

    def numel(self) -> int:
        return self.shape.numel()

    def __len__(self) -> int:
        return self.shape[0]

    def __repr__(self) -> str:
        return f"LazyWeight({self.name!r}, shape={tuple(self.shape)}, dtype={self.dtype})"

    def __getattr__(self, attr: str) -> Any:
        # Reached only for attributes not defined above: behave like the full tensor.
        return getattr(self.materialize(), attr)

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        def real(x: Any) -> Any:
            if isinstance(x, LazyWeight):
                return x.materialize()
            if isinstance(x, (list, tuple)):
                return type(x)(real(i) for i in x)
            return x

        return func(*real(tuple(args)), **{k: real(v) for k, v in (kwargs or {}).items()})


def safetensors_weights_iterator(files: Iterable[str], lazy: bool = False) -> Iterator[tuple[str, Any]]:
    """Yield ``(name, cpu_tensor)`` one tensor at a time (memory-mapped, never a whole file).

    With ``lazy=True`` the values are :class:`LazyWeight`: nothing is read until a weight loader
    takes its slice (multi-rank runs, so each rank reads only its share).
    """
    from safetensors import safe_open

    for path in files:
        with safe_open(path, framework="pt", device=str(HOST)) as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a Mapping
                yield name, (LazyWeight(f, name) if lazy else f.get_tensor(name))


def pt_weights_iterator(files: Iterable[str]) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(name, cpu_tensor)`` from pickle checkpoints, loaded with ``weights_only=True``."""
    for path in files:
        try:
            state = torch.load(path, map_location=HOST, weights_only=True, mmap=True)
        except RuntimeError:
            # Legacy (pre-zipfile) checkpoints cannot be memory-mapped.
            state = torch.load(path, map_location=HOST, weights_only=True)
        if not isinstance(state, dict):
            raise TypeError(f"{path} does not hold a state dict (got {type(state).__name__})")
        for name, tensor in state.items():
            if isinstance(tensor, torch.Tensor):
                yield name, tensor
        del state


def initialize_dummy_weights(model: nn.Module, seed: int, low: float = -1e-3, high: float = 1e-3) -> None:
    """Fill every parameter with ``U(low, high)`` from a generator seeded with ``seed``.

    Integer parameters (packed quantized weights) get uniformly random integers of their dtype, and
    a parameter with a ``dummy_init(param, generator)`` attribute (a quantize method's scales,
    group indices, shapes) is filled by it, so ``load_format="dummy"`` builds valid quantized layers.

    NOTE: values are drawn in float32 on the parameter's device and then cast, so a seed gives
    the same weights on every run of one device type (and dtype-independent values up to the
    cast), not across device types: a CPU draw of a 0.6B model took ~4 s of a GPU engine's start.
    """
    generators: dict[torch.device, torch.Generator] = {}
    with torch.no_grad():
        for param in model.parameters():
            gen = generators.get(param.device)
            if gen is None:
                gen = generators[param.device] = torch.Generator(device=param.device).manual_seed(seed)
            custom = getattr(param, "dummy_init", None)
            if custom is not None:
                custom(param, gen)
            elif not param.dtype.is_floating_point:
                info = torch.iinfo(param.dtype)
                high_int = info.max if param.dtype == torch.int64 else info.max + 1
                param.data.copy_(torch.randint(info.min, high_int, param.shape, generator=gen, device=param.device,
                                               dtype=torch.int64).to(param.dtype))
            else:
                values = torch.empty(param.shape, dtype=torch.float32, device=param.device)
                param.data.copy_(values.uniform_(low, high, generator=gen))


# -- assigning ------------------------------------------------------------------------------------


def load_weights_by_name(
    model: nn.Module,
    weights: Iterable[tuple[str, torch.Tensor]],
    stacked_params: Iterable[tuple[str, str, Any]] = (),
    skip: Iterable[str] = (),
) -> set[str]:
    """Assign checkpoint tensors to ``model``'s parameters by name; return the names loaded.

    ``stacked_params`` lists ``(fused_name, checkpoint_name, shard_id)``: a checkpoint tensor
    whose name contains ``.checkpoint_name.`` goes to the parameter with that part replaced by
    ``fused_name``, via its ``weight_loader(param, tensor, shard_id)`` (e.g.
    ``("qkv_proj", "q_proj", "q")``). Names containing any substring in ``skip`` are ignored
    (e.g. ``"rotary_emb.inv_freq"``). A checkpoint tensor with no matching parameter raises.

    NOTE: a fused parameter counts as loaded only once every one of its shards has arrived, so
    a checkpoint missing ``k_proj`` is reported by the loader rather than run half-initialised.
    """
    params = dict(model.named_parameters())
    # Modules held by another pipeline stage: their checkpoint tensors are skipped unread.
    missing_prefixes = tuple(
        f"{name}." for name, module in model.named_modules() if type(module).__name__ == "PPMissingLayer"
    )
    stacked = list(stacked_params)
    skip = tuple(skip)
    expected_shards: dict[str, set[Any]] = {}
    for fused, _, sid in stacked:
        expected_shards.setdefault(fused, set()).add(sid)
    received: dict[str, set[Any]] = {}
    loaded: set[str] = set()
    for name, tensor in weights:
        if any(s in name for s in skip):
            continue
        target, shard_id, fused_key = name, None, None
        for fused, original, sid in stacked:
            part = f".{original}."
            if part in name:
                target, shard_id, fused_key = name.replace(part, f".{fused}.", 1), sid, fused
                break
        if missing_prefixes and target.startswith(missing_prefixes):
            continue
        param = params.get(target)
        if param is None:
            raise ValueError(
                f"checkpoint tensor {name!r} matches no parameter of {type(model).__name__} "
                f"(looked for {target!r})"
            )
        loader = getattr(param, "weight_loader", default_weight_loader)
        with torch.no_grad():
            if shard_id is None:
                loader(param, tensor)
            else:
                loader(param, tensor, shard_id)
        if fused_key is None:
            loaded.add(target)
        else:
            got = received.setdefault(target, set())
            got.add(shard_id)
            if got >= expected_shards[fused_key]:
                loaded.add(target)
    return loaded
