"""What the adapted vLLM tests import from vLLM's ``tests/utils.py`` and ``vllm.*``: written for
pagedlm (not copied), with the names and call shapes of vLLM's test helpers.

``RemoteOpenAIServer(model, args)`` starts ``pagedlm serve`` on a tiny random Llama checkpoint
(built once per session, byte-level BPE tokenizer with a chat template), serving it under the
model name the vLLM test asked for, so that requests naming that model work unchanged. vLLM
options pagedlm shares are passed through; the others are dropped (``DROPPED`` says which, and the
tests that depend on them are skipped with a reason).
"""

from __future__ import annotations

import atexit
import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
STARTUP_TIMEOUT_S = 240.0

#: vLLM options without a counterpart in `pagedlm serve`, dropped with their value (True) or alone
DROPPED = {
    "--port": True, "--host": True, "--disable-frontend-multiprocessing": False,
    "--tokenizer": True, "--chat-template": True, "--enable-per-request-metrics": False,
    "--gpu-memory-utilization": True, "--dtype": True, "--max-model-len": True, "--load-format": True,
}
#: the multimodal models vLLM's tests name: served by a tiny random LLaVA checkpoint instead
MULTIMODAL_MODELS = frozenset({"HuggingFaceTB/SmolVLM-256M-Instruct"})
_TINY: dict[str, str] = {}


def tiny_model_dir(model: str | None = None) -> str:
    """The tiny checkpoint a peer server serves for ``model`` (built on first use): a LLaVA for
    the multimodal models vLLM's tests name, else a Llama."""
    multimodal = model in MULTIMODAL_MODELS
    key = "llava" if multimodal else "dir"
    if key not in _TINY:
        from pagedlm.core.testing import make_tiny_checkpoint
        from pagedlm.core.testing.multimodal import make_tiny_llava_checkpoint

        out = Path(tempfile.mkdtemp(prefix="pagedlm-peer-"))
        atexit.register(shutil.rmtree, out, ignore_errors=True)
        _TINY[key] = (make_tiny_llava_checkpoint(out / "tiny-llava", max_position_embeddings=16384) if multimodal
                      else make_tiny_checkpoint(out / "tiny-llama", "llama", max_position_embeddings=16384))
    return _TINY[key]


def tiny_lora_dir() -> str:
    """A PEFT LoRA adapter of the tiny checkpoint (built on first use), served where vLLM's tests
    download one (zephyr-lora): made by the real ``peft``, with nonzero B so it changes outputs."""
    if "lora" not in _TINY:
        from pagedlm.core.testing.lora import make_peft_adapter

        _TINY["lora"] = make_peft_adapter(tiny_model_dir(), Path(tiny_model_dir()).parent / "tiny-lora")
    return _TINY["lora"]


