"""What each attention layer needs from the KV cache, and how layers are grouped around one pool.

Layers that attend over the same span (the whole context, or the last ``W`` positions) form a
*KV-cache group*: a request has one block table per group, and every layer of a group reads and
writes its K/V through that group's table. All groups draw from one block pool.

Memory layout (why groups have equal size): a block id addresses the same rows of a fixed set of
``group_size`` cache tensors (*slots*), one tensor per layer position inside a group. Layer ``j``
of every group uses slot ``j``'s tensor; a block is held by at most one group at a time, so the
groups never touch each other's rows. A block therefore costs ``group_size`` layers' K/V of
``block_size`` tokens, whichever group holds it, and the pool's memory is ``group_size`` tensors
instead of one per layer. Gemma 3 270M (3 full layers, 15 sliding): ``group_size`` 3, one full
group and five sliding groups; a sliding group's blocks are freed once they leave the window.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class FullAttentionSpec:
    """The layer attends to the whole context: every block stays needed until the request ends."""

    def max_blocks_per_request(self, num_tokens: int, block_size: int, max_chunk: int) -> int:
        return -(-num_tokens // block_size)


@dataclass(frozen=True)
class SlidingWindowSpec:
    """The layer attends to the last ``sliding_window`` positions (its own included)."""

    sliding_window: int

    def max_blocks_per_request(self, num_tokens: int, block_size: int, max_chunk: int) -> int:
        # A chunk of n new tokens needs keys from W - 1 positions before its first query to its
        # last token: n + W - 1 positions, which straddle at most one extra block boundary.
        needed = -(-(min(max_chunk, num_tokens) + self.sliding_window - 1) // block_size) + 1
        return min(needed, -(-num_tokens // block_size))


AttentionSpec = FullAttentionSpec | SlidingWindowSpec


def attention_spec(sliding_window: int | None) -> AttentionSpec:
    return FullAttentionSpec() if sliding_window is None else SlidingWindowSpec(sliding_window)


@dataclass(frozen=True)
class KVCacheGroupSpec:
    """Layers sharing one block table. ``layer_names[j]`` uses cache slot ``j``."""

    layer_names: tuple[str, ...]
    spec: AttentionSpec


def make_kv_cache_groups(layer_specs: dict[str, AttentionSpec]) -> list[KVCacheGroupSpec]:
    """Group layers (in ``layer_specs`` order, the model's layer order) by attention span.

    One span (Llama, Qwen, Mistral): one group of every layer, exactly the single block table of
    a model without groups. Several spans: every group gets ``group_size`` = the smallest count of
    layers of one span, so all blocks have the same size; each span's layers are cut into groups
    of that many, in layer order. The last group of a span may have fewer layers (its unused slots
    are padding: memory a block of that group does not use).
    """
    by_spec: dict[AttentionSpec, list[str]] = {}
    for name, spec in layer_specs.items():
        by_spec.setdefault(spec, []).append(name)
    if not by_spec:
        return [KVCacheGroupSpec((), FullAttentionSpec())]
    # NOTE: full attention first, so group 0 is the full group whenever the model has one.
    specs = sorted(by_spec, key=lambda s: (isinstance(s, SlidingWindowSpec), getattr(s, "sliding_window", 0)))
    group_size = min(len(names) for names in by_spec.values())
    return [
        KVCacheGroupSpec(tuple(by_spec[spec][start : start + group_size]), spec)
        for spec in specs
        for start in range(0, len(by_spec[spec]), group_size)
    ]


def group_size(groups: list[KVCacheGroupSpec]) -> int:
    """Cache slots (layer tensors) a block spans: the size of the largest group."""
    return max(len(g.layer_names) for g in groups)


def max_blocks_per_request(groups: list[KVCacheGroupSpec], num_tokens: int, block_size: int,
                           max_chunk: int) -> int:
    """Blocks one request of ``num_tokens`` tokens holds at most at once, over all groups, when
    prompts are scheduled in chunks of at most ``max_chunk`` tokens."""
    return sum(g.spec.max_blocks_per_request(num_tokens, block_size, max_chunk) for g in groups)

