"""Helpers of the server tests: a `pagedlm serve` subprocess and OpenAI's schemas as validators.

Imported by tests/server/conftest.py and the test modules (a plain module, not a conftest, so
that tests can import names from it).
"""

from __future__ import annotations

import contextlib
import copy
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

API_KEY = "test-key"
ROOT = Path(__file__).resolve().parents[2]
# OpenAI's published OpenAPI description lives beside the repository, never inside it (licence).
OPENAI_SPEC = ROOT.parent / "shared" / "reference" / "openai-openapi.yaml"
STARTUP_TIMEOUT_S = 180.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """A `pagedlm serve` child process with its log in a file."""

    def __init__(self, model: str | None, log_path: Path, *args: str, api_key: str | None = API_KEY,
                 env: dict[str, str] | None = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.api_key = api_key
        self.log_path = log_path
        # no model: `pagedlm serve` serves the default model
        cmd = [sys.executable, "-m", "pagedlm.core.cli", "serve", *([model] if model else []), "--port", str(self.port),
               "--device", "cpu", "--dtype", "float32", "--log-stats-interval", "1", *args]
        if api_key:
            cmd += ["--api-key", api_key]
        self._log = open(log_path, "wb")  # noqa: SIM115 - closed in stop()
        # One intra-op thread: the engine core, the API process and the test client share the
        # machine (2 cores in CI); torch's default of one thread per core then oversubscribes
        # it and each engine step becomes tens of times slower.
        env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=env, cwd=str(ROOT))
        self.returncode: int | None = None

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_ready(self, timeout: float = STARTUP_TIMEOUT_S) -> None:
        import httpx

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode} during start-up:\n{self.log()[-4000:]}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            time.sleep(0.2)
        raise TimeoutError(f"server not ready after {timeout}s:\n{self.log()[-4000:]}")

    @property
    def engine_pid(self) -> int:
        m = re.search(r"engine core process (\d+) is ready", self.log())
        assert m, self.log()
        return int(m.group(1))

    def stop(self, timeout: float = 30.0) -> int:
        """SIGTERM, wait, SIGKILL if needed; returns the exit status."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self._log.close()
        self.returncode = self.proc.returncode
        return self.returncode

    def metrics(self) -> dict[str, float]:
        """``pagedlm:*`` samples from /metrics: name{labels} -> value (labels stripped but reason)."""
        import httpx

        text = httpx.get(self.url + "/metrics", headers=self.headers, timeout=10).text
        samples: dict[str, float] = {}
        for line in text.splitlines():
            if not line.startswith("pagedlm:"):
                continue
            name_labels, value = line.rsplit(" ", 1)
            name = name_labels.split("{", 1)[0]
            reason = re.search(r'finished_reason="(\w+)"', name_labels)
            bucket = re.search(r'le="([^"]+)"', name_labels)
            key = name + (f"[{reason.group(1)}]" if reason else "") + (f"[{bucket.group(1)}]" if bucket else "")
            samples[key] = float(value)
        return samples


# -- OpenAI's schemas ------------------------------------------------------------------------------
#: a completion stream chunk: OpenAI documents one shape for the completion object and its chunks,
#: but streams "finish_reason": null until a choice ends; only that field is relaxed, to what
#: OpenAI sends
COMPLETION_CHUNK = "CreateCompletionResponse(stream chunk)"


def _openapi30_nullable(node: Any) -> Any:
    """OpenAPI 3.0's ``nullable: true`` as JSON Schema (``anyOf [..., null]``).

    OpenAI's 3.1 document still marks some fields the 3.0 way (e.g. every choice field of a chat
    stream chunk); a JSON Schema validator ignores that keyword, so without this ``null`` —
    which OpenAI itself sends there — would be rejected.
    """
    if isinstance(node, list):
        return [_openapi30_nullable(x) for x in node]
    if not isinstance(node, dict):
        return node
    out = {k: _openapi30_nullable(v) for k, v in node.items() if k != "nullable"}
    if node.get("nullable") is True:
        return {"anyOf": [out, {"type": "null"}]}
    return out


class OpenAISchemas:
    """Validates bodies against ``components/schemas/NAME`` of OpenAI's document (draft 2020-12)."""

    BASE = "urn:openai-openapi"

    def __init__(self, spec: dict[str, Any]) -> None:
        from referencing import Registry
        from referencing.jsonschema import DRAFT202012

        self.spec = _openapi30_nullable(spec)
        self.registry = Registry().with_resource(self.BASE, DRAFT202012.create_resource(self.spec))

    source = "OpenAI's OpenAPI document"

    def schema(self, name: str) -> dict[str, Any]:
        if name == COMPLETION_CHUNK:
            schema = self.schema("CreateCompletionResponse")
            choice = schema["properties"]["choices"]["items"]["properties"]
            choice["finish_reason"] = {"anyOf": [choice["finish_reason"], {"type": "null"}]}
            return schema
        return copy.deepcopy(self.spec["components"]["schemas"][name])

    def validate(self, name: str, body: Any) -> None:
        """Raise ``jsonschema.ValidationError`` unless ``body`` fits ``components/schemas/name``."""
        import jsonschema

        jsonschema.Draft202012Validator(self._rebase(self.schema(name)), registry=self.registry).validate(body)

    def _rebase(self, node: Any) -> Any:
        # "#/components/..." in a schema taken out of the document must point back into it.
        if isinstance(node, list):
            return [self._rebase(x) for x in node]
        if isinstance(node, dict):
            return {k: (self.BASE + v if k == "$ref" and isinstance(v, str) and v.startswith("#")
                        else self._rebase(v)) for k, v in node.items()}
        return node


class OpenAITypedModels:
    """The same checks through the ``openai`` package's typed models (pydantic, generated from
    OpenAI's document), for a checkout without the document beside it. Looser than the document
    (extra fields are allowed, values are coerced), so CI validates against the document itself."""

    source = "the openai package's typed models"

    def validate(self, name: str, body: Any) -> None:
        """Raise ``pydantic.ValidationError`` unless ``body`` fits the type standing for ``name``."""
        from pydantic import TypeAdapter

        if name == COMPLETION_CHUNK:
            body = copy.deepcopy(body)
            for choice in body.get("choices", []):
                if choice.get("finish_reason") is None:
                    choice["finish_reason"] = "stop"  # the chunk-only null the document allows
            name = "CreateCompletionResponse"
        TypeAdapter(_typed_model(name)).validate_python(body, strict=False)


def _typed_model(name: str) -> Any:
    from typing import Literal

    import openai.types as types
    import openai.types.chat as chat
    import openai.types.responses as responses
    from openai.types.shared import ErrorObject
    from pydantic import BaseModel

    class ListModels(BaseModel):
        object: Literal["list"]
        data: list[types.Model]

    class ErrorResponse(BaseModel):
        error: ErrorObject

    models = {
        "ListModelsResponse": ListModels,
        "Model": types.Model,
        "CreateCompletionResponse": types.Completion,
        "CreateChatCompletionResponse": chat.ChatCompletion,
        "CreateChatCompletionStreamResponse": chat.ChatCompletionChunk,
        "ErrorResponse": ErrorResponse,
        "CreateEmbeddingResponse": types.CreateEmbeddingResponse,
        "Response": responses.Response,
        "ResponseStreamEvent": responses.ResponseStreamEvent,
    }
    if name not in models:
        raise KeyError(f"no openai typed model stands for {name!r}; known: {sorted(models)}")
    return models[name]
