"""``pagedlm bench serve --launch-disagg``: a prefill and a decode ``pagedlm serve`` (P2pConnector)
behind ``pagedlm disagg-proxy``, on free loopback ports, with the engine options given.

The prefill instance starts first. With ``--gpu-memory-utilization`` and no explicit KV-cache
size, the decode instance gets the prefill instance's number of KV blocks
(``--num-gpu-blocks-override``): it shares the device, and the memory the first instance took
would otherwise count against its own share.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import urllib.request
from collections.abc import Callable
from typing import Any


def launch_disagg(engine_flags: list[str], start: Callable[[list[str], str], tuple[subprocess.Popen, str]],
                  free_port: Callable[[], int], kwargs: dict[str, Any]) -> tuple[list[subprocess.Popen], str]:
    """Start prefill, decode and proxy; returns (their processes, the proxy's URL).

    ``start(cmd_tail, what)`` runs ``python -m pagedlm.core.cli`` + ``cmd_tail`` and waits until it
    answers (``bench serve``'s launcher); ``kwargs`` are the engine options."""
    if kwargs.get("kv_transfer_config") is not None or kwargs.get("kv_offloading_size") is not None:
        raise ValueError("--launch-disagg sets kv_transfer_config itself; drop --kv-transfer-config / "
                         "--kv-offloading-size")
    procs: list[subprocess.Popen] = []
    try:
        prefill, prefill_url = start(["serve", *engine_flags, "--kv-transfer-config",
                                      _p2p("kv_producer", free_port())], "prefill instance")
        procs.append(prefill)
        decode_flags = list(engine_flags)
        if kwargs.get("num_gpu_blocks_override") is None and kwargs.get("kv_cache_memory_bytes") is None:
            decode_flags += ["--num-gpu-blocks-override", str(_num_gpu_blocks(prefill_url))]
        decode, decode_url = start(["serve", *decode_flags, "--kv-transfer-config", _p2p("kv_consumer", free_port())],
                                   "decode instance")
        procs.append(decode)
        proxy, proxy_url = start(["disagg-proxy", "--prefill", prefill_url, "--decode", decode_url], "disagg-proxy")
        procs.append(proxy)
    except BaseException:
        for proc in procs:
            proc.terminate()
        raise
    print(f"disaggregated: prefill {prefill_url}, decode {decode_url}, proxy {proxy_url}", file=sys.stderr)
    return procs, proxy_url


def _p2p(role: str, kv_port: int) -> str:
    return json.dumps({"kv_connector": "P2pConnector", "kv_role": role, "kv_port": kv_port})


def _num_gpu_blocks(base_url: str) -> int:
    with urllib.request.urlopen(base_url + "/metrics", timeout=10) as resp:
        text = resp.read().decode()
    m = re.search(r"^pagedlm:num_gpu_blocks\{[^}]*\} ([0-9.e+]+)$", text, re.MULTILINE)
    if m is None:
        raise ValueError(f"the prefill instance at {base_url} reports no pagedlm:num_gpu_blocks in /metrics")
    return int(float(m.group(1)))
