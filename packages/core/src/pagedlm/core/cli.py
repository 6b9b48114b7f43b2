"""The ``pagedlm`` command line. Plugins add subcommands through ``pagedlm_add_cli_commands``."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence


def _add_generate(subparsers: argparse._SubParsersAction) -> None:
    from pagedlm.core.engine.arg_utils import EngineArgs

    p = subparsers.add_parser("generate", help="generate text offline for one or more prompts",
                              formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("prompts", nargs="+", help="prompt text (one or more)")
    p.add_argument("--max-tokens", type=int, default=64, help="tokens to generate per prompt at most")
    p.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (0: greedy)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling: smallest set of this probability")
    p.add_argument("--top-k", type=int, default=-1, help="sample among the k most likely tokens (-1: all)")
    p.add_argument("--sampling-seed", type=int, default=None, help="per-request sampling seed")
    p.add_argument("--stream", action=argparse.BooleanOptionalAction, default=True,
                   help="print text as it is generated (--no-stream: each prompt's text once it is done)")
    EngineArgs.add_cli_args(p)
    p.set_defaults(func=_run_generate)


def _run_generate(args: argparse.Namespace) -> int:
    from pagedlm.core import LLM, SamplingParams
    from pagedlm.core.engine.arg_utils import EngineArgs

    engine_args = EngineArgs.from_cli_args(args)
    if engine_args.model is None:
        from pagedlm.core.default_model import resolve_default_model

        engine_args.model, offer = resolve_default_model()  # ValueError: how to install one or pass --model
        engine_args.served_model_name = engine_args.served_model_name or offer.served_name
        print(f"model: {offer.name}, the default model ({engine_args.model})", file=sys.stderr)
    else:
        print(f"model: {engine_args.model}", file=sys.stderr)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, seed=args.sampling_seed)
    llm = LLM(**vars(engine_args))
    for prompt, text_pieces in llm.generate_streamed(list(args.prompts), params, stream=args.stream):
        print(f"--- prompt: {prompt!r}", flush=True)
        for piece in text_pieces:
            print(piece, end="", flush=True)
        print(flush=True)
    return 0


def _add_demo(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "demo", help="build a tiny random Llama checkpoint and generate from it (no downloads needed)"
    )
    p.add_argument("--dir", default=None, help="where to build the checkpoint (default: the pagedlm cache)")
    p.set_defaults(func=_run_demo)


def _run_demo(args: argparse.Namespace) -> int:
    from pagedlm.core import LLM, SamplingParams, envs
    from pagedlm.core.testing import make_tiny_checkpoint

    model_dir = args.dir or os.path.join(envs.cache_root(), "demo-tiny-llama")
    if not os.path.isfile(os.path.join(model_dir, "config.json")):
        make_tiny_checkpoint(model_dir, "llama")
    print(f"model: tiny random Llama built by pagedlm at {model_dir} (its text is gibberish by design)")
    llm = LLM(model=model_dir, dtype="float32")
    prompts = ["The quick brown fox", "def fibonacci(n):", "Paged attention stores"]
    outputs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=16))
    for output in outputs:
        completion = output.outputs[0]
        print(f"{output.prompt!r} -> {completion.text!r} ({len(completion.token_ids)} tokens, "
              f"{completion.finish_reason})")
    return 0


def _add_bench(subparsers: argparse._SubParsersAction) -> None:
    from pagedlm.core.bench import add_bench_parser

    add_bench_parser(subparsers)


def build_parser() -> argparse.ArgumentParser:
    from pagedlm.core.plugins import get_plugins

    parser = argparse.ArgumentParser(prog="pagedlm", description="pagedlm: paged-KV-cache LLM inference")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    _add_generate(subparsers)
    _add_demo(subparsers)
    _add_bench(subparsers)
    get_plugins().add_cli_commands(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
