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

__all__ = [
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


def safetensors_weights_iterator(files: Iterable[str]) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(name, cpu_tensor)`` one tensor at a time (memory-mapped, never a whole file)."""
    from safetensors import safe_open

    for path in files:
        with safe_open(path, framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a Mapping
                yield name, f.get_tensor(name)


def pt_weights_iterator(files: Iterable[str]) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(name, cpu_tensor)`` from pickle checkpoints, loaded with ``weights_only=True``."""
    for path in files:
        try:
            state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError:
            # Legacy (pre-zipfile) checkpoints cannot be memory-mapped.
            state = torch.load(path, map_location="cpu", weights_only=True)
        if not isinstance(state, dict):
            raise TypeError(f"{path} does not hold a state dict (got {type(state).__name__})")
        for name, tensor in state.items():
            if isinstance(tensor, torch.Tensor):
                yield name, tensor
        del state


def initialize_dummy_weights(model: nn.Module, seed: int, low: float = -1e-3, high: float = 1e-3) -> None:
    """Fill every parameter with ``U(low, high)`` from a generator seeded with ``seed``.

    NOTE: values are drawn on the CPU in float32 and then cast, so a seed gives the same
    weights on every device and dtype.
    """
    gen = torch.Generator(device="cpu").manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            values = torch.empty(param.shape, dtype=torch.float32, device="cpu").uniform_(low, high, generator=gen)
            param.data.copy_(values)


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
