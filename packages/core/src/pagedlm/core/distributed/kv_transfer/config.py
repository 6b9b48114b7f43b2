"""``KVTransferConfig``: which KV connector an engine runs and in which role (vLLM's names)."""

from __future__ import annotations

import dataclasses
import json
import uuid
from dataclasses import dataclass, field
from typing import Any

from pagedlm.core.platforms import HOST

#: ``kv_role`` values: a producer exports its requests' KV, a consumer loads KV, both do both
KV_ROLES = ("kv_producer", "kv_consumer", "kv_both")


@dataclass
class KVTransferConfig:
    """``LLM(kv_transfer_config={...})`` / ``--kv-transfer-config JSON``.

    ``kv_connector`` names a registered connector (``pagedlm_register_kv_connectors``);
    ``kv_connector_extra_config`` holds that connector's own options (each connector documents
    and checks its keys). ``engine_id`` names this instance to its peers (random by default).
    """

    kv_connector: str | None = None
    kv_role: str | None = None
    kv_connector_extra_config: dict[str, Any] = field(default_factory=dict)
    engine_id: str = ""
    #: vLLM's fields for connectors that talk to a peer: this instance's address for them
    kv_ip: str = "127.0.0.1"
    kv_port: int = 14579
    #: vLLM's ``kv_buffer_device``; pagedlm's connectors stage through host memory ("cpu")
    kv_buffer_device: str = HOST.type
    #: a KV block that cannot be loaded: ``"recompute"`` it (the request goes on from the last good
    #: block) or ``"fail"`` the request with the reason
    kv_load_failure_policy: str = "recompute"
    #: vLLM's way to name a connector class outside the registry: ``"package.module"`` holding a
    #: class called ``kv_connector``
    kv_connector_module_path: str | None = None

    def __post_init__(self) -> None:
        if not self.kv_connector or not isinstance(self.kv_connector, str):
            raise ValueError(f"kv_transfer_config.kv_connector={self.kv_connector!r} is invalid: name a registered "
                             "KV connector (e.g. 'SharedStorageConnector', 'P2pConnector', 'OffloadingConnector')")
        if self.kv_role is None:
            self.kv_role = "kv_both"
        if self.kv_role not in KV_ROLES:
            raise ValueError(f"kv_transfer_config.kv_role={self.kv_role!r} is invalid; allowed: {', '.join(KV_ROLES)}")
        if not isinstance(self.kv_connector_extra_config, dict):
            raise ValueError(f"kv_transfer_config.kv_connector_extra_config={self.kv_connector_extra_config!r} "
                             "must be a JSON object")
        if not isinstance(self.kv_port, int) or not 0 <= self.kv_port < 65536:
            raise ValueError(f"kv_transfer_config.kv_port={self.kv_port!r} must be a TCP port (0..65535)")
        if self.kv_buffer_device != HOST.type:
            raise ValueError(f"kv_transfer_config.kv_buffer_device={self.kv_buffer_device!r} is not supported; "
                             "pagedlm's connectors stage KV in host memory: 'cpu'")
        if self.kv_load_failure_policy not in ("recompute", "fail"):
            raise ValueError(f"kv_transfer_config.kv_load_failure_policy={self.kv_load_failure_policy!r} is "
                             "invalid; allowed: recompute, fail")
        if not self.engine_id:
            self.engine_id = uuid.uuid4().hex

    @property
    def is_kv_producer(self) -> bool:
        return self.kv_role in ("kv_producer", "kv_both")

    @property
    def is_kv_consumer(self) -> bool:
        return self.kv_role in ("kv_consumer", "kv_both")

    def get_from_extra_config(self, key: str, default: Any) -> Any:
        return self.kv_connector_extra_config.get(key, default)

    @classmethod
    def from_any(cls, value: KVTransferConfig | dict[str, Any] | str | None) -> KVTransferConfig | None:
        """A config from a ``KVTransferConfig``, a dict of its fields, a JSON object string, or None."""
        if value is None or isinstance(value, cls):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"kv_transfer_config={value!r} is not a JSON object: {e}") from None
        if not isinstance(value, dict):
            raise ValueError(f"kv_transfer_config={value!r} must be a KVTransferConfig or a dict of its fields")
        allowed = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(value) - set(allowed))
        if unknown:
            raise ValueError(f"kv_transfer_config has unknown fields {unknown}; allowed: {allowed}")
        return cls(**value)
