"""``pagedlm disagg-proxy``: one OpenAI endpoint over a prefill instance and a decode instance.

Each completion or chat request goes first to the prefill instance (``--prefill``, a
``pagedlm serve`` with ``kv_role="kv_producer"``) with ``max_tokens=1``, no stream and
``kv_transfer_params={"do_remote_decode": true}``; the ``kv_transfer_params`` of its response
(where its KV waits) go with the original request to the decode instance (``--decode``,
``kv_role="kv_consumer"``), whose response, streamed or not, is passed through unchanged.
An instance that does not answer within ``--timeout`` seconds fails the request with a 502 that
names it; an instance's own error response is passed through.

Only argparse here; the app (FastAPI, httpx) is in ``disagg_proxy_app``, imported when it runs.
"""

from __future__ import annotations

import argparse


def add_disagg_proxy_command(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("disagg-proxy", help="an OpenAI proxy for disaggregated prefill: prefill instance, "
                              "then decode instance", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prefill", required=True, metavar="URL", help="the prefill instance, e.g. http://127.0.0.1:8100")
    p.add_argument("--decode", required=True, metavar="URL", help="the decode instance, e.g. http://127.0.0.1:8200")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="TCP port (default: 8000)")
    p.add_argument("--timeout", type=float, default=60.0, metavar="SECONDS",
                   help="how long an instance may take to answer (to connect, and between two bytes of a stream)")
    p.set_defaults(func=run_disagg_proxy)


def run_disagg_proxy(args: argparse.Namespace) -> int:
    import uvicorn

    from pagedlm.server.disagg_proxy_app import build_proxy_app

    for name in ("prefill", "decode"):
        url = getattr(args, name)
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"--{name}={url!r} must be an http:// or https:// URL")
    if args.timeout <= 0:
        raise ValueError(f"--timeout={args.timeout} must be positive")
    app = build_proxy_app(args.prefill, args.decode, timeout_s=args.timeout)
    uvicorn.run(app, host=args.host, port=args.port, log_level="info")
    return 0
