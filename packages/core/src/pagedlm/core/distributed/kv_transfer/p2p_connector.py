"""``P2pConnector``: disaggregated prefill between two running instances, over ZMQ/TCP.

The prefill instance (``kv_role="kv_producer"``) gets each request with
``kv_transfer_params={"do_remote_decode": true}`` and ``max_tokens=1``; when the request
finishes, its full prompt blocks are copied to a host buffer, served on
``tcp://kv_ip:kv_port``, and the response's ``kv_transfer_params`` say where they are
(``remote_host``, ``remote_port``, ``remote_request_id``, ``remote_num_blocks``, ...). The decode
instance (``kv_role="kv_consumer"``) gets the same prompt with those ``kv_transfer_params``
(``do_remote_prefill``), pulls the blocks after its own prefix-cache hit into its paged cache in
the background, and computes only the rest (the last block at least).
``pagedlm disagg-proxy`` does the two calls for an OpenAI client.

Failure: blocks the producer no longer holds, or whose hashes differ (another prompt), are
recomputed (``kv_load_failure_policy="recompute"``) or fail the request (``"fail"``); a producer
that gives no answer within ``transfer_timeout_s`` fails the request with that reason.

``kv_connector_extra_config``: ``kv_buffer_size`` (bytes of host memory for unpulled KV, default
4 GiB), ``kv_lease_s`` (how long unpulled KV is kept, default 120 s), ``transfer_timeout_s``
(default 10 s), ``unknown_grace_s`` (how long a pull waits for KV the producer has not exported
yet, default 2 s).
"""

from __future__ import annotations

import concurrent.futures
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


def _params(request: Request) -> dict[str, Any]:
    extra = request.sampling_params.extra_args or {}
    params = extra.get("kv_transfer_params")
    return params if isinstance(params, dict) else {}


def _positive(cfg: Any, key: str, default: float) -> float:
    value = cfg.get_from_extra_config(key, default)
    if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
        raise ValueError(f"P2pConnector: kv_connector_extra_config.{key}={value!r} must be a positive number")
    return float(value)


class P2pConnector(BlockTransferConnector):
    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheInfo) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        cfg = self._kv_transfer_config
        self.buffer_bytes = int(_positive(cfg, "kv_buffer_size", 4 * 2**30))
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
        self._fetcher: concurrent.futures.ThreadPoolExecutor | None = None
        self._fetches: dict[concurrent.futures.Future, BlockLoad] = {}
        self._failed: dict[str, str] = {}

    # -- scheduler half ------------------------------------------------------------------------
    def _count_available(self, request: Request, first: int, limit: int) -> int:
        params = _params(request)
        if not params.get("do_remote_prefill") or request.request_id in self._pulled:
            return 0
        for key in ("remote_host", "remote_port", "remote_request_id"):
            if params.get(key) is None:
                logger.warning("request %s: kv_transfer_params lack %r; computing its prompt here",
                               request.request_id, key)
                return 0
        if params.get("remote_block_size", self.block_size) != self.block_size:
            logger.warning("request %s: the producer's block_size %s differs from this instance's %d; computing its "
                           "prompt here", request.request_id, params.get("remote_block_size"), self.block_size)
            return 0
        remote = int(params.get("remote_num_blocks", limit))
        return max(min(remote, limit) - first, 0)

    def _load_source(self, request: Request) -> dict[str, Any]:
        params = _params(request)
        self._pulled.add(request.request_id)
        return {"address": f"tcp://{params['remote_host']}:{int(params['remote_port'])}",
                "request_id": str(params["remote_request_id"])}

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
        super().register_kv_caches(kv_caches)
        cfg = self._kv_transfer_config
        if cfg.is_kv_producer:
            from pagedlm.core.distributed.kv_transfer.p2p_transport import HostKVBuffer, KVBlockServer

            assert self._io is not None
            self._server = KVBlockServer(cfg.kv_ip, cfg.kv_port, HostKVBuffer(self.buffer_bytes, self.lease_s),
                                         self.fingerprint, self._io.bytes_per_block)
            logger.info("P2P KV connector: serving finished requests' KV on %s", self._server.address)
        if cfg.is_kv_consumer:
            self._fetcher = concurrent.futures.ThreadPoolExecutor(max_workers=4, thread_name_prefix="pagedlm-kv-pull")

    def _store(self, export: BlockExport, records: torch.Tensor) -> None:
        assert self._server is not None
        self._server.buffer.put(export.req_id, export.block_hashes, records)

    def _load(self, load: BlockLoad) -> None:
        from pagedlm.core.distributed.kv_transfer.p2p_transport import pull_blocks

        assert self._fetcher is not None and self._io is not None and load.source is not None
        future = self._fetcher.submit(pull_blocks, load.source["address"], load.source["request_id"],
                                      self.fingerprint, load.block_hashes, self._io.bytes_per_block,
                                      timeout_s=self.timeout_s, unknown_grace_s=self.unknown_grace_s)
        self._fetches[future] = load

    def _poll(self, idle: bool) -> None:
        if not self._fetches:
            return
        from pagedlm.core.distributed.kv_transfer.p2p_transport import PullError

        if idle:  # nothing else to run this step: wait a little instead of spinning empty steps
            concurrent.futures.wait(list(self._fetches), timeout=_IDLE_WAIT_S,
                                    return_when=concurrent.futures.FIRST_COMPLETED)
        for future in [f for f in self._fetches if f.done()]:
            load = self._fetches.pop(future)
            try:
                records = future.result()
            except PullError as e:
                self._failed[load.req_id] = f"KV transfer failed: {e}"
                self._finish_load(load, None, 0)
                continue
            if records.shape[0] < len(load.block_ids):
                logger.warning("request %s: the producer sent %d of %d KV blocks; the rest are recomputed",
                               load.req_id, records.shape[0], len(load.block_ids))
            self._finish_load(load, records, int(records.shape[0]))

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
