"""Start the engine and uvicorn in one event loop; drain on SIGTERM; exit 0.

Order of start-up: bind the port (so a port in use fails before minutes of model loading), start
the engine core process (blocks until it is ready), then serve. On SIGTERM or SIGINT uvicorn
stops accepting connections, lets in-flight requests finish for ``--shutdown-timeout`` seconds,
cancels the rest (which aborts them in the engine), and we shut the engine core down.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import gc
import importlib.util
import os
import signal
import socket
import threading
from collections.abc import Coroutine, Iterator
from typing import Any

import uvicorn

from pagedlm.core import AsyncLLM, EngineClient
from pagedlm.core.engine.arg_utils import EngineArgs
from pagedlm.core.logger import init_logger
from pagedlm.server.app import build_app
from pagedlm.server.metrics import PREFIXES, PrometheusStatLogger
from pagedlm.server.serving_common import ServerState

logger = init_logger(__name__)


class _Server(uvicorn.Server):
    """uvicorn's server, minus re-raising the signal after a graceful shutdown.

    uvicorn re-sends SIGTERM to itself once it has drained, so the process would die by the
    signal (status 143). A drained server has done its job: we exit 0 instead.
    """

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        handled = (signal.SIGINT, signal.SIGTERM)
        previous = {sig: signal.signal(sig, self.handle_exit) for sig in handled}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)


def load_chat_template(value: str | None) -> str | None:
    """``--chat-template``: a file's contents, or the value itself if it is an inline template."""
    if value is None:
        return None
    if os.path.isfile(value):
        with open(value, encoding="utf-8") as f:
            return f.read()
    if "{{" in value or "{%" in value:
        return value
    raise ValueError(f"--chat-template={value!r} is neither a readable file nor a Jinja template")


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # IPPROTO_TCP, not the default 0: asyncio sets TCP_NODELAY on accepted connections only when
    # the socket says it is TCP, and without it Nagle's algorithm holds small responses back for
    # the client's delayed ACK (~40 ms each).
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise ValueError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    sock.set_inheritable(True)
    return sock


def serve(args: argparse.Namespace, *, api_key: str | None) -> int:
    chat_template = load_chat_template(args.chat_template)
    engine_args = EngineArgs.from_cli_args(args)
    sock = _bind(args.host, args.port)
    try:
        return _run_event_loop(_serve(args, engine_args, sock, api_key, chat_template))
    finally:
        sock.close()


def _run_event_loop(main: Coroutine[Any, Any, int]) -> int:
    """Run ``main`` on uvloop when it is installed (as vLLM's server does; its loop and
    httptools, which uvicorn then picks, cost less per streamed chunk), else on asyncio's loop."""
    # (said at start-up: a server without them streams at a higher CPU cost per chunk)
    http = "httptools" if importlib.util.find_spec("httptools") is not None else "h11 (httptools is not installed)"
    try:
        import uvloop
    except ImportError:
        logger.info("API process: asyncio's event loop (uvloop is not installed), HTTP parser %s", http)
        return asyncio.run(main)
    logger.info("API process: uvloop event loop, HTTP parser %s", http)
    return uvloop.run(main)


def _tool_and_reasoning_parsers(args: argparse.Namespace, engine: AsyncLLM) -> dict[str, Any]:
    """The ServerState fields of --enable-auto-tool-choice/--tool-call-parser and --reasoning-parser."""
    fields: dict[str, Any] = {}
    if args.tool_call_parser:
        from pagedlm.server.tool_parsers import get_tool_parser

        fields["tool_parser_class"] = get_tool_parser(args.tool_call_parser)
        if args.enable_auto_tool_choice:
            fields["tool_call_parser"] = args.tool_call_parser
    reasoning = engine.vllm_config.structured_outputs_config.reasoning_parser
    if reasoning:
        from pagedlm.core.reasoning import get_reasoning_parser

        fields["reasoning_parser"] = get_reasoning_parser(reasoning)(engine.tokenizer)
    return fields


