"""``P2pConnector``: disaggregated prefill between two running instances, over ZMQ/TCP.

The prefill instance (``kv_role="kv_producer"``) gets each request with
``kv_transfer_params={"do_remote_decode": true}`` and ``max_tokens=1``; when the request
finishes, it keeps the request's full prompt blocks allocated and serves them on
``tcp://kv_ip:kv_port`` until they are pulled (or their lease runs out); the response's
``kv_transfer_params`` say where they are (``remote_host``, ``remote_port``,
``remote_request_id``, ``remote_num_blocks``, ...). The decode instance (``kv_role="kv_consumer"``)
gets the same prompt with those ``kv_transfer_params`` (``do_remote_prefill``) and pulls the
blocks after its own prefix-cache hit into its paged cache, then computes only the rest (the last
block at least).

NOTE: the copies (device -> host on the producer, host -> device on the consumer) and the socket
run on threads of their own, on a CUDA stream of their own that waits for the engine's work
queued before (``kv_layout.SideStream``): the engines' step loops never wait for a transfer.
``pagedlm disagg-proxy`` does the two calls for an OpenAI client.

Failure: blocks the producer no longer holds, or whose hashes differ (another prompt), are
recomputed (``kv_load_failure_policy="recompute"``) or fail the request (``"fail"``); a producer
that gives no answer within ``transfer_timeout_s`` fails the request with that reason.

``kv_connector_extra_config``: ``kv_lease_s`` (how long a producer keeps unpulled blocks, default
120 s), ``transfer_timeout_s`` (default 10 s), ``unknown_grace_s`` (how long a pull waits for KV
the producer has not exported yet, default 2 s).
"""

from __future__ import annotations

import concurrent.futures
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pagedlm.core.distributed.kv_transfer.base import KVCacheInfo, KVConnectorRole
from pagedlm.core.distributed.kv_transfer.block_transfer import BlockExport, BlockLoad, BlockTransferConnector
from pagedlm.core.logger import init_logger

if TYPE_CHECKING:
    import torch

    from pagedlm.core.config import VllmConfig
    from pagedlm.core.request import Request

logger = init_logger(__name__)

_IDLE_WAIT_S = 0.005


@dataclass
class _Held:
    block_ids: list[int]
    block_hashes: list[str]
    #: the engine stream's work at export time (the forward that wrote the blocks)
    mark: Any
    expires_at: float


def _params(request: Request) -> dict[str, Any]:
    extra = request.sampling_params.extra_args or {}
    params = extra.get("kv_transfer_params")
    return params if isinstance(params, dict) else {}


def _remote_source(params: dict[str, Any]) -> dict[str, Any] | None:
    """Where the producer serves the request's KV, from its kv_transfer_params; None when they
    do not say it properly (the request then computes its prompt)."""
    host, port = params.get("remote_host"), params.get("remote_port")
    request_id, num_blocks = params.get("remote_request_id"), params.get("remote_num_blocks", 0)
    if not isinstance(host, str) or not host or any(c in host for c in "/ :") and not host.startswith("["):
        return None
    if isinstance(port, bool) or not isinstance(port, int) or not 0 < port < 65536:
        return None
    if not isinstance(request_id, str | int) or isinstance(request_id, bool):
        return None
    if isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or num_blocks < 0:
        return None
    return {"address": f"tcp://{host}:{port}", "request_id": str(request_id), "num_blocks": num_blocks}


def _positive(cfg: Any, key: str, default: float) -> float:
    value = cfg.get_from_extra_config(key, default)
    if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
        raise ValueError(f"P2pConnector: kv_connector_extra_config.{key}={value!r} must be a positive number")
    return float(value)


