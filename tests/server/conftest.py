"""Fixtures for the server tests: a real `pagedlm serve` subprocess and OpenAI's own schemas.

One server (tiny Llama, CPU) is shared by every test of this folder that does not need to kill
or stop it; tests that do start their own with ``start_server``. Every server is stopped (and
killed if it will not stop) when the session ends, and every wait is bounded.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
from server_harness import API_KEY, OPENAI_SPEC, OpenAISchemas, OpenAITypedModels, ServerProcess


@pytest.fixture(scope="session")
def start_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[..., ServerProcess]]:
    """``start_server(model, *cli_args, api_key=...)`` -> a ready server, stopped at session end."""
    servers: list[ServerProcess] = []

    def start(model: str | None, *args: str, wait: bool = True, **kwargs: Any) -> ServerProcess:
        log = tmp_path_factory.mktemp("server") / "server.log"
        server = ServerProcess(model, log, *args, **kwargs)
        servers.append(server)
        if wait:
            try:
                server.wait_ready()
            except BaseException:
                server.stop()
                raise
        return server

    yield start
    for server in servers:
        server.stop()


@pytest.fixture(scope="session")
def server(start_server: Callable[..., ServerProcess], tiny_llama: str) -> ServerProcess:
    """The shared server: tiny Llama, 512-token context, API key ``API_KEY``."""
    return start_server(tiny_llama, "--max-model-len", "512", "--served-model-name", "tiny-llama")


@pytest.fixture()
def client(server: ServerProcess):
    import openai

    with openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=60) as c:
        yield c


@pytest.fixture(scope="session")
def openai_schemas(request: pytest.FixtureRequest) -> OpenAISchemas | OpenAITypedModels:
    """OpenAI's published OpenAPI document where it is beside the repository (this project's CI
    keeps it in ../shared/reference; it is not copied into the repository), else the openai
    package's typed models, which are generated from it. The report says which."""
    if not OPENAI_SPEC.is_file():
        validator: OpenAISchemas | OpenAITypedModels = OpenAITypedModels()
    else:
        import yaml

        with open(OPENAI_SPEC, encoding="utf-8") as f:
            validator = OpenAISchemas(yaml.safe_load(f))
    request.config.stash[VALIDATED_AGAINST] = validator.source
    return validator


VALIDATED_AGAINST = pytest.StashKey[str]()


def pytest_terminal_summary(terminalreporter, exitstatus, config) -> None:
    source = config.stash.get(VALIDATED_AGAINST, None)
    if source is not None:
        terminalreporter.write_line(f"tests/server: responses validated against {source}")


@pytest.fixture(scope="session")
def flagged_server(start_server: Callable[..., ServerProcess], tiny_llama: str) -> ServerProcess:
    """A second server with vLLM's optional behaviours switched on (each test says which it reads)."""
    return start_server(tiny_llama, "--max-model-len", "512", "--served-model-name", "tiny-llama",
                        "--enable-prompt-tokens-details", "--enable-force-include-usage", "--max-logprobs", "-1",
                        "--metrics-prefix", "vllm", "--enable-prompt-embeds", "--enable-server-load-tracking",
                        "--enable-tokenizer-info-endpoint")
