"""Small helpers for starting ranks: addresses, ports, error text."""

from __future__ import annotations

import multiprocessing
import signal
import socket
import traceback
from typing import Any

# What a new rank process needs before it can unpickle its config and build a worker: loaded once
# by the fork server, so each rank starts in well under a second instead of importing torch and
# transformers again (seconds per process, and ranks start together on shared cores).
# (Unpickling a model's HF config imports transformers' auto classes, the heavy part.)
_PRELOAD = ["pagedlm.core.worker.worker", "transformers.configuration_utils", "transformers.activations",
            "transformers.models.auto.modeling_auto"]


def mp_context() -> Any:
    """The multiprocessing context for rank and replica processes.

    ``forkserver`` where available: children are forked from a clean, single-threaded server
    process that imported torch but never touched a device, which is as safe as ``spawn`` (a
    plain ``fork`` of the engine, with its threads and maybe a CUDA context, is not) and much
    faster to start. ``spawn`` elsewhere.
    """
    if "forkserver" in multiprocessing.get_all_start_methods():
        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload(_PRELOAD)
        return ctx
    return multiprocessing.get_context("spawn")


def get_open_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago (the rendezvous of torch.distributed binds it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def describe_exit(exitcode: int | None) -> str:
    if exitcode is None:
        return "still running"
    if exitcode < 0:
        try:
            return f"killed by {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"killed by signal {-exitcode}"
    return f"exit code {exitcode}"


def format_exception(exc: BaseException) -> str:
    return "".join(traceback.format_exception(type(exc), exc, exc.__traceback__)).rstrip()
