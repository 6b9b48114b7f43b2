"""Attention checks: a registered backend against ``cpu_paged`` on the same paged batches.

Each case runs one step through the backend exactly as a model runner drives it (builder from
``CommonAttentionMetadata``, then ``Impl.forward``) and compares the real rows with the float32
reference. Where the backend's KV cache has the reference layout (every built-in backend), the
cache is pre-filled directly, and after the step the new tokens' K/V must be in their slots
bit for bit and every other slot unchanged. Another layout is filled by a first step of the
backend itself (the cached prefixes as prefill chunks), so its writes are checked through reads.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from pagedlm.core.attention import AttentionBackend
from pagedlm.core.plugins import get_plugins, resolve_class_path
from pagedlm.core.testing.conformance.paged_batch import (
    DECODES,
    LONG,
    MIXED,
    PagedBatch,
    make_batch,
    prefill_of_prefixes,
    to_device,
)
from pagedlm.core.testing.conformance.report import CheckResult, compare, tolerance_for

REFERENCE_BACKEND = "cpu_paged"
#: the Gemma 3 score scale ``query_pre_attn_scalar ** -0.5`` with a scalar unlike head_dim, so a
#: backend that ignores ``scale`` and uses ``head_size ** -0.5`` fails
GEMMA3_SCALAR = 192


@dataclass(frozen=True)
class AttentionCase:
    batch: str  # a key of BATCHES
    num_heads: int
    num_kv_heads: int
    head_size: int
    block_size: int
    dtype: torch.dtype
    scale: float | None = None  # None: head_size ** -0.5
    sliding_window: int | None = None
    logits_soft_cap: float | None = None

    def describe(self) -> str:
        parts = [self.batch, f"h{self.num_heads}/kv{self.num_kv_heads}", f"d{self.head_size}",
                 f"bs{self.block_size}", str(self.dtype).removeprefix("torch.")]
        if self.scale is not None:
            parts.append(f"scale={self.scale:.4g}")
        if self.sliding_window is not None:
            parts.append(f"window={self.sliding_window}")
        if self.logits_soft_cap is not None:
            parts.append(f"softcap={self.logits_soft_cap:g}")
        return " ".join(parts)


#: name -> (requests, make_batch extras)
BATCHES: dict[str, tuple[tuple[tuple[int, int], ...], dict[str, Any]]] = {
    "mixed": (MIXED, {}),
    "decodes": (DECODES, {}),
    "padded": (MIXED, {"pad_reqs": 2, "pad_rows": 3}),
    "long": (LONG, {}),
    "softcap": (MIXED, {"query_gain": 4.0}),
}
GQA = ((4, 4), (4, 2), (8, 2), (4, 1))  # query heads per kv head 1, 2, 4, and 4 on one kv head


def attention_cases(dtypes: list[torch.dtype], *, quick: bool) -> list[AttentionCase]:
    """The grid: GQA ratios x head sizes x block sizes on mixed batches, then one case per
    feature (decode-only, padding, windows, soft cap, Gemma 3's head 256 with its scale)."""
    head_sizes = (64,) if quick else (64, 128, 256)
    block_sizes = (16,) if quick else (1, 16, 32)
    cases: list[AttentionCase] = []
    for dtype in dtypes:
        for block_size in block_sizes:
            for heads in GQA:
                for head_size in head_sizes:
                    cases.append(AttentionCase("mixed", *heads, head_size, block_size, dtype))
        if quick:  # the other block sizes once each
            cases += [AttentionCase("mixed", 8, 2, 64, bs, dtype) for bs in (1, 32)]
        cases += [
            AttentionCase("decodes", 8, 2, 64, 16, dtype),
            AttentionCase("padded", 8, 2, 64, 16, dtype),
            AttentionCase("mixed", 8, 2, 64, 16, dtype, sliding_window=5),
            AttentionCase("long", 8, 2, 64, 16, dtype, sliding_window=16),
            AttentionCase("softcap", 4, 2, 64, 16, dtype, logits_soft_cap=2.0),
            AttentionCase("softcap", 4, 2, 64, 16, dtype, logits_soft_cap=2.0, sliding_window=6),
            AttentionCase("long", 4, 1, 256, 16, dtype, scale=GEMMA3_SCALAR**-0.5),
            AttentionCase("long", 4, 1, 256, 16, dtype, scale=GEMMA3_SCALAR**-0.5, sliding_window=8),
        ]
    return cases


def backend_class(name: str) -> type[AttentionBackend]:
    """The registered attention backend ``name`` (through the plugin registry)."""
    registry = get_plugins().attention_backends()
    if name not in registry:
        raise ValueError(f"attention backend {name!r} is not registered; registered: {sorted(registry)}")
    cls = resolve_class_path(registry[name])
    if not (isinstance(cls, type) and issubclass(cls, AttentionBackend)):
        raise TypeError(f"{registry[name]} (attention backend {name!r}) is not an AttentionBackend subclass")
    return cls


def unsupported(backend: type[AttentionBackend], case: AttentionCase) -> str | None:
    """Why ``backend`` declares it cannot run ``case`` (a skip, not a failure), or None: its
    ``validate`` (head sizes, dtypes, ``block_size_multiple``) refuses it."""
    try:
        backend.validate(head_size=case.head_size, dtype=case.dtype, block_size=case.block_size)
    except ValueError as e:
        return str(e)
    return None


def check_attention_case(backend: type[AttentionBackend], device: torch.device, case: AttentionCase,
                         seed: int) -> CheckResult:
    name = case.describe()
    why = unsupported(backend, case)
    if why is not None:
        return CheckResult("attention", name, "SKIP", detail=why)
    reqs, extras = BATCHES[case.batch]
    batch = make_batch(reqs, block_size=case.block_size, num_heads=case.num_heads, num_kv_heads=case.num_kv_heads,
                       head_size=case.head_size, dtype=case.dtype, seed=seed, **extras)
    tol = tolerance_for(case.dtype)
    try:
        expected = _reference(batch, case)
        out, cache, same_layout = _run_backend(backend, device, batch, case)
    except Exception as e:  # noqa: BLE001 - a crash is this backend's failure, reported with its message
        return CheckResult("attention", name, "FAIL", detail=f"raised {type(e).__name__}: {e}")
    if out.shape != batch.query.shape or out.dtype != case.dtype:
        return CheckResult("attention", name, "FAIL", detail=(
            f"output {tuple(out.shape)} {out.dtype}, expected {tuple(batch.query.shape)} {case.dtype}"))
    rows = batch.num_real_tokens
    ok, err, why = compare(out[:rows].float(), expected[:rows], tol)
    if ok and same_layout:
        why = _kv_write_problem(batch, cache, case)
        ok = why == ""
    detail = why or ("K/V written to their slots, no other slot touched" if same_layout
                     else "cache layout differs from cpu_paged: writes checked through reads")
    return CheckResult("attention", name, "PASS" if ok else "FAIL", err, tol.describe(), detail)


def _reference(batch: PagedBatch, case: AttentionCase) -> torch.Tensor:
    """``cpu_paged`` in float32 on the CPU on the same batch."""
    ref = backend_class(REFERENCE_BACKEND)
    impl = ref.get_impl_cls()(**_impl_kwargs(case))
    meta = ref.get_builder_cls()(block_size=case.block_size, device=torch.device("cpu")).build(batch.common)
    cache = batch.kv_cache.to(torch.float32, copy=True)  # float() would alias a float32 cache
    return impl.forward(batch.query.float(), batch.key.float(), batch.value.float(), cache, meta)


def _run_backend(backend: type[AttentionBackend], device: torch.device, batch: PagedBatch,
                 case: AttentionCase) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """One step through ``backend`` on ``device``: ``(output, cache after, reference layout?)``."""
    num_blocks = batch.kv_cache.shape[1]
    shape = tuple(backend.get_kv_cache_shape(num_blocks, case.block_size, case.num_kv_heads, case.head_size))
    same_layout = shape == tuple(batch.kv_cache.shape)
    builder = backend.get_builder_cls()(block_size=case.block_size, device=device)
    builder.bind_model(num_kv_heads=case.num_kv_heads, head_size=case.head_size)  # as a model runner does
    impl = backend.get_impl_cls()(**_impl_kwargs(case))
    if same_layout:
        # a copy even on the CPU (.to would alias): the batch's cache is the "before" state
        cache = batch.kv_cache.to(device, copy=True)
    else:
        cache = torch.full(shape, float("nan"), dtype=case.dtype, device=device)
        if any(k.shape[0] for k, _, _ in batch.prefixes):
            common, (q, k, v) = prefill_of_prefixes(batch, case.num_heads, seed=1)
            impl.forward(q.to(device), k.to(device), v.to(device), cache, builder.build(to_device(common, device)))
    meta = builder.build(to_device(batch.common, device))
    out = impl.forward(batch.query.to(device), batch.key.to(device), batch.value.to(device), cache, meta)
    return out.cpu(), cache.cpu(), same_layout


def _impl_kwargs(case: AttentionCase) -> dict[str, Any]:
    return dict(num_heads=case.num_heads, head_size=case.head_size, num_kv_heads=case.num_kv_heads,
                scale=case.head_size**-0.5 if case.scale is None else case.scale,
                sliding_window=case.sliding_window, logits_soft_cap=case.logits_soft_cap)


def _kv_write_problem(batch: PagedBatch, cache: torch.Tensor, case: AttentionCase) -> str:
    """Why the cache after the step is wrong ("" if right): the new K/V must sit in their slots
    exactly, and every other slot (cached context, NaN) must be bit-identical to before."""
    flat = cache.view(2, -1, case.num_kv_heads, case.head_size)
    before = batch.kv_cache.view(2, -1, case.num_kv_heads, case.head_size)
    rows = batch.num_real_tokens
    if not torch.equal(flat[0, batch.new_slots], batch.key[:rows]):
        return "new keys not found in their slot_mapping slots"
    if not torch.equal(flat[1, batch.new_slots], batch.value[:rows]):
        return "new values not found in their slot_mapping slots"
    others = torch.ones(flat.shape[1], dtype=torch.bool)
    others[batch.new_slots] = False
    a, b = flat[:, others], before[:, others]
    same = (a == b) | (torch.isnan(a) & torch.isnan(b))
    if not bool(same.all()):
        return f"{int((~same).sum())} cache values changed outside the new tokens' slots (slot -1 or padding written?)"
    return ""
