"""``LoRARequest``: which adapter a request runs with (vLLM's class and field names)."""

from __future__ import annotations

import hashlib
from typing import Any

__all__ = ["LoRARequest", "lora_hash_seed"]


class LoRARequest:
    """A PEFT adapter for one request: ``LoRARequest(lora_name, lora_int_id, lora_path)``.

    ``lora_int_id`` (>= 1) identifies the adapter inside the engine (its slot and host-cache
    key); ``lora_path`` is a directory holding ``adapter_config.json`` and
    ``adapter_model.safetensors`` (``path=`` is accepted for it too). Two requests with the same
    ``lora_name`` are the same adapter (vLLM compares and hashes by name).
    """

    __slots__ = ("base_model_name", "lora_int_id", "lora_name", "lora_path")

    def __init__(self, lora_name: str, lora_int_id: int, lora_path: str = "", *, path: str | None = None,
                 base_model_name: str | None = None, **unsupported: Any) -> None:
        if unsupported:
            raise TypeError(f"LoRARequest() got unsupported fields {sorted(unsupported)}; "
                            "takes lora_name, lora_int_id, lora_path (or path), base_model_name")
        if not isinstance(lora_name, str) or not lora_name:
            raise ValueError(f"lora_name={lora_name!r} must be a non-empty string")
        if isinstance(lora_int_id, bool) or not isinstance(lora_int_id, int) or lora_int_id < 1:
            raise ValueError(f"lora_int_id={lora_int_id!r} must be an integer >= 1")
        if path is not None and lora_path and path != lora_path:
            raise ValueError(f"lora_path={lora_path!r} and path={path!r} disagree; pass one")
        lora_path = lora_path or path or ""
        if not isinstance(lora_path, str) or not lora_path:
            raise ValueError(f"lora_path={lora_path!r} must name the adapter's directory")
        self.lora_name = lora_name
        self.lora_int_id = lora_int_id
        self.lora_path = str(lora_path)
        self.base_model_name = base_model_name

    # vLLM's aliases
    @property
    def adapter_id(self) -> int:
        return self.lora_int_id

    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def path(self) -> str:
        return self.lora_path

    def __eq__(self, other: object) -> bool:
        return isinstance(other, LoRARequest) and other.lora_name == self.lora_name

    def __hash__(self) -> int:
        return hash(self.lora_name)

    def __repr__(self) -> str:
        return (f"LoRARequest(lora_name={self.lora_name!r}, lora_int_id={self.lora_int_id}, "
                f"lora_path={self.lora_path!r})")

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuild, (self.lora_name, self.lora_int_id, self.lora_path, self.base_model_name))

    def to_wire(self) -> list[Any]:
        """As msgpack values (the engine-core process's input channel)."""
        return [self.lora_name, self.lora_int_id, self.lora_path, self.base_model_name]

    @classmethod
    def from_wire(cls, values: list[Any] | None) -> LoRARequest | None:
        if values is None:
            return None
        name, int_id, path, base = values
        return cls(name, int_id, path, base_model_name=base)


def _rebuild(name: str, int_id: int, path: str, base: str | None) -> LoRARequest:
    return LoRARequest(name, int_id, path, base_model_name=base)


def lora_hash_seed(lora_request: LoRARequest, seed: bytes | None) -> bytes:
    """What a LoRA request's prefix-cache hash chain starts from: the adapter (id, name and path)
    and the seed it would have without one (``Request.block_hash_seed``), so two adapters, or an
    adapter and the base model, never share KV blocks."""
    hasher = hashlib.sha256(b"lora\0")
    hasher.update(f"{lora_request.lora_int_id}\0{lora_request.lora_name}\0{lora_request.lora_path}".encode())
    if seed is not None:
        hasher.update(seed)
    return hasher.digest()