def start_engine(args: argparse.Namespace, engine_args: EngineArgs) -> tuple[EngineClient, PrometheusStatLogger]:
    """The engine (its core process ready) and the Prometheus logger it reports to, as
    ``pagedlm serve`` and ``pagedlm run-batch`` start them."""
    vllm_config = engine_args.create_vllm_config()
    cache_config = {f.name: getattr(vllm_config.cache_config, f.name)
                    for f in dataclasses.fields(vllm_config.cache_config)}
    metrics = PrometheusStatLogger(vllm_config.model_config.name, prefix=PREFIXES[args.metrics_prefix],
                                   max_model_len=vllm_config.max_model_len, cache_config=cache_config)
    # Blocking start-up is fine here: nothing else runs on this loop yet.
    engine: EngineClient = AsyncLLM(vllm_config, stat_loggers=[metrics], log_interval_s=args.log_stats_interval,
                                    log_stats=args.log_stats_interval > 0)
    try:
        metrics.set_num_gpu_blocks(engine.num_gpu_blocks)
    except BaseException:
        engine.shutdown()
        raise
    return engine, metrics


async def build_state(args: argparse.Namespace, engine: EngineClient, metrics: PrometheusStatLogger,
                      api_key: str | None, chat_template: str | None) -> ServerState:
    """What the routes need (``ServerState``) from the server options; LoRA modules loaded."""
    vllm_config = engine.vllm_config
    name = vllm_config.model_config.name
    max_sequences = args.max_request_sequences or vllm_config.scheduler_config.max_num_seqs
    state = ServerState(engine=engine, served_model_names=[name], api_key=api_key, chat_template=chat_template,
                        metrics=metrics, max_request_sequences=max_sequences,
                        enable_prompt_tokens_details=args.enable_prompt_tokens_details,
                        enable_force_include_usage=args.enable_force_include_usage,
                        max_logprobs=args.max_logprobs,
                        enable_tokenizer_info_endpoint=args.enable_tokenizer_info_endpoint,
                        enable_server_load_tracking=args.enable_server_load_tracking,
                        return_tokens_as_token_ids=args.return_tokens_as_token_ids,
                        **_tool_and_reasoning_parsers(args, engine))
    if vllm_config.lora_config is not None:
        from pagedlm.core import envs
        from pagedlm.server.lora import LoRAModels

        dynamic = bool(getattr(args, "enable_dynamic_lora", False)) or envs.allow_runtime_lora_updating()
        state.lora = LoRAModels(engine, name, allow_runtime_updates=dynamic)
        for lora_name, path, base in getattr(args, "lora_modules", None) or ():
            await state.lora.add(lora_name, path, base)  # ValueError (the CLI prints it) for a bad one
    return state


async def _serve(args: argparse.Namespace, engine_args: EngineArgs, sock: socket.socket, api_key: str | None,
                 chat_template: str | None) -> int:
    engine, metrics = start_engine(args, engine_args)
    name = engine.vllm_config.model_config.name
    try:
        state = await build_state(args, engine, metrics, api_key, chat_template)
        app = build_app(state)
        config = uvicorn.Config(app, log_level=args.uvicorn_log_level, access_log=args.access_log,
                                timeout_graceful_shutdown=args.shutdown_timeout, lifespan="off")
        server = _Server(config)
        # NOTE: what start-up allocated (torch, transformers, the app) lives as long as the server:
        # frozen out of the garbage collector's sight, its collections scan only what requests
        # allocate (serve_host_cost.py: they were a sixth of the API process's CPU under load).
        gc.collect()
        gc.freeze()
        host, port = sock.getsockname()[:2]
        logger.info("serving %s as %r on http://%s:%d (%s)", engine.model_config.model, name, host, port,
                    "API key required" if api_key else "no API key")
        await server.serve(sockets=[sock])
    finally:
        engine.shutdown()
    logger.info("server stopped")
    return 0
