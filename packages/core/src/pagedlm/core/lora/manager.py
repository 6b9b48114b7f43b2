"""The worker's LoRA side: adapted layers, device slots, the host cache, per-step metadata.

- Slots: ``max_loras`` entries of every adapted layer's stacked buffers. A step's adapters are
  put into slots before its forward (the scheduler never runs more distinct adapters in one step
  than there are slots); a slot not needed by the step is reused, least recently used first.
- Host cache: up to ``max_cpu_loras`` adapters read and sharded for this rank, least recently
  used evicted; an adapter that is in neither is read from its ``lora_path`` on demand.

NOTE: slot writes are device copies queued on the stream the forward passes run on, so a step
still in flight (async scheduling) reads its slots before the next step overwrites them.
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np
import torch
from torch import nn

from pagedlm.core.config import VllmConfig
from pagedlm.core.logger import init_logger
from pagedlm.core.lora.layers import LinearWithLoRA, adaptable_layers, target_table
from pagedlm.core.lora.peft import load_peft_adapter
from pagedlm.core.lora.punica import LoRAStepState
from pagedlm.core.lora.request import LoRARequest
from pagedlm.core.sched.output import SchedulerOutput

logger = init_logger(__name__)

__all__ = ["LoRAModelManager"]

#: one host-cache entry: (rank, scaling, per adapted layer and slice: (A shard, B shard) or None)
_HostAdapter = tuple[int, float, list[list[tuple[torch.Tensor, torch.Tensor] | None]]]


class LoRAModelManager:
    """Wraps ``model``'s adaptable layers (in place) and manages their adapters."""

    def __init__(self, model: nn.Module, vllm_config: VllmConfig, device: torch.device, *,
                 layer_ops: dict, pin_memory: bool) -> None:
        lc = vllm_config.lora_config
        assert lc is not None
        sc = vllm_config.scheduler_config
        self.lora_config = lc
        self.pin_memory = pin_memory
        model_dtype = vllm_config.model_config.dtype
        assert isinstance(model_dtype, torch.dtype)
        self.state = LoRAStepState(
            max_loras=lc.max_loras, max_lora_rank=lc.max_lora_rank,
            max_num_tokens=max(int(sc.max_num_batched_tokens or 8192), sc.max_num_seqs),
            dtype=lc.torch_dtype(model_dtype), device=device,
            shrink=layer_ops.get("lora_shrink"), expand=layer_ops.get("lora_expand"))
        found = adaptable_layers(model)
        #: HF module path -> [in, out]: what an adapter may target on this rank
        self.targets = target_table(model)
        self.layers: list[LinearWithLoRA] = []
        modules = dict(model.named_modules())
        for name, layer, slices in found:
            wrapped = LinearWithLoRA(layer, slices, self.state)
            parent_name, _, child = name.rpartition(".")
            setattr(modules[parent_name] if parent_name else model, child, wrapped)
            self.layers.append(wrapped)
        #: slot -> adapter id in it (None: empty); and the slots by last use, oldest first
        self.slot_ids: list[int | None] = [None] * lc.max_loras
        self._slot_lru: OrderedDict[int, None] = OrderedDict((s, None) for s in range(lc.max_loras))
        self._host: OrderedDict[int, _HostAdapter] = OrderedDict()
        #: request id -> its adapter (requests without one are absent)
        self.requests: dict[str, LoRARequest] = {}
        logger.info("LoRA: %d adapted layers, %d slots of rank %d, host cache of %d", len(self.layers),
                    lc.max_loras, lc.max_lora_rank, lc.max_cpu_loras)

    # -- adapters ---------------------------------------------------------------------------
    def add_adapter(self, lora_request: LoRARequest) -> bool:
        """Read ``lora_request``'s adapter into the host cache; False if it was there already."""
        if lora_request.lora_int_id in self._host:
            self._host.move_to_end(lora_request.lora_int_id)
            return False
        adapter = load_peft_adapter(lora_request, self.targets, self.lora_config.max_lora_rank)
        dtype = self.state.dtype
        per_layer: list[list[tuple[torch.Tensor, torch.Tensor] | None]] = []
        for layer in self.layers:
            parts: list[tuple[torch.Tensor, torch.Tensor] | None] = []
            for i, s in enumerate(layer.slices):
                pair = adapter.weights.get(s.module)
                if pair is None:
                    parts.append(None)
                    continue
                a, b = layer.shard(i, *pair)
                a, b = a.to(dtype).contiguous(), b.to(dtype).contiguous()
                if self.pin_memory:
                    a, b = a.pin_memory(), b.pin_memory()
                parts.append((a, b))
            per_layer.append(parts)
        self._host[lora_request.lora_int_id] = (adapter.rank, adapter.scaling, per_layer)
        while len(self._host) > int(self.lora_config.max_cpu_loras or self.lora_config.max_loras):
            evicted, _ = self._host.popitem(last=False)
            logger.debug("LoRA: adapter %d left the host cache", evicted)
        return True

    def remove_adapter(self, lora_int_id: int) -> bool:
        """Forget adapter ``lora_int_id`` (host cache and slot); False if it was not loaded."""
        found = self._host.pop(lora_int_id, None) is not None
        if lora_int_id in self.slot_ids:
            self.slot_ids[self.slot_ids.index(lora_int_id)] = None
            found = True
        return found

    def list_adapters(self) -> set[int]:
        return set(self._host) | {i for i in self.slot_ids if i is not None}

    def _activate(self, lora_request: LoRARequest, busy: set[int]) -> int:
        """The slot holding ``lora_request``'s adapter, loading it into a slot not in ``busy``."""
        lora_id = lora_request.lora_int_id
        if lora_id in self.slot_ids:
            slot = self.slot_ids.index(lora_id)
            self._slot_lru.move_to_end(slot)
            return slot
        slot = next((s for s in self._slot_lru if self.slot_ids[s] is None), None)
        if slot is None:
            slot = next(s for s in self._slot_lru if s not in busy)
        if lora_id not in self._host:
            self.add_adapter(lora_request)
        rank, scaling, per_layer = self._host[lora_id]
        self._host.move_to_end(lora_id)
        for layer, parts in zip(self.layers, per_layer):
            for a_buf, b_buf, pair in zip(layer.lora_a.unbind(1), layer.lora_b, parts):
                if pair is None:
                    a_buf[slot].zero_()
                    b_buf[slot].zero_()
                    continue
                a, b = pair
                a_buf[slot, :rank].copy_(a, non_blocking=True)
                a_buf[slot, rank:].zero_()
                b_buf[slot, :, :rank].copy_(b, non_blocking=True)
                b_buf[slot, :, rank:].zero_()
        self.state.scale[slot] = scaling
        self.state.scale_host[slot] = scaling
        self.state.rank[slot] = rank
        self.slot_ids[slot] = lora_id
        self._slot_lru.move_to_end(slot)
        return slot

    # -- steps ------------------------------------------------------------------------------
    def update_requests(self, sched: SchedulerOutput) -> None:
        """Learn the adapters of new requests; forget finished ones."""
        for req_id in sched.finished_req_ids:
            self.requests.pop(req_id, None)
        for new in sched.scheduled_new_reqs:
            if new.lora_request is not None:
                self.requests[new.req_id] = new.lora_request

    def prepare_step(self, req_ids: list[str], num_scheduled: np.ndarray) -> None:
        """Put the step's adapters into slots and publish its token-to-slot mapping."""
        slots = np.full(len(req_ids), -1, dtype=np.int64)
        if self.requests:
            wanted = {r.lora_int_id: r for rid in req_ids if (r := self.requests.get(rid)) is not None}
            if len(wanted) > len(self.slot_ids):
                raise RuntimeError(f"a step uses {len(wanted)} LoRA adapters but there are {len(self.slot_ids)} "
                                   "slots (max_loras); the scheduler must not allow it")
            busy = {self.slot_ids.index(i) for i in wanted if i in self.slot_ids}
            slot_of = {}
            for lora_id, request in wanted.items():
                slot_of[lora_id] = slot = self._activate(request, busy)
                busy.add(slot)
            for i, rid in enumerate(req_ids):
                request = self.requests.get(rid)
                if request is not None:
                    slots[i] = slot_of[request.lora_int_id]
        self.state.set_step(np.repeat(slots, num_scheduled))
