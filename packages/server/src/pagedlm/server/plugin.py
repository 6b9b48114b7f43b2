"""pagedlm-server's hook implementations.

NOTE: only hook implementations live here; FastAPI, uvicorn and the engine are imported when
``pagedlm serve`` runs, not when the ``pagedlm`` command line loads its plugins.
"""

from __future__ import annotations

import argparse

from pagedlm.core.plugins import hookimpl


@hookimpl
def pagedlm_add_cli_commands(subparsers: argparse._SubParsersAction) -> None:
    from pagedlm.server.cli import add_run_batch_command, add_serve_command
    from pagedlm.server.disagg_proxy import add_disagg_proxy_command

    add_serve_command(subparsers)
    add_run_batch_command(subparsers)
    add_disagg_proxy_command(subparsers)


@hookimpl
def pagedlm_register_tool_parsers(register) -> None:
    parsers = "pagedlm.server.tool_parsers.parsers"
    register("hermes", f"{parsers}:HermesToolParser")
    # Qwen3 writes hermes' <tool_call>{"name", "arguments"}</tool_call> blocks
    register("qwen3", f"{parsers}:HermesToolParser")
    register("llama3_json", f"{parsers}:Llama3JsonToolParser")
    register("mistral", f"{parsers}:MistralToolParser")
