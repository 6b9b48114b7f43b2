"""``pagedlm serve MODEL``: the command line of the server (added through a plugin hook).

Only argparse here: the heavy imports (FastAPI, uvicorn, torch through the engine) happen in
``launcher`` once the command actually runs, so ``pagedlm --help`` stays fast.
"""

from __future__ import annotations

import argparse
import os
import sys

from pagedlm.core.engine.arg_utils import EngineArgs

#: environment variable holding the API key when --api-key is not given
API_KEY_ENV = "PAGEDLM_API_KEY"


def add_serve_command(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "serve", help="serve a model over an OpenAI-compatible HTTP API",
        description="Serve MODEL (a local HF model directory or a GGUF file; with none, the default model, "
                    "as `pagedlm generate` does) over OpenAI's completions and chat API. Every engine option "
                    "of LLM(...) is accepted.",
    )
    add_server_options(p)
    p.set_defaults(func=run_serve)


def add_run_batch_command(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "run-batch", help="run a file of OpenAI batch requests (JSON lines) offline",
        description="Run every request of an OpenAI batch input file (one JSON object a line: custom_id, method, "
                    "url, body; url /v1/completions, /v1/chat/completions or /v1/embeddings) through the server's "
                    "own handlers, as vLLM's run-batch does, and write one result line per request, in order. "
                    "Every option of `pagedlm serve` is accepted.",
    )
    batch = p.add_argument_group("batch options")
    batch.add_argument("-i", "--input-file", required=True, metavar="PATH_OR_URL",
                       help="the batch input: a local file, or an http(s) URL")
    batch.add_argument("-o", "--output-file", required=True, metavar="PATH",
                       help="where the results go: one JSON line per request, in the input's order ('-': stdout)")
    batch.add_argument("--enable-metrics", action="store_true",
                       help="serve /metrics and /health on --host:--port while the batch runs")
    add_server_options(p)
    p.set_defaults(func=run_batch)


def add_server_options(p: argparse.ArgumentParser) -> None:
    """MODEL, the server options and every engine option (``pagedlm serve`` and ``run-batch``)."""
    p.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                   help="local HF model directory or .gguf file (same as --model; default: the default model, "
                        "Gemma 3 270M when pagedlm-models-gemma[default-model] is installed)")
    server = p.add_argument_group("server options")
    server.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)")
    server.add_argument("--port", type=int, default=8000, help="TCP port (default: 8000; 0 picks a free one)")
    server.add_argument("--api-key", default=None,
                        help=f"require 'Authorization: Bearer KEY' on /v1, /tokenize, /detokenize and /metrics "
                             f"(default: ${API_KEY_ENV}, else no key)")
    server.add_argument("--chat-template", default=None, metavar="FILE",
                        help="Jinja chat template file (or inline template) replacing the tokenizer's")
    server.add_argument("--max-request-sequences", type=int, default=None, metavar="N",
                        help="most sequences (prompts x n) one request may ask for; more is a 400 "
                             "(default: --max-num-seqs, what the engine runs at once)")
    server.add_argument("--enable-prompt-tokens-details", action="store_true",
                        help="put usage.prompt_tokens_details (cached_tokens: prompt tokens found in the prefix "
                             "cache) in every usage object, 0 included (vLLM's option; off: never)")
    server.add_argument("--enable-force-include-usage", action="store_true",
                        help="every stream carries usage on each chunk and in a last usage chunk, whatever its "
                             "stream_options (vLLM's option)")
    server.add_argument("--max-logprobs", type=int, default=20, metavar="N",
                        help="most logprobs per position a request may ask for (logprobs, top_logprobs, "
                             "prompt_logprobs; -1 in a request means the whole vocabulary); -1: no limit below the "
                             "vocabulary size (vLLM's option and default, 20)")
    server.add_argument("--metrics-prefix", choices=["pagedlm", "vllm"], default="pagedlm",
                        help="prefix of the /metrics series, vLLM's names after it: 'pagedlm' (pagedlm:...) or 'vllm' "
                             "(vllm:..., so that vLLM's Grafana dashboards and alerts work unchanged)")
    server.add_argument("--return-tokens-as-token-ids", action="store_true",
                        help="logprobs write every token as 'token_id:<id>' unless a request's "
                             "return_tokens_as_token_ids says otherwise (vLLM's option)")
    server.add_argument("--enable-auto-tool-choice", action="store_true",
                        help='let requests use tool_choice="auto" (the default with tools): the model decides, and '
                             "--tool-call-parser reads its calls (vLLM's option)")
    server.add_argument("--tool-call-parser", default=None, metavar="NAME",
                        help="how the model writes tool calls: hermes, qwen3, llama3_json, mistral or a plugin's "
                             "(pagedlm_register_tool_parsers)")
    server.add_argument("--enable-server-load-tracking", action="store_true",
                        help="count the generation requests in flight, which GET /load reports as server_load "
                             "(vLLM's option; off: always 0)")
    server.add_argument("--enable-tokenizer-info-endpoint", action="store_true",
                        help="serve GET /tokenizer_info: the tokenizer's configuration and chat template (vLLM's "
                             "option; off: a 404)")
    server.add_argument("--shutdown-timeout", type=float, default=30.0, metavar="SECONDS",
                        help="on SIGTERM, how long in-flight requests may run before they are aborted")
    server.add_argument("--log-stats-interval", type=float, default=5.0, metavar="SECONDS",
                        help="log a throughput/KV-usage line this often while busy (0: never)")
    server.add_argument("--uvicorn-log-level", default="info",
                        choices=["critical", "error", "warning", "info", "debug", "trace"])
    server.add_argument("--access-log", action=argparse.BooleanOptionalAction, default=True,
                        help="log every HTTP request (uvicorn's access log)")
    server.add_argument("--lora-modules", nargs="+", default=None, metavar="NAME=PATH",
                        help="LoRA adapters to serve (with --enable-lora), each as NAME=PATH or vLLM's JSON form "
                             "'{\"name\": ..., \"path\": ..., \"base_model_name\": ...}'; clients select one "
                             "with model=NAME")
    server.add_argument("--enable-dynamic-lora", action="store_true",
                        help="open POST /v1/load_lora_adapter and /v1/unload_lora_adapter (as vLLM's "
                             "VLLM_ALLOW_RUNTIME_LORA_UPDATING=True, which is also read)")
    EngineArgs.add_cli_args(p)