class P2pConnector(BlockTransferConnector):
    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheInfo) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        cfg = self._kv_transfer_config
        self.lease_s = _positive(cfg, "kv_lease_s", 120.0)
        self.timeout_s = _positive(cfg, "transfer_timeout_s", 10.0)
        self.unknown_grace_s = _positive(cfg, "unknown_grace_s", 2.0)
        if cfg.is_kv_producer and cfg.kv_port == 0:
            raise ValueError("P2pConnector: a producer needs a fixed kv_transfer_config.kv_port (its address goes "
                             "into each response's kv_transfer_params)")
        # scheduler half: requests whose remote KV was asked for (once: after a preemption they recompute)
        self._pulled: set[str] = set()
        # worker half
        self._server: Any = None
        self._side: Any = None
        self._fetcher: concurrent.futures.ThreadPoolExecutor | None = None
        self._fetches: dict[concurrent.futures.Future, BlockLoad] = {}
        self._failed: dict[str, str] = {}
        #: producer: finished requests' blocks waiting to be pulled; requests pulled (or expired)
        self._held: dict[str, _Held] = {}
        self._sent: set[str] = set()
        self._lock = threading.Lock()
        #: set by the server and pull threads when they finish something (the idle wait ends)
        self._wake = threading.Event()

    # -- scheduler half ------------------------------------------------------------------------
    def _count_available(self, request: Request, first: int, limit: int) -> int:
        params = _params(request)
        if not params.get("do_remote_prefill") or request.request_id in self._pulled:
            return 0
        source = _remote_source(params)
        if source is None:
            logger.warning("request %s: kv_transfer_params %r do not name a producer (remote_host, remote_port, "
                           "remote_request_id, remote_num_blocks); computing its prompt here", request.request_id,
                           params)
            return 0
        if params.get("remote_block_size", self.block_size) != self.block_size:
            logger.warning("request %s: the producer's block_size %s differs from this instance's %d; computing its "
                           "prompt here", request.request_id, params.get("remote_block_size"), self.block_size)
            return 0
        return max(min(source["num_blocks"], limit) - first, 0)

    def _load_source(self, request: Request) -> dict[str, Any] | None:
        self._pulled.add(request.request_id)
        return _remote_source(_params(request))

    def _export_indices(self, request: Request, num_full_blocks: int) -> list[int]:
        return list(range(num_full_blocks)) if _params(request).get("do_remote_decode") else []

    def _transfer_params(self, request: Request, num_full_blocks: int) -> dict[str, Any] | None:
        self._pulled.discard(request.request_id)
        if not _params(request).get("do_remote_decode"):
            return None
        cfg = self._kv_transfer_config
        return {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": cfg.engine_id,
                "remote_host": cfg.kv_ip, "remote_port": cfg.kv_port, "remote_request_id": request.request_id,
                "remote_num_blocks": num_full_blocks, "remote_block_size": self.block_size}

    # -- worker half ---------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        from pagedlm.core.distributed.kv_transfer.kv_layout import SideStream

        super().register_kv_caches(kv_caches)
        assert self._io is not None
        self._side = SideStream(self._io.device)
        cfg = self._kv_transfer_config
        if cfg.is_kv_producer:
            from pagedlm.core.distributed.kv_transfer.p2p_transport import KVBlockServer

            self._server = KVBlockServer(cfg.kv_ip, cfg.kv_port, self._serve_pull, self.fingerprint,
                                         self._io.bytes_per_block)
            logger.info("P2P KV connector: serving finished requests' KV on %s", self._server.address)
        if cfg.is_kv_consumer:
            self._fetcher = concurrent.futures.ThreadPoolExecutor(max_workers=4, thread_name_prefix="pagedlm-kv-pull")

    # producer: blocks stay in the paged cache until pulled
    def _export(self, export: BlockExport) -> None:
        with self._lock:
            self._held[export.req_id] = _Held(export.block_ids, [h.hex() for h in export.block_hashes],
                                              self._side.mark(), time.monotonic() + self.lease_s)

    def _serve_pull(self, request_id: str, wanted: list[str]) -> torch.Tensor | None:
        """(server thread) The held blocks of ``request_id`` that match ``wanted``, as records;
        the request's blocks are released either way."""
        from pagedlm.core.distributed.kv_transfer.p2p_transport import matching_prefix

        with self._lock:
            held = self._held.pop(request_id, None)
        if held is None:
            return None
        assert self._io is not None
        try:
            start, count = matching_prefix(held.block_hashes, wanted)
            with self._side.after(held.mark):
                return self._io.gather(held.block_ids[start:start + count])
        finally:
            with self._lock:
                self._sent.add(request_id)
            self._wake.set()

    # consumer: pull into the blocks on a thread
    def _load(self, load: BlockLoad) -> None:
        assert self._fetcher is not None and load.source is not None
        future = self._fetcher.submit(self._pull_into_blocks, load, self._side.mark())
        future.add_done_callback(lambda _: self._wake.set())
        self._fetches[future] = load

    def _pull_into_blocks(self, load: BlockLoad, mark: Any) -> int:
        """(pull thread) Fetch the load's blocks and write those that came; returns how many."""
        from pagedlm.core.distributed.kv_transfer.p2p_transport import pull_blocks

        assert self._io is not None and load.source is not None
        records = pull_blocks(load.source["address"], load.source["request_id"], self.fingerprint,
                              load.block_hashes, self._io.bytes_per_block, timeout_s=self.timeout_s,
                              unknown_grace_s=self.unknown_grace_s)
        num_blocks = int(records.shape[0])
        if num_blocks:
            # NOTE: after ``mark``: an earlier step still in flight may write the blocks' previous owner's KV
            with self._side.after(mark):
                self._io.scatter(load.block_ids[:num_blocks], records)
        return num_blocks

    def _poll(self, idle: bool) -> None:
        from pagedlm.core.distributed.kv_transfer.p2p_transport import PullError

        now = time.monotonic()
        with self._lock:
            for req_id in [r for r, h in self._held.items() if h.expires_at <= now]:
                del self._held[req_id]
                self._sent.add(req_id)
                logger.warning("request %s: its KV was not pulled within kv_lease_s=%gs; released", req_id,
                               self.lease_s)
            waiting = bool(self._held) and not self._sent
        if idle and (waiting or self._fetches) and not any(f.done() for f in self._fetches):
            # nothing else to run this step: wait a little for a transfer instead of spinning empty steps
            self._wake.wait(_IDLE_WAIT_S)
        self._wake.clear()
        for future in [f for f in self._fetches if f.done()]:
            load = self._fetches.pop(future)
            try:
                num_blocks = future.result()
            except PullError as e:
                self._failed[load.req_id] = f"KV transfer failed: {e}"
                num_blocks = 0
            else:
                if num_blocks < len(load.block_ids):
                    logger.warning("request %s: the producer sent %d of %d KV blocks; the rest are recomputed",
                                   load.req_id, num_blocks, len(load.block_ids))
            self._invalid_block_ids.update(load.block_ids[num_blocks:])
            self._done_recving.add(load.req_id)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        with self._lock:
            self._done_sending |= self._sent
            self._sent = set()
        return super().get_finished(finished_req_ids)

    def get_failed_loads(self) -> dict[str, str]:
        failed, self._failed = self._failed, {}
        return failed

    def shutdown(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None
        if self._fetcher is not None:
            self._fetcher.shutdown(wait=False, cancel_futures=True)
            self._fetcher = None
