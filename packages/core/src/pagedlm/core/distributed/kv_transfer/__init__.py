"""KV transfer: KV-cache connectors between the paged cache and something outside it.

A connector (vLLM V1's ``KVConnectorBase_V1`` shape, :mod:`.base`) has two halves built from one
``kv_transfer_config``: the scheduler half, in the engine core, decides which prompt blocks can be
loaded instead of computed and which finished requests' blocks are exported; the worker half, in
each worker, moves the bytes between the KV cache and the outside (files, a peer instance, host
memory). The halves talk only through ``SchedulerOutput.kv_connector_metadata`` (scheduler ->
worker) and ``ModelRunnerOutput.kv_connector_output`` (worker -> scheduler).

Built-in connectors (registered through ``pagedlm_register_kv_connectors`` like a plugin's):
``SharedStorageConnector`` (files by block hash), ``P2pConnector`` (disaggregated prefill between
two instances over ZMQ/TCP) and ``OffloadingConnector`` (a host-memory tier under the prefix
cache). Nothing here imports a connector until ``kv_transfer_config`` names it.
"""

from pagedlm.core.distributed.kv_transfer.config import KV_ROLES, KVTransferConfig

__all__ = ["KV_ROLES", "KVTransferConfig"]
