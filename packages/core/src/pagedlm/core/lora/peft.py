"""Reading PEFT LoRA adapters (``adapter_config.json`` + ``adapter_model.safetensors``).

A PEFT adapter stores, per adapted ``nn.Linear`` named ``M`` (HF module path), ``lora_A`` ``[r,
in]`` and ``lora_B`` ``[out, r]`` under ``base_model.model.M.lora_A.weight`` /
``...lora_B.weight``; the layer computes ``y = W x + (B (A x)) * scaling`` with ``scaling =
lora_alpha / r`` (``lora_alpha / sqrt(r)`` with ``use_rslora``).

``targets`` below is the model's table of adaptable modules, HF module path -> ``(in, out)``
full (unsharded) sizes, as the workers report it (:func:`pagedlm.core.lora.layers.target_table`),
so an adapter is checked against the model it will run on before any request uses it.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from pagedlm.core.lora.request import LoRARequest

__all__ = ["LoRAAdapter", "load_peft_adapter"]

CONFIG_NAME = "adapter_config.json"
WEIGHTS_NAME = "adapter_model.safetensors"
_KEY_PREFIX = "base_model.model."
_A, _B = ".lora_A.weight", ".lora_B.weight"


@dataclass
class LoRAAdapter:
    """One adapter read from disk: ``weights[M] = (A [r, in], B [out, r])`` on the CPU."""

    lora_int_id: int
    lora_name: str
    rank: int
    scaling: float
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)


def _refuse(request: LoRARequest, problem: str) -> ValueError:
    return ValueError(f"LoRA adapter {request.lora_name!r} ({request.lora_path}): {problem}")


def read_adapter_config(request: LoRARequest) -> tuple[int, float]:
    """``(rank, scaling)`` of the adapter at ``request.lora_path``; ``ValueError`` for what this
    engine cannot run (non-LoRA PEFT types, DoRA, per-module ranks, trained biases,
    ``modules_to_save``)."""
    path = os.path.join(request.lora_path, CONFIG_NAME)
    if not os.path.isfile(path):
        raise _refuse(request, f"no {CONFIG_NAME} (lora_path must be a PEFT adapter directory)")
    try:
        with open(path, encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, ValueError) as e:
        raise _refuse(request, f"cannot read {CONFIG_NAME}: {e}") from e
    if not isinstance(config, dict):
        raise _refuse(request, f"{CONFIG_NAME} is not a JSON object")
    peft_type = str(config.get("peft_type", "LORA")).upper()
    if peft_type != "LORA":
        raise _refuse(request, f"peft_type={peft_type!r} is not supported (only LORA)")
    for key, what in (("modules_to_save", "modules_to_save (fully trained modules)"),
                      ("rank_pattern", "rank_pattern (per-module ranks)"),
                      ("alpha_pattern", "alpha_pattern (per-module alphas)"),
                      ("lora_bias", "lora_bias (trained LoRA biases)"),
                      ("trainable_token_indices", "trainable_token_indices (embedding updates)"),
                      ("target_parameters", "target_parameters (adapted parameters)")):
        if config.get(key):
            raise _refuse(request, f"{what} is not supported")
    if config.get("use_dora"):
        raise _refuse(request, "use_dora=True (DoRA) is not supported")
    if config.get("bias", "none") not in ("none", None):
        raise _refuse(request, f"bias={config['bias']!r} is not supported (only 'none')")
    rank, alpha = config.get("r"), config.get("lora_alpha", config.get("r"))
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise _refuse(request, f"r={rank!r} must be an integer >= 1")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)):
        raise _refuse(request, f"lora_alpha={alpha!r} must be a number")
    scaling = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    return rank, float(scaling)


def load_peft_adapter(request: LoRARequest, targets: Mapping[str, tuple[int, int]], max_lora_rank: int, *,
                      read_tensors: bool = True) -> LoRAAdapter:
    """Read and check the adapter of ``request``; ``read_tensors=False`` checks the file's
    header only (names, shapes, dtypes) and returns no weights.

    Raises ``ValueError`` naming the adapter for a rank over ``max_lora_rank``, a module the
    model has no adaptable layer for (embeddings and ``lm_head`` included), a shape that does not
    fit the model, or a malformed file.
    """
    from safetensors import safe_open

    rank, scaling = read_adapter_config(request)
    if rank > max_lora_rank:
        raise _refuse(request, f"rank r={rank} exceeds max_lora_rank={max_lora_rank} (raise --max-lora-rank)")
    path = os.path.join(request.lora_path, WEIGHTS_NAME)
    if not os.path.isfile(path):
        extra = " (adapter_model.bin is not read: save with safetensors)" if os.path.isfile(
            os.path.join(request.lora_path, "adapter_model.bin")) else ""
        raise _refuse(request, f"no {WEIGHTS_NAME}{extra}")
    pairs: dict[str, dict[str, Any]] = {}
    try:
        with safe_open(path, framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 - a safe_open handle, not a dict
                module, part = _split_key(request, key)
                entry = pairs.setdefault(module, {})
                sliced = f.get_slice(key)
                entry[part + "_shape"] = tuple(sliced.get_shape())
                entry[part + "_dtype"] = sliced.get_dtype()
                if read_tensors:
                    entry[part] = f.get_tensor(key)
    except ValueError:
        raise
    except Exception as e:  # a corrupt file: say which adapter
        raise _refuse(request, f"cannot read {WEIGHTS_NAME}: {type(e).__name__}: {e}") from e
    if not pairs:
        raise _refuse(request, f"{WEIGHTS_NAME} holds no LoRA weights")
    adapter = LoRAAdapter(request.lora_int_id, request.lora_name, rank, scaling)
    for module, entry in sorted(pairs.items()):
        if module not in targets:
            short = sorted({name.rsplit(".", 1)[-1] for name in targets})
            raise _refuse(request, f"targets module {module!r}, which this model has no LoRA-capable layer for "
                                   f"(adaptable: {', '.join(short)})")
        if "A_shape" not in entry or "B_shape" not in entry:
            raise _refuse(request, f"module {module!r} has only one of lora_A / lora_B")
        size_in, size_out = targets[module]
        want_a, want_b = (rank, size_in), (size_out, rank)
        if entry["A_shape"] != want_a or entry["B_shape"] != want_b:
            raise _refuse(request, f"module {module!r}: lora_A {list(entry['A_shape'])} / lora_B "
                                   f"{list(entry['B_shape'])} do not fit the model (expected {list(want_a)} / "
                                   f"{list(want_b)} for r={rank})")
        for part in ("A", "B"):
            if not entry[part + "_dtype"].startswith(("F", "BF")):
                raise _refuse(request, f"module {module!r}: lora_{part} has dtype {entry[part + '_dtype']} "
                                       "(floating point expected)")
        if read_tensors:
            adapter.weights[module] = (entry["A"], entry["B"])
    return adapter


def _split_key(request: LoRARequest, key: str) -> tuple[str, str]:
    """``base_model.model.M.lora_A.weight`` -> ``(M, "A")``; ``ValueError`` for other tensors."""
    if "lora_embedding_" in key:
        raise _refuse(request, f"tensor {key!r}: embedding adapters are not supported")
    name = key.removeprefix(_KEY_PREFIX)
    for suffix, part in ((_A, "A"), (_B, "B")):
        if name.endswith(suffix):
            return name[: -len(suffix)], part
    raise _refuse(request, f"tensor {key!r} is not a LoRA A/B weight (trained biases, modules_to_save and "
                           "other extras are not supported)")