def get_tokenizer(name: str | None = None, **_: Any):
    """vLLM's ``get_tokenizer``: the tokenizer of the tiny checkpoint served for ``name``."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir(name))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def translate_args(args: list[str]) -> tuple[list[str], int]:
    """vLLM CLI arguments -> (pagedlm's, max_model_len)."""
    out: list[str] = []
    max_model_len = 2048
    i = 0
    while i < len(args):
        arg = args[i]
        name, eq, inline = arg.partition("=")
        if name.startswith("--show-hidden-metrics"):
            i += 1
            continue
        if name == "--max-model-len":
            max_model_len = int(inline if eq else args[i + 1])
        if name in DROPPED:
            takes = DROPPED[name]
            i += 1
            if takes == "many":
                while i < len(args) and not args[i].startswith("--"):
                    i += 1
            elif takes and not eq:
                i += 1
            continue
        out.append(arg)
        i += 1
    return out, max_model_len


class RemoteOpenAIServer:
    """``with RemoteOpenAIServer(model, args) as server:`` a ready `pagedlm serve`, stopped on exit."""

    DUMMY_API_KEY = "token-abc123"

    def __init__(self, model: str, vllm_serve_args: list[str], *, env_dict: dict[str, str] | None = None,
                 seed: int | None = 0, auto_port: bool = True, max_wait_seconds: float | None = None,
                 **_: Any) -> None:
        args, max_model_len = translate_args(list(vllm_serve_args))
        self.model = model
        self.show_hidden_metrics = False
        self.port = _free_port()
        self.host = "127.0.0.1"
        api_key = None
        if "--api-key" in args:
            api_key = args[args.index("--api-key") + 1]
        self.api_key = api_key or self.DUMMY_API_KEY
        self.max_model_len = max_model_len
        if model in MULTIMODAL_MODELS:
            # pagedlm fetches http(s) images only from listed hosts (vLLM: from any); the tests'
            # images come from local_asset_server, on this machine
            args += ["--allowed-media-domains", "127.0.0.1"]
        cmd = [sys.executable, "-m", "pagedlm.core.cli", "serve", tiny_model_dir(model), "--served-model-name", model,
               "--port", str(self.port), "--device", "cpu", "--dtype", "float32",
               "--max-model-len", str(max_model_len), "--log-stats-interval", "0", "--metrics-prefix", "vllm",
               *args]
        if seed is not None and "--seed" not in args:
            cmd += ["--seed", str(seed)]
        self._log = tempfile.NamedTemporaryFile(prefix="pagedlm-peer-", suffix=".log", delete=False)  # noqa: SIM115
        env = {**os.environ, "OMP_NUM_THREADS": "1", **(env_dict or {})}
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=env, cwd=str(ROOT))
        self._wait_ready(max_wait_seconds or STARTUP_TIMEOUT_S)

    def log(self) -> str:
        return Path(self._log.name).read_text(errors="replace")

    def _wait_ready(self, timeout: float) -> None:
        import httpx

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"pagedlm serve exited with {self.proc.returncode}:\n{self.log()[-4000:]}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(self.url_for("health"), timeout=2).status_code == 200:
                    return
            time.sleep(0.2)
        self._stop()
        raise TimeoutError(f"pagedlm serve not ready after {timeout}s:\n{self.log()[-4000:]}")

    def _stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self._log.close()

    def __enter__(self) -> RemoteOpenAIServer:
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop()

    @property
    def url_root(self) -> str:
        return f"http://{self.host}:{self.port}"

    def url_for(self, *parts: str) -> str:
        return self.url_root + "/" + "/".join(parts)

    def get_client(self, **kwargs: Any):
        import openai

        kwargs.setdefault("timeout", 600)
        return openai.OpenAI(base_url=self.url_for("v1"), api_key=self.api_key, max_retries=0, **kwargs)

    def get_async_client(self, **kwargs: Any):
        import openai

        kwargs.setdefault("timeout", 600)
        return openai.AsyncOpenAI(base_url=self.url_for("v1"), api_key=self.api_key, max_retries=0, **kwargs)


def get_vocab_size(model_name: str | None = None) -> int:
    """The tiny checkpoint's vocabulary (for vLLM's ``ModelConfig(...).get_vocab_size()``)."""
    import json

    with open(Path(tiny_model_dir(model_name)) / "config.json") as f:
        config = json.load(f)
    return int(config.get("text_config", config)["vocab_size"])


class LocalAssetServer:
    """vLLM's ``local_asset_server``: the tests' media over HTTP from this machine. The assets
    are generated images under vLLM's file names (no download): ``url_for(name)``."""

    def __init__(self, names: list[str]) -> None:
        import functools
        import http.server
        import threading

        from PIL import Image

        self.root = Path(tempfile.mkdtemp(prefix="pagedlm-peer-assets-"))
        atexit.register(shutil.rmtree, self.root, ignore_errors=True)
        for i, name in enumerate(names):
            Image.new("RGB", (64, 48), (40 * i % 256, 120, 200)).save(self.root / name)
        handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(self.root))
        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self.port = self.httpd.server_address[1]
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def url_for(self, name: str) -> str:
        return f"http://127.0.0.1:{self.port}/{name}"

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
