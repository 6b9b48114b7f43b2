"""The per-step LoRA state every adapted layer reads, and the batched update.

Per step the runner maps each token to the slot of its request's adapter (-1: the base model)
and writes, into one persistent int32 device buffer: ``slot_starts [max_loras] | slot_counts
[max_loras] | sorted_token_ids [max_num_tokens]``: the step's token indices sorted by slot, slot
``s`` owning ``sorted_token_ids[slot_starts[s] : slot_starts[s] + slot_counts[s]]``. Its address
never changes, so a captured CUDA graph replays with the step's values.

Two ways to apply the update ``y[t] += (x[t] @ A[s]^T) @ B[s]^T * scale[s]``:

- the platform's ``lora_shrink`` / ``lora_expand`` ops (``pagedlm_register_ops``; Triton on
  CUDA): two launches per slice over all slots, reading only the buffer above (no host
  synchronisation, fixed grid for a fixed token count: usable under CUDA graphs);
- core's torch code otherwise: per slot in use, gather its rows, two matmuls at the adapter's
  own rank (as PEFT computes them), and add them back (``index_add_``).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
import torch.nn.functional as F

__all__ = ["LoRAStepState"]


class LoRAStepState:
    """Shared by the adapted layers of one model: slot buffers' shape and dtype, each slot's
    scale and rank, and the current step's token-to-slot mapping."""

    def __init__(self, *, max_loras: int, max_lora_rank: int, max_num_tokens: int, dtype: torch.dtype,
                 device: torch.device, shrink: Callable[..., torch.Tensor] | None = None,
                 expand: Callable[..., None] | None = None) -> None:
        self.max_loras = max_loras
        self.max_lora_rank = max_lora_rank
        self.max_num_tokens = max_num_tokens
        self.dtype = dtype
        self.device = device
        self.shrink, self.expand = shrink, expand
        #: scale per slot (lora_alpha / r, or / sqrt(r) with rsLoRA)
        self.scale = torch.zeros(max_loras, dtype=torch.float32, device=device)
        self.scale_host = [0.0] * max_loras
        #: rank per slot (the torch path multiplies at the adapter's own rank)
        self.rank = [0] * max_loras
        self._buf = torch.zeros(2 * max_loras + max_num_tokens, dtype=torch.int32, device=device)
        self.slot_starts = self._buf[:max_loras]
        self.slot_counts = self._buf[max_loras : 2 * max_loras]
        self.sorted_token_ids = self._buf[2 * max_loras :]
        #: the torch path's groups this step: (slot, token indices [n] int64 on the device)
        self.groups: list[tuple[int, torch.Tensor]] = []

    @property
    def uses_ops(self) -> bool:
        return self.shrink is not None and self.expand is not None

    def set_step(self, token_slots: np.ndarray) -> None:
        """The step's ``[T]`` slot per token (-1: base model), in token order."""
        num_tokens, num_slots = len(token_slots), self.max_loras
        if num_tokens > self.max_num_tokens:
            raise ValueError(f"a step of {num_tokens} tokens exceeds the LoRA buffers' {self.max_num_tokens}")
        order = np.argsort(token_slots, kind="stable").astype(np.int32)
        counts = np.bincount(token_slots[token_slots >= 0], minlength=num_slots).astype(np.int32)
        first = int(np.count_nonzero(token_slots < 0))
        starts = (first + np.concatenate(([0], np.cumsum(counts)[:-1]))).astype(np.int32)
        if self.uses_ops:
            host = np.concatenate((starts, counts, order if counts.any() else order[:0]))
            self._buf[: len(host)].copy_(torch.from_numpy(host), non_blocking=True)
            return
        sorted_ids = torch.from_numpy(order.astype(np.int64)).to(self.device, non_blocking=True)
        self.groups = [(slot, sorted_ids[int(starts[slot]) : int(starts[slot]) + int(counts[slot])])
                       for slot in np.flatnonzero(counts).tolist()]

    def add_lora(self, out: torch.Tensor, x: torch.Tensor, layer) -> None:
        """``out [T, out_per_rank] += `` the step's update of ``layer`` for input ``x [T, in]``."""
        if self.uses_ops:
            a = layer.lora_a
            shrunk = self.shrink(x, a.flatten(1, 2), self.sorted_token_ids, self.slot_starts, self.slot_counts)
            for i, (b, s) in enumerate(zip(layer.lora_b, layer.slices)):
                self.expand(out.narrow(-1, s.offset, s.size), shrunk.narrow(-1, i * a.shape[2], a.shape[2]), b,
                            self.sorted_token_ids, self.slot_starts, self.slot_counts, self.scale)
            return
        for slot, rows in self.groups:
            rank, scale = self.rank[slot], self.scale_host[slot]
            xs = x.index_select(0, rows)
            for i, (b, s) in enumerate(zip(layer.lora_b, layer.slices)):
                a_s, b_s = layer.lora_a[slot, i, :rank], b[slot, :, :rank]
                delta = F.linear(F.linear(xs, a_s.to(x.dtype)), b_s.to(x.dtype)) * scale
                out.narrow(-1, s.offset, s.size).index_add_(0, rows, delta)