def resolve_api_key(args: argparse.Namespace) -> str | None:
    # NOTE: read here rather than in pagedlm.core.envs: the key is a server setting, and core
    # must not know about the server (DESIGN.md §2).
    return args.api_key or os.environ.get(API_KEY_ENV) or None


def run_serve(args: argparse.Namespace) -> int:
    check_server_args(args)
    from pagedlm.server.launcher import serve

    return serve(args, api_key=resolve_api_key(args))


def run_batch(args: argparse.Namespace) -> int:
    check_server_args(args)
    from pagedlm.server.run_batch import run_batch_file

    return run_batch_file(args)


def check_server_args(args: argparse.Namespace) -> None:
    """Resolves MODEL and checks the server options (``ValueError`` naming the bad one)."""
    if args.model_tag and args.model and args.model_tag != args.model:
        raise ValueError(f"MODEL={args.model_tag!r} and --model={args.model!r} disagree: give one of them")
    args.model = args.model_tag or args.model
    if not args.model:
        from pagedlm.core.default_model import resolve_default_model

        # ValueError (printed by the CLI): how to install the default model or pass MODEL
        args.model, offer = resolve_default_model()
        args.served_model_name = args.served_model_name or offer.served_name
        print(f"no MODEL given: serving the default model, {offer.name}, as "
              f"{args.served_model_name or args.model!r}", file=sys.stderr)
    if args.max_request_sequences is not None and args.max_request_sequences < 1:
        raise ValueError(f"--max-request-sequences={args.max_request_sequences} is invalid: must be >= 1")
    if args.max_logprobs < -1:
        raise ValueError(f"--max-logprobs={args.max_logprobs} is invalid: must be >= 0, or -1 (the vocabulary size)")
    if args.enable_auto_tool_choice and not args.tool_call_parser:
        raise ValueError("--enable-auto-tool-choice needs --tool-call-parser NAME (how the model writes tool calls: "
                         "hermes, qwen3, llama3_json, mistral)")
    if args.tool_call_parser:
        from pagedlm.server.tool_parsers import get_tool_parser

        get_tool_parser(args.tool_call_parser)  # a bad name fails here, not with the first request
    if not 0 <= args.port < 65536:
        raise ValueError(f"--port={args.port} is invalid: must be in 0..65535 (0: any free port)")
    if (args.lora_modules or args.enable_dynamic_lora) and not args.enable_lora:
        raise ValueError("--lora-modules and --enable-dynamic-lora need --enable-lora")
    from pagedlm.server.lora import parse_lora_modules

    args.lora_modules = parse_lora_modules(args.lora_modules)  # ValueError for a malformed entry
