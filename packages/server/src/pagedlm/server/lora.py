"""LoRA adapters on the server: ``--lora-modules``, their model cards, ``model=NAME`` selection,
and vLLM's runtime routes ``POST /v1/load_lora_adapter`` / ``/v1/unload_lora_adapter``
(open only with ``--enable-dynamic-lora`` or ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True``)."""

from __future__ import annotations

import itertools
import json
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel

from pagedlm.core import LoRARequest
from pagedlm.server.errors import APIError

__all__ = ["LoRAModels", "parse_lora_modules"]


def parse_lora_modules(values: list[str] | None) -> list[tuple[str, str, str | None]]:
    """``--lora-modules`` entries as ``(name, path, base_model_name)``: ``name=path`` or vLLM's
    JSON form ``{"name": ..., "path": ..., "base_model_name": ...}``."""
    modules = []
    for value in values or ():
        if value.lstrip().startswith("{"):
            try:
                spec = json.loads(value)
            except ValueError as e:
                raise ValueError(f"--lora-modules {value!r}: invalid JSON: {e}") from e
            if not isinstance(spec, dict) or not isinstance(spec.get("name"), str) or not isinstance(
                    spec.get("path"), str):
                raise ValueError(f"--lora-modules {value!r}: the JSON form needs string fields 'name' and 'path'")
            modules.append((spec["name"], spec["path"], spec.get("base_model_name")))
            continue
        name, sep, path = value.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"--lora-modules {value!r}: expected NAME=PATH or a JSON object")
        modules.append((name, path, None))
    return modules


class LoRAAdapterRequest(BaseModel):
    """vLLM's body of ``/v1/load_lora_adapter`` and ``/v1/unload_lora_adapter``."""

    lora_name: str
    lora_path: str | None = None


class LoRAModels:
    """The adapters the server serves, by name (each a model of its own for clients)."""

    def __init__(self, engine: Any, base_model_name: str, *, allow_runtime_updates: bool) -> None:
        self.engine = engine
        self.base_model_name = base_model_name
        self.allow_runtime_updates = allow_runtime_updates
        self.adapters: dict[str, LoRARequest] = {}
        # NOTE: ids are never reused, so a reloaded name never meets a worker's cached weights
        self._ids = itertools.count(1)

    async def add(self, name: str, path: str, base_model_name: str | None = None) -> LoRARequest:
        """Check and register adapter ``name``; ``ValueError`` if the engine cannot run it."""
        if name in self.adapters:
            raise ValueError(f"the LoRA adapter {name!r} is already loaded")
        if name == self.base_model_name:
            raise ValueError(f"lora_name={name!r} is the base model's name")
        request = LoRARequest(name, next(self._ids), path, base_model_name=base_model_name or self.base_model_name)
        await self.engine.add_lora(request)
        self.adapters[name] = request
        return request

    async def remove(self, name: str) -> None:
        request = self.adapters.pop(name, None)
        if request is None:
            raise APIError(f"The LoRA adapter `{name}` is not loaded", status=404, param="lora_name",
                           code="model_not_found")
        await self.engine.remove_lora(request.lora_int_id)

    def cards(self, created: int) -> list[dict[str, Any]]:
        return [{"id": name, "object": "model", "created": created, "owned_by": "pagedlm", "root": r.lora_path,
                 "parent": r.base_model_name or self.base_model_name, "max_model_len": None}
                for name, r in self.adapters.items()]

    def install_routes(self, app: FastAPI) -> None:
        @app.post("/v1/load_lora_adapter")
        async def load_lora_adapter(body: LoRAAdapterRequest, request: Request) -> Any:
            self._check_allowed()
            if not body.lora_path:
                raise APIError("lora_path is required: the directory of a PEFT adapter", param="lora_path")
            if body.lora_name in self.adapters:
                raise APIError(f"The LoRA adapter `{body.lora_name}` is already loaded", param="lora_name")
            try:
                await self.add(body.lora_name, body.lora_path)
            except ValueError as e:
                raise APIError(str(e), param="lora_path") from None
            return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")

        @app.post("/v1/unload_lora_adapter")
        async def unload_lora_adapter(body: LoRAAdapterRequest, request: Request) -> Any:
            self._check_allowed()
            await self.remove(body.lora_name)
            return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")

    def _check_allowed(self) -> None:
        if not self.allow_runtime_updates:
            raise APIError("loading and unloading LoRA adapters at run time is off: start the server with "
                           "--enable-dynamic-lora or VLLM_ALLOW_RUNTIME_LORA_UPDATING=True", status=403,
                           code="forbidden")
