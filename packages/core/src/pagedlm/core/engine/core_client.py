"""How the front end talks to the engine core.

``InprocClient`` calls the core directly (offline ``LLM``, tests). A background-process client
over ZMQ implements the same methods.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pagedlm.core.config import VllmConfig
from pagedlm.core.engine.core import EngineCore
from pagedlm.core.request import EngineCoreRequest
from pagedlm.core.sched import EngineCoreOutput


class EngineCoreClient:
    #: KV-cache blocks the engine core allocated (set once the core is ready)
    num_gpu_blocks: int

    def add_request(self, request: EngineCoreRequest) -> None:
        raise NotImplementedError

    def abort_requests(self, request_ids: list[str]) -> None:
        raise NotImplementedError

    def get_output(self) -> list[EngineCoreOutput]:
        raise NotImplementedError

    def collective_rpc(self, method: str | Callable[..., Any], timeout: float | None = None, args: tuple = (),
                       kwargs: dict[str, Any] | None = None) -> list[Any]:
        """``EngineCore.collective_rpc`` (every replica's workers, in order, with data parallelism)."""
        raise NotImplementedError

    def profile(self, is_start: bool = True, profile_prefix: str | None = None) -> None:
        raise NotImplementedError

    def shutdown(self) -> None:
        raise NotImplementedError


class InprocClient(EngineCoreClient):
    def __init__(self, vllm_config: VllmConfig) -> None:
        self.engine_core = EngineCore(vllm_config)
        self.num_gpu_blocks = self.engine_core.num_gpu_blocks

    def add_request(self, request: EngineCoreRequest) -> None:
        self.engine_core.add_request(request)

    def abort_requests(self, request_ids: list[str]) -> None:
        if request_ids:
            self.engine_core.abort_requests(request_ids)

    def get_output(self) -> list[EngineCoreOutput]:
        return self.engine_core.step()

    def collective_rpc(self, method: str | Callable[..., Any], timeout: float | None = None, args: tuple = (),
                       kwargs: dict[str, Any] | None = None) -> list[Any]:
        return self.engine_core.collective_rpc(method, timeout, args, kwargs)

    def profile(self, is_start: bool = True, profile_prefix: str | None = None) -> None:
        self.engine_core.profile(is_start, profile_prefix)

    def shutdown(self) -> None:
        self.engine_core.shutdown()
