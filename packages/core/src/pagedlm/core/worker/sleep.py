"""Sleep mode on one worker (vLLM's ``enable_sleep_mode``): give the device memory back between uses.

- ``sleep(level=1)``: the weights move to host memory (page-locked where the platform pins) and
  the KV cache is dropped.
- ``sleep(level=2)``: the weights are dropped too and read again from the checkpoint on wake.
- ``wake_up(tags)``: ``"weights"`` and/or ``"kv_cache"`` come back (None: both). The KV cache
  comes back empty (the engine core reset the prefix cache before sleeping).

NOTE (device graphs): captured graphs hold device addresses of the weights, the KV cache and
their own memory pool. Restored tensors get new storage, so the runner's graphs are dropped at
sleep (``ModelRunner.release_device_graphs``) and captured again when the KV cache is restored
(``initialize_kv_cache`` captures, as at start-up): nothing replays a graph over freed memory.
"""

from __future__ import annotations

import gc
from typing import Any

import torch

from pagedlm.core.logger import init_logger

logger = init_logger(__name__)

SLEEP_TAGS = ("weights", "kv_cache")


class SleepState:
    """What one worker put to sleep, and how to bring it back."""

    def __init__(self) -> None:
        self.level = 0
        #: parts asleep: a subset of SLEEP_TAGS
        self.asleep: set[str] = set()
        #: level 1 on a device: tensor -> its host copy (parameters and buffers, ties once)
        self._host: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._kv_cache_groups: Any = None
        self.num_kv_blocks = 0

    def sleep(self, runner: Any, level: int, num_kv_blocks: int) -> None:
        if level not in (1, 2):
            raise ValueError(f"sleep level={level!r} must be 1 (weights to host memory) or 2 (weights dropped)")
        if self.asleep:
            raise RuntimeError("the worker is already asleep: wake_up() first")
        if level == 2 and runner.vllm_config.quant_config is not None:
            raise ValueError("sleep(level=2) reloads the weights from the checkpoint, which quantized models do not "
                             "support yet; use level=1")
        before = runner.platform.allocated_memory_bytes(runner.device)
        runner.release_device_graphs()
        for layer in runner.attention_layers.values():
            layer.kv_cache = None
        runner.kv_caches = []
        self.num_kv_blocks = num_kv_blocks
        if level == 1:
            # NOTE: on the CPU too (the copy is then to more host memory, and the same path runs in
            # the CPU tests): every parameter and buffer keeps its object, its storage is swapped
            pin = runner.platform.is_pin_memory_available()
            for tensor in _unique_tensors(runner.model):
                host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=pin)
                host.copy_(tensor.data)
                self._host.append((tensor, host))
                tensor.data = torch.empty(0, dtype=tensor.dtype, device=runner.device)
        else:
            self._kv_cache_groups = runner.kv_cache_groups
            runner.model = None
            runner.attention_layers = {}
        gc.collect()
        runner.platform.synchronize()
        runner.platform.empty_cache()
        self.level = level
        self.asleep = set(SLEEP_TAGS)
        after = runner.platform.allocated_memory_bytes(runner.device)
        if before is not None and after is not None:
            logger.info("sleep(level=%d): device memory allocated %.3f GiB -> %.3f GiB", level, before / 2**30,
                        after / 2**30)

    def wake_up(self, runner: Any, tags: list[str] | None) -> None:
        wanted = set(SLEEP_TAGS if tags is None else tags)
        unknown = sorted(wanted - set(SLEEP_TAGS))
        if unknown:
            raise ValueError(f"wake_up tags {unknown} are unknown; allowed: {', '.join(SLEEP_TAGS)}")
        if "weights" in wanted & self.asleep:
            if self.level == 1:
                for tensor, host in self._host:
                    tensor.data = host.to(runner.device, non_blocking=False)
                self._host = []
            else:
                runner.load_model()  # the checkpoint again, as at start-up
                runner.set_kv_cache_groups(self._kv_cache_groups)
            self.asleep.discard("weights")
        if "kv_cache" in wanted & self.asleep:
            if "weights" in self.asleep:
                raise ValueError("wake_up(tags=['kv_cache']) needs the weights awake first (the KV cache belongs to "
                                 "the model's attention layers): wake 'weights' before or together with it")
            runner.initialize_kv_cache(self.num_kv_blocks)  # (device runners capture their graphs again)
            self.asleep.discard("kv_cache")
        if not self.asleep:
            self.level = 0


def _unique_tensors(model: torch.nn.Module) -> list[torch.Tensor]:
    """The model's parameters and buffers, each storage once (tied weights share one)."""
    seen: set[int] = set()
    tensors = []
    for tensor in [*model.parameters(), *model.buffers()]:
        if tensor.numel() == 0 or tensor.data_ptr() in seen:
            continue
        seen.add(tensor.data_ptr())
        tensors.append(tensor)
    return tensors
