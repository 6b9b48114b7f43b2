"""The worker's side of KV transfer: building its connector half and running a step with it.

``Worker`` calls :func:`create_worker_connector` once the KV cache exists and, for every step,
:func:`execute_with_kv_connector` instead of the model runner's ``execute_model``: the connector
gets the step's metadata and loads before the forward, the attention layers call its per-layer
hooks during an eager forward (:func:`get_active_kv_connector`), and its saves and report
(``KVConnectorOutput``) follow the forward.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pagedlm.core.distributed.kv_transfer.base import (
    KVCacheInfo,
    KVConnectorBase_V1,
    KVConnectorOutput,
    KVConnectorRole,
)
from pagedlm.core.forward_context import ForwardContext

if TYPE_CHECKING:
    from pagedlm.core.config import VllmConfig
    from pagedlm.core.sched.output import SchedulerOutput

#: the connector of the step running in this process (None outside a step, or without one)
_active_connector: KVConnectorBase_V1 | None = None


def get_active_kv_connector() -> KVConnectorBase_V1 | None:
    """The worker connector half of the step in progress (what attention layers call), or None."""
    return _active_connector


def create_worker_connector(vllm_config: VllmConfig, model_runner: Any) -> KVConnectorBase_V1 | None:
    """The worker half of ``kv_transfer_config``'s connector, given the runner's allocated KV cache."""
    if vllm_config.kv_transfer_config is None:
        return None
    from pagedlm.core.distributed.kv_transfer.factory import create_kv_connector
    from pagedlm.core.distributed.kv_transfer.kv_layout import block_dim_of

    if model_runner.num_kv_cache_groups != 1:
        raise ValueError(f"kv_transfer_config needs a model with one KV-cache group (every layer full attention "
                         f"or one sliding window); this one has {model_runner.num_kv_cache_groups}")
    layers = model_runner.attention_layers
    kv_caches = {name: layer.kv_cache for name, layer in layers.items()}
    first = next(iter(layers.values()))
    block_dim = block_dim_of(model_runner.attn_backend, model_runner.block_size, first.num_kv_heads, first.head_size)
    num_blocks = int(first.kv_cache.shape[block_dim])
    info = KVCacheInfo(num_blocks=num_blocks, block_size=model_runner.block_size,
                       bytes_per_block=model_runner.kv_cache_bytes_per_block(), block_dim=block_dim)
    connector = create_kv_connector(vllm_config, KVConnectorRole.WORKER, info)
    assert connector is not None
    connector.register_kv_caches(kv_caches)
    return connector


def execute_with_kv_connector(connector: KVConnectorBase_V1, model_runner: Any, scheduler_output: SchedulerOutput,
                              non_block: bool) -> Any:
    """``model_runner.execute_model`` with the connector's loads before and saves after; the
    result carries the connector's report (``kv_connector_output``)."""
    global _active_connector
    meta = scheduler_output.kv_connector_metadata
    if meta is not None:
        connector.bind_connector_metadata(meta)
    # NOTE: the forward context proper (attention metadata) is built inside the runner's
    # forward; the loads here precede it and need none.
    connector.start_load_kv(ForwardContext(attn_metadata=None), idle=scheduler_output.total_num_scheduled_tokens == 0)
    _active_connector = connector
    try:
        output = model_runner.execute_model(scheduler_output, non_block=non_block)
    finally:
        _active_connector = None
    connector.wait_for_save()
    sending, recving = connector.get_finished(scheduler_output.finished_req_ids)
    report = KVConnectorOutput(finished_sending=set(sending or ()), finished_recving=set(recving or ()),
                               invalid_block_ids=set(connector.get_block_ids_with_load_errors()),
                               failed_recving=dict(connector.get_failed_loads()))
    connector.clear_connector_metadata()
    if not report.is_empty():
        output.kv_connector_output = report
    return output
