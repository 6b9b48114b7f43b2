"""The server needs an ``EngineClient`` and nothing more; ``AsyncLLM`` is one."""

from __future__ import annotations

import ast
import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from pagedlm.core import AsyncLLM, EngineClient, EngineDeadError, SamplingParams
from pagedlm.core.config import VllmConfig
from pagedlm.core.outputs import CompletionOutput, RequestOutput

SERVER_SRC = Path(__file__).parents[2] / "packages" / "server" / "src" / "pagedlm" / "server"
MEMBERS = {name for name in vars(EngineClient) if not name.startswith("_")}


def test_async_llm_is_an_engine_client(tiny_llama):
    from pagedlm.core.engine.arg_utils import EngineArgs

    engine = AsyncLLM(EngineArgs(model=tiny_llama, dtype="float32", device="cpu").create_vllm_config(),
                      multiprocess=False, log_stats=False)
    try:
        assert isinstance(engine, EngineClient)  # (and statically: see the end of engine/async_llm.py)
        assert MEMBERS <= set(dir(engine))
        ids = engine.tokenize("hello world")
        assert ids and all(isinstance(t, int) for t in ids)
        with pytest.raises(ValueError, match="max_model_len"):
            engine.validate_prompt(ids, SamplingParams(max_tokens=engine.max_model_len))
        asyncio.run(engine.check_health())
        assert engine.model_config.model == tiny_llama and engine.num_gpu_blocks > 0
    finally:
        engine.shutdown()
    with pytest.raises(EngineDeadError):
        asyncio.run(engine.check_health())


def _engine_attributes(tree: ast.AST) -> set[str]:
    """Attributes read from ``engine``, ``state.engine``, ``self.engine``, ... in a module."""
    used = set()
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute):
            continue
        owner = node.value
        if (isinstance(owner, ast.Name) and owner.id == "engine") or (
                isinstance(owner, ast.Attribute) and owner.attr == "engine"):
            used.add(node.attr)
    return used


def test_the_server_uses_only_engine_client_members():
    used: dict[str, set[str]] = {}
    for path in sorted(SERVER_SRC.glob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        used[path.name] = _engine_attributes(tree)
        if path.name != "launcher.py":  # the launcher builds the engine; the rest only use it
            imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) for a in n.names}
            assert "AsyncLLM" not in imported, path.name
    assert set().union(*used.values()), "the scan found no engine use at all"
    outside = {name: attrs - MEMBERS for name, attrs in used.items() if attrs - MEMBERS}
    assert not outside, f"the server reaches past EngineClient: {outside}"


class FakeEngine:
    """An EngineClient with exactly the protocol's members: echoes the prompt's first token."""

    def __init__(self) -> None:
        self.vllm_config = VllmConfig()
        self.model_config = self.vllm_config.model_config
        self.max_model_len = 64
        self.vocab_size = 1000
        self.tokenizer = None
        self.mm_processor = None
        self.dead_error: EngineDeadError | None = None
        self.num_gpu_blocks = 8
        self.latest_stats = None
        self.aborted: list[str] = []
        self.scheduling_policy = "fcfs"

    def tokenize(self, prompt, *, add_special_tokens: bool = True) -> list[int]:
        return [ord(c) for c in prompt]

    def validate_prompt(self, token_ids, params, *, has_mm_data: bool = False) -> None:
        if len(token_ids) + (params.max_tokens or 0) > self.max_model_len:
            raise ValueError(f"prompt + max_tokens exceeds max_model_len={self.max_model_len}")

    def validate_prompt_embeds(self, embeds, params):
        raise ValueError("prompt_embeds needs --enable-prompt-embeds")

    async def generate(self, prompt, sampling_params, request_id, *, add_special_tokens: bool = True,
                       lora_request=None, priority: int = 0) -> AsyncIterator[RequestOutput]:
        token_ids = prompt["prompt_token_ids"]
        yield RequestOutput(request_id=request_id, prompt=prompt["prompt"], prompt_token_ids=token_ids,
                            prompt_logprobs=None, finished=True,
                            outputs=[CompletionOutput(index=0, text="!", token_ids=[token_ids[0]],
                                                      cumulative_logprob=None, logprobs=None, finish_reason="length")])

    async def encode(self, prompt, pooling_params, request_id, *, priority: int = 0):
        raise NotImplementedError("not a pooling model")
        yield

    async def sleep(self, level: int = 1) -> None:
        raise ValueError("sleep mode is off")

    async def wake_up(self, tags=None) -> None:
        return None

    async def is_sleeping(self) -> bool:
        return False

    def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)

    async def add_lora(self, lora_request) -> bool:
        raise ValueError("this engine serves no LoRA adapters")

    async def remove_lora(self, lora_id: int) -> bool:
        return False

    async def check_health(self) -> None:
        if self.dead_error is not None:
            raise self.dead_error

    def shutdown(self) -> None:
        self.dead_error = EngineDeadError("the engine was shut down")


def test_a_fake_engine_client_serves_the_app():
    from fastapi.testclient import TestClient

    from pagedlm.server.app import build_app
    from pagedlm.server.serving_common import ServerState

    engine = FakeEngine()
    assert isinstance(engine, EngineClient)
    client = TestClient(build_app(ServerState(engine=engine, served_model_names=["fake"])))
    assert client.get("/health").json() == {"status": "ok"}
    assert client.get("/v1/models").json()["data"][0]["max_model_len"] == 64
    assert client.post("/tokenize", json={"prompt": "hi"}).json()["tokens"] == [104, 105]
    done = client.post("/v1/completions", json={"model": "fake", "prompt": "hi", "max_tokens": 1}).json()
    assert done["choices"][0]["text"] == "!" and done["usage"]["completion_tokens"] == 1
    too_long = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 63})
    assert too_long.status_code == 400 and "max_model_len" in too_long.json()["error"]["message"]
    engine.shutdown()
    assert client.get("/health").status_code == 503
