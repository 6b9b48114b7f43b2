"""LoRA adapters over HTTP with the real openai client: two adapters and the base model
concurrently (each gets HF + PEFT's greedy tokens), /v1/models cards with ``parent``, unknown
names as 404, and load/unload at run time (refused unless enabled)."""

from __future__ import annotations

import concurrent.futures
import json

import httpx
import openai
import pytest
from server_harness import API_KEY

PROMPT = [5, 6, 7, 8, 9, 10, 11, 12, 13, 14]
MAX_NEW = 6
EXTRA = {"return_token_ids": True, "ignore_eos": True}


@pytest.fixture(scope="module")
def adapters(tiny_llama, tmp_path_factory):
    from pagedlm.core.testing.lora import hf_peft_greedy, make_peft_adapter

    root = tmp_path_factory.mktemp("server-lora")
    paths = {"one": make_peft_adapter(tiny_llama, root / "one", rank=8, seed=11),
             "two": make_peft_adapter(tiny_llama, root / "two", rank=4, use_rslora=True, seed=12,
                                      target_modules=("q_proj", "v_proj", "down_proj"))}
    expected = {name: hf_peft_greedy(tiny_llama, path, [PROMPT], MAX_NEW)[0].token_ids for name, path in paths.items()}
    expected["tiny"] = hf_peft_greedy(tiny_llama, None, [PROMPT], MAX_NEW)[0].token_ids
    assert len({tuple(t) for t in expected.values()}) == 3
    return paths, expected


@pytest.fixture(scope="module")
def lora_server(start_server, tiny_llama, adapters):
    paths, _ = adapters
    return start_server(tiny_llama, "--max-model-len", "128", "--served-model-name", "tiny", "--enable-lora",
                        "--max-loras", "2", "--max-lora-rank", "8", "--enable-dynamic-lora", "--lora-modules",
                        f"one={paths['one']}", json.dumps({"name": "two", "path": paths["two"]}))


def _client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=60)


def _complete(client, model: str) -> tuple[str, list[int]]:
    out = client.completions.create(model=model, prompt=PROMPT, max_tokens=MAX_NEW, temperature=0.0, extra_body=EXTRA)
    return out.model, out.choices[0].token_ids


def test_adapters_and_base_concurrently(lora_server, adapters):
    _, expected = adapters
    with _client(lora_server) as client:
        models = {m.id: m for m in client.models.list().data}
        assert set(models) == {"tiny", "one", "two"}
        assert models["one"].parent == "tiny" and models["two"].parent == "tiny" and models["tiny"].parent is None
        assert client.models.retrieve("two").parent == "tiny"
        names = ["one", "two", "tiny"] * 3
        with concurrent.futures.ThreadPoolExecutor(len(names)) as pool:
            results = list(pool.map(lambda m: _complete(client, m), names))
        for name, (model, token_ids) in zip(names, results):
            assert model == name and token_ids == expected[name], name
        chat = client.chat.completions.create(model="two", messages=[{"role": "user", "content": "hi"}],
                                              max_tokens=2)
        assert chat.model == "two"
        with pytest.raises(openai.NotFoundError, match="does not exist"):
            client.completions.create(model="three", prompt="hi", max_tokens=1)
    metrics = httpx.get(lora_server.url + "/metrics", headers=lora_server.headers, timeout=30).text
    info = [line for line in metrics.splitlines() if line.startswith("pagedlm:lora_requests_info{")]
    assert len(info) == 1 and 'max_lora="2"' in info[0], metrics


def test_load_and_unload_at_run_time(lora_server, adapters):
    paths, expected = adapters
    def post(path, body):
        return httpx.post(lora_server.url + path, json=body, headers=lora_server.headers, timeout=60)

    loaded = post("/v1/load_lora_adapter", {"lora_name": "three", "lora_path": paths["one"]})
    assert loaded.status_code == 200, loaded.text
    assert post("/v1/load_lora_adapter", {"lora_name": "three", "lora_path": paths["one"]}).status_code == 400
    with _client(lora_server) as client:
        assert _complete(client, "three") == ("three", expected["one"])
        assert "three" in {m.id for m in client.models.list().data}
    assert post("/v1/unload_lora_adapter", {"lora_name": "three"}).status_code == 200
    assert post("/v1/unload_lora_adapter", {"lora_name": "three"}).status_code == 404
    with _client(lora_server) as client, pytest.raises(openai.NotFoundError):
        client.completions.create(model="three", prompt="hi", max_tokens=1)
    bad = post("/v1/load_lora_adapter", {"lora_name": "bad", "lora_path": "/nonexistent/adapter"})
    assert bad.status_code == 400 and "no adapter_config.json" in bad.json()["error"]["message"]


def test_runtime_updates_refused_unless_enabled():
    """Without --enable-dynamic-lora (or VLLM_ALLOW_RUNTIME_LORA_UPDATING) both routes are refused."""
    from fastapi.testclient import TestClient
    from test_engine_client import FakeEngine

    from pagedlm.server.app import build_app
    from pagedlm.server.lora import LoRAModels, parse_lora_modules
    from pagedlm.server.serving_common import ServerState

    engine = FakeEngine()
    state = ServerState(engine=engine, served_model_names=["fake"])
    state.lora = LoRAModels(engine, "fake", allow_runtime_updates=False)
    client = TestClient(build_app(state))
    for route in ("/v1/load_lora_adapter", "/v1/unload_lora_adapter"):
        r = client.post(route, json={"lora_name": "x", "lora_path": "/x"})
        assert r.status_code == 403 and "VLLM_ALLOW_RUNTIME_LORA_UPDATING" in r.json()["error"]["message"]
    assert parse_lora_modules(["a=/p", '{"name": "b", "path": "/q", "base_model_name": "m"}']) == [
        ("a", "/p", None), ("b", "/q", "m")]
    with pytest.raises(ValueError, match="expected NAME=PATH"):
        parse_lora_modules(["nopath"])


def test_lora_requests_info_gauge():
    from prometheus_client import generate_latest

    from pagedlm.core.metrics.stats import EngineStatsSnapshot
    from pagedlm.server.metrics import PrometheusStatLogger

    logger = PrometheusStatLogger("m", prefix="vllm:")
    for running in ({"b": 1}, {"b": 1, "a": 2}):
        logger.record(EngineStatsSnapshot(running_lora_adapters=running, waiting_lora_adapters={"c": 1}, max_lora=2),
                      None)
    lines = [line for line in generate_latest(logger.registry).decode().splitlines()
             if line.startswith("vllm:lora_requests_info{")]
    assert len(lines) == 1
    for label in ('max_lora="2"', 'running_lora_adapters="a,b"', 'waiting_lora_adapters="c"'):
        assert label in lines[0]
