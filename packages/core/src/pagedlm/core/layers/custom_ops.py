"""Layer ops a platform may implement faster than core's torch code: their contracts, and binding.

Core layers (``RMSNorm``, ``RotaryEmbedding``, ``SiluAndMul``, ``FusedMoE``) and the sampler compute in plain
torch; that is the reference. A platform plugin registers faster implementations through the
``pagedlm_register_ops`` hook as lazy ``"module:function"`` strings (pagedlm-backend-cuda
registers fused Triton kernels for platform ``"cuda"``). An implementation must keep the contract
of its op in :data:`OP_CONTRACTS`, dtype rounding included (HF-parity tests compare greedy tokens).

Binding: a model runner resolves its platform's table once (:func:`registered_ops` imports every
registered function) and builds the model and sampler inside :func:`use_ops`; each layer takes
its functions in its constructor (:func:`bound_op`). A forward pass therefore makes no registry
lookup, and models built for different platforms in one process each keep their own ops. A layer
built outside :func:`use_ops` (most unit tests) runs core's torch code.

Op names: :data:`OP_CONTRACTS` holds the contracts core's layers call; a change that adds a core
op (a quantized GEMM, LoRA shrink/expand; ``fused_experts`` came with API 1.1, its quantized
variants with 1.3, ``unquantized_gemm`` with 1.6, the Gemma norms with 1.8,
``fp8_block_scaled_mm`` with 1.9, the producers fused with FP8 quantization and
``fp8_quantized_mm`` with 1.10, ``wna16_repack`` with 1.11) adds its contract there and bumps
the minor ``API_VERSION``.
A plugin's own layers may call ops of their own under a dotted name (``"myplugin.fused_gate"``),
whose contract that plugin documents; any other name is an error.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from types import MappingProxyType
from typing import Any

__all__ = ["LayerOp", "OP_CONTRACTS", "bound_op", "is_known_op", "registered_ops", "use_ops"]

LayerOp = Callable[..., Any]

#: op name -> its contract (mirrored, with examples, in docs/plugins.md)
OP_CONTRACTS: Mapping[str, str] = MappingProxyType({
    "rms_norm": (
        "fn(x [..., N], weight [N], eps: float) -> [..., N], a new tensor in x's dtype: normalise in "
        "float32, round to x's dtype, then multiply by weight in that dtype (HF's LlamaRMSNorm). x may "
        "be a strided view (e.g. [T, H, D] heads of a fused projection)."
    ),
    "fused_add_rms_norm": (
        "fn(x [..., N], residual [..., N], weight [N], eps) -> (rms_norm(s), s) with s = x + "
        "residual computed in x's dtype (rounded before normalising); new tensors, inputs unchanged."
    ),
    "rotary_embedding": (
        "fn(positions [T] int64, query [T, Hq*D], key [T, Hk*D] | None, cos_sin_cache [max_pos, "
        "rotary_dim] float32 (cos | sin halves), head_size D, rotary_dim, is_neox_style: bool) -> "
        "(query, key | None) rotated, new tensors of the input shapes and dtypes; query and key may "
        "be strided views; cos/sin are rounded to the input dtype before the products, and the "
        "dimensions past rotary_dim pass through."
    ),
    "qk_norm_rotary_embedding": (
        "fn(positions, query, key, q_weight [D], k_weight [D], eps, cos_sin_cache, head_size, "
        "rotary_dim, is_neox_style) -> (query, key): every D-sized head of query and key "
        "normalised as rms_norm with its weight, then rotated as rotary_embedding; new tensors."
    ),
    "gemma_rms_norm": (
        "fn(x [..., N], weight [N], eps) -> [..., N], a new tensor in x's dtype: x in float32 times "
        "rsqrt(mean(x^2) + eps) times (1 + weight) in float32, rounded to x's dtype once, at the end "
        "(HF's Gemma3RMSNorm; the stored weight is zero-centred). x may be a strided view."
    ),
    "gemma_fused_add_rms_norm": (
        "fn(x [..., N], residual [..., N], weight [N], eps) -> (gemma_rms_norm(s), s) with s = x + "
        "residual computed in x's dtype; new tensors, inputs unchanged."
    ),
    "gemma_qk_norm_rotary_embedding": (
        "fn(positions, query, key, q_weight [D], k_weight [D], eps, cos_sin_cache, head_size, "
        "rotary_dim, is_neox_style) -> (query, key): as qk_norm_rotary_embedding with every head "
        "normalised as gemma_rms_norm (Gemma 3's q/k norm); new tensors (API 1.8)."
    ),
    "silu_and_mul": "fn(x [..., 2I]) -> silu(x[..., :I]) * x[..., I:], [..., I] in x's dtype; a new tensor.",
    # Producers fused with the per-token FP8 quantization of the next linear layer's input (API 1.10).
    # NOTE: each must give exactly the bytes of quantize_fp8_per_token (pagedlm.core.layers.quantization
    # .utils: scale = max(amax(|row|) / 448, 1e-12) and x / scale, both IEEE float32 divisions; clamp to
    # +-448; round to nearest even) applied to what the platform's unfused op returns (its rms_norm /
    # fused_add_rms_norm / silu_and_mul, or core's torch code where it registers none), so the fusion
    # changes no result. Without them a layer quantizes the unfused op's output with that function.
    "rms_norm_fp8_quant": (
        "fn(x [T, N] (rows may be strided, last dim contiguous) float16/bfloat16, weight [N], eps) -> (x_q [T, N] "
        "float8_e4m3fn, scale [T, 1] float32): quantize_fp8_per_token(rms_norm(x, weight, eps)); new tensors."
    ),
    "fused_add_rms_norm_fp8_quant": (
        "fn(x [T, N], residual [T, N], weight [N], eps) -> (x_q, scale, s): quantize_fp8_per_token of "
        "fused_add_rms_norm's normalised output, and its s = x + residual in x's dtype; new tensors."
    ),
    "silu_and_mul_fp8_quant": (
        "fn(x [T, 2I] float16/bfloat16) -> (x_q [T, I] float8_e4m3fn, scale [T, 1] float32): "
        "quantize_fp8_per_token(silu_and_mul(x)); new tensors."
    ),
    "gumbel_sample": (
        "fn(logits [B, V] any float dtype, temperature [B] float32, seed: int, offset: int) -> [B] "
        "int64: row i drawn from softmax(logits[i] / temperature[i]) (divided in float32; -inf "
        "entries never drawn unless the whole row is -inf) with noise that is a function of (seed, "
        "offset) alone (equal ints, equal draws; no host sync); rows with temperature below 1e-5 "
        "get the argmax (lowest index wins ties, as torch.argmax). logits are not modified."
    ),
    "apply_token_bitmask": (
        "fn(logits [S, V] any float dtype, bitmask [R, W] int32 (32 * W >= V, on logits' device), logit_rows "
        "[R] int32 on logits' device | None) -> None: in place, logits[logit_rows[r], t] = -inf for every token t "
        "< V whose bit t % 32 of bitmask[r, t // 32] is clear; a row r with logit_rows[r] < 0 is skipped (logit_rows "
        "None: row r of logits is row r of the bitmask, R == S); the other entries and rows are unchanged. No host "
        "synchronisation (API 1.5; reference: pagedlm.core.structured_output.bitmask.apply_token_bitmask_reference)."
    ),
    # The full-precision linear (UnquantizedLinearMethod; API 1.6): decode-shaped GEMVs.
    "unquantized_gemm": (
        "fn(x [T, K] float16/bfloat16/float32, weight [N, K] (x's dtype), bias [N] | None) -> [T, N], a new "
        "tensor in x's dtype: F.linear(x, weight, bias), the products accumulated in float32 and rounded once "
        "(only the summation order may differ). An implementation may call F.linear itself for the shapes it "
        "does not speed up. No host synchronisation."
    ),
    # Quantized GEMMs (pagedlm.core.layers.quantization; references in its utils module).
    "wna16_gemm": (
        "fn(x [T, K] float16/bfloat16/float32, qweight [K // (32 // bits), N] int32, scales [K // G, N] "
        "(x's dtype), zeros [K // G, N] int32 | None, g_idx [K] int32 | None, bits: 4 | 8, group_size G) -> "
        "[T, N] in x's dtype: x @ W with W[k, n] = (q[k, n] - z[g(k), n]) * s[g(k), n], q[k, n] the unsigned "
        "bits-wide field at bit bits * (k % (32 // bits)) of qweight[k // (32 // bits), n], z = 2 ** (bits - 1) "
        "when zeros is None, g(k) = g_idx[k] when given, else k // G. Accumulates in float32."
    ),
    "wna16_repack": (
        "fn(qweight [K // (32 // bits), N] int32 in wna16_gemm's layout above, scales, zeros | None, g_idx | None, "
        "bits, group_size) -> a tensor of the same shape and dtype that the platform's wna16_gemm reads in "
        "place of qweight, with the same result (its own layout for its kernels; it may return qweight "
        "itself). Run once per layer after loading; a platform that registers it reads only what it "
        "returned (API 1.11)."
    ),
    "fp8_scaled_mm": (
        "fn(x [T, K] float16/bfloat16/float32, weight [N, K] float8_e4m3fn, weight_scale [N] float32, "
        "input_scale [1] float32 | None, bias [N] | None) -> [T, N] in x's dtype: x quantized to float8_e4m3fn "
        "with input_scale, or per token with scale amax(|x_t|) / 448 when None (values divided by the scale, "
        "clamped to +-448), then (x_q @ weight^T) * x_scale * weight_scale in float32, plus bias."
    ),
    "fp8_quantized_mm": (
        "fn(x_q [M, K] float8_e4m3fn, x_scale [M, 1] float32, weight [N, K] float8_e4m3fn, weight_scale [N] "
        "float32, bias [N] | None, out_dtype: torch.dtype) -> [M, N] in out_dtype: fp8_scaled_mm on activations "
        "already quantized (the producer ops below), (x_q @ weight^T) * x_scale * weight_scale in float32, plus "
        "bias. NOTE: for the fused producers to change no result, fp8_scaled_mm(x, ...) must equal this op on "
        "quantize_fp8_per_token(x) bit for bit on a platform that registers both; a layer hands it pre-quantized "
        "inputs only where the platform registers both or neither (API 1.10)."
    ),
    "fp8_block_scaled_mm": (
        "fn(x [T, K] float16/bfloat16/float32, weight [N, K] float8_e4m3fn, weight_scale [ceil(N / block_n), "
        "ceil(K / block_k)] float32, block_n: int, block_k: int, bias [N] | None) -> [T, N] in x's dtype: each "
        "run of block_k values of a row of x quantized to float8_e4m3fn with its own scale amax / 448 (divided, "
        "clamped to +-448), then sum over k of x_q * x_scale(t, k // block_k) * weight[n, k] * "
        "weight_scale[n // block_n, k // block_k] with float32 products and sums, plus bias (API 1.9)."
    ),
    "int8_scaled_mm": (
        "fn(x [T, K], weight [N, K] int8, weight_scale [N] float32, input_scale [1] float32 | None, bias [N] | "
        "None) -> [T, N] in x's dtype: x quantized to int8 (round half to even, clamp [-128, 127]) with "
        "input_scale, or per token with scale amax(|x_t|) / 127.5 when None (compressed-tensors' convention); "
        "exact int32 accumulation of x_q @ weight^T, times x_scale * weight_scale in float32, plus bias."
    ),
    "int8_weight_only_gemm": (
        "fn(x [T, K] float16/bfloat16/float32, weight [N, K] int8, weight_scale [N] float32, bias [N] | None) -> "
        "[T, N] in x's dtype: x @ (weight * weight_scale)^T with the scale rounded to x's dtype, the products "
        "accumulated in float32 (the scale may be applied to the sums), plus bias; x is not quantized "
        "(API 1.7)."
    ),
    "fused_experts": (
        "fn(hidden_states [T, H], w13 [E, 2I, H], w2 [E, H, I], topk_weights [T, K] float32, topk_ids [T, K] "
        "int32 (global expert ids), expert_map [E_global] int32 | None) -> [T, H] in hidden_states' dtype: for "
        "each pair (t, k) whose expert e = topk_ids[t, k] (through expert_map when given; -1: another rank's "
        "expert, the pair adds nothing) y = w2[e] @ silu_and_mul(w13[e] @ x_t) (gate rows [:I], up rows [I:]; "
        "each matmul result rounded to the dtype, silu_and_mul rounded as that op); out[t] = sum over k of "
        "(topk_weights[t, k] * y rounded to the dtype), summed in float32 and rounded once. The weights are "
        "the layer's parameters (contiguous); no input is modified; no host synchronisation on devices that "
        "capture graphs."
    ),
    # Quantized experts (API 1.3; references in layers/fused_moe/quantized_reference.py).
    "fused_experts_fp8": (
        "fn(hidden_states [T, H], w13 [E, 2I, H] float8_e4m3fn, w2 [E, H, I] float8_e4m3fn, w13_scale [E, 2I] "
        "float32, w2_scale [E, H] float32 (per output channel), topk_weights, topk_ids, expert_map) -> [T, H]: "
        "fused_experts with each GEMM's input quantized to float8_e4m3fn per row (scale amax / 448, clamped to "
        "+-448: per token for gate/up, per pair for down, after silu_and_mul's rounding), the FP8 products "
        "accumulated in float32, times the row's and the channel's scales, rounded to the dtype."
    ),
    "fused_experts_wna16": (
        "fn(hidden_states [T, H], w13_qweight [E, 2I, H // p] int32, w2_qweight [E, H, I // p] int32, w13_scales "
        "[E, 2I, H // G], w2_scales [E, H, I // G] (hidden_states' dtype), w13_zeros, w2_zeros ([E, N, K // G] "
        "int32 unsigned) | None, topk_weights, topk_ids, expert_map, bits: 4 | 8, group_size G (-1: one group "
        "over K)) -> [T, H]: fused_experts on W[e][n, k] = (q - z[n, k // G]) * s[n, k // G] rounded to the "
        "dtype, q the unsigned bits-wide field at bit bits * (k % p) of qweight[e, n, k // p], p = 32 // bits, "
        "z = 2 ** (bits - 1) when zeros is None."
    ),
    # GGUF blocks computed on as stored (pagedlm.core.layers.quantization.gguf; API 1.4).
    "gguf_mul_mat": (
        "fn(x [M, K] float32/bfloat16/float16, qweight [N, K // B * S] uint8 (contiguous: row n is W[n]'s K // B "
        "blocks of ggml type qtype, B values / S bytes each), qtype: int, N: int) -> [M, N] in x's dtype: x @ W^T "
        "computed in float32, W decoded exactly as pagedlm.core.model_loader.gguf_dequant.dequantize does (the "
        "same float32 values; only the summation order may differ). qtype is one of gguf.KERNEL_TYPES: Q4_0, "
        "Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K. A platform may instead round x to 8 bits per block, as "
        "llama.cpp does, if it documents the switch back to this exact mode (the CPU backend: "
        "PAGEDLM_CPU_GGUF_INT8_ACTIVATIONS, on by default; 0 is exact)."
    ),
    "gguf_get_rows": (
        "fn(qweight [V, K // B * S] uint8, qtype: int, ids [...] int64, K: int) -> [..., K] float32: rows ids of the "
        "table decoded exactly as gguf_dequant.dequantize; ValueError for an id outside [0, V)."
    ),
    # The batched LoRA update (pagedlm.core.lora.punica; API 1.2): the step's tokens grouped by slot.
    "lora_shrink": (
        "fn(x [T, K], lora_a [L, R, K] (rows contiguous), sorted_token_ids [>= T] int32, slot_starts [L] int32, "
        "slot_counts [L] int32) -> [T, R] float32: out[t] = x[t] @ lora_a[s]^T (accumulated in float32) for every "
        "token t = sorted_token_ids[slot_starts[s] + j], j < slot_counts[s], of every slot s; the other rows are "
        "unspecified. No host synchronisation, and a launch that depends on the shapes only (CUDA graphs replay "
        "it with new metadata)."
    ),
    "lora_expand": (
        "fn(y [T, N] (a column slice of a wider output may be given), shrunk [T, R] float32, lora_b [L, N, R], "
        "sorted_token_ids, slot_starts, slot_counts (as lora_shrink's), scale [L] float32) -> None: in place, "
        "y[t] += (shrunk[t] @ lora_b[s]^T) * scale[s] for the tokens t of each slot s, summed in float32 and "
        "rounded once to y's dtype; the other rows are unchanged. Same launch rules as lora_shrink."
    ),
})

_NO_OPS: Mapping[str, LayerOp] = MappingProxyType({})
#: the table layers bind while a model is built (use_ops)
_building: Mapping[str, LayerOp] = _NO_OPS


def is_known_op(name: str) -> bool:
    """A core contract, or a plugin's own dotted name."""
    return name in OP_CONTRACTS or "." in name


def _unknown(name: str) -> str:
    return (f"unknown layer op {name!r}; known: {', '.join(OP_CONTRACTS)} (a plugin's own op takes a "
            "dotted name, e.g. 'myplugin.fused_gate')")


def registered_ops(platform_name: str) -> dict[str, LayerOp]:
    """Op name -> implementation registered for ``platform_name`` through ``pagedlm_register_ops``,
    imported now. Ops missing from the result run core's torch code on that platform.

    Raises :class:`~pagedlm.core.plugins.PluginError` for a registration of an unknown op name (on
    any platform) or one whose function cannot be imported, naming the plugin.
    """
    from pagedlm.core.plugins import PluginError, get_plugins, resolve_class_path

    ops: dict[str, LayerOp] = {}
    for spec in get_plugins().ops():
        if not is_known_op(spec.op_name):
            raise PluginError(f"plugin {spec.plugin!r} registers {_unknown(spec.op_name)}")
        if spec.platform != platform_name:
            continue
        try:
            fn = resolve_class_path(spec.function_path)
        except Exception as e:
            raise PluginError(f"plugin {spec.plugin!r}: layer op {spec.op_name!r} for platform {platform_name!r}: "
                              f"cannot import {spec.function_path}: {type(e).__name__}: {e}") from e
        if not callable(fn):
            raise PluginError(f"plugin {spec.plugin!r}: {spec.function_path} (layer op {spec.op_name!r}) "
                              "is not callable")
        ops[spec.op_name] = fn
    return ops


@contextmanager
def use_ops(ops: Mapping[str, LayerOp]) -> Iterator[None]:
    """Layers and samplers built inside take their op implementations from ``ops`` (e.g.
    :func:`registered_ops`'s table, or a test's own); outside, the previous table is back."""
    global _building
    unknown = [name for name in ops if not is_known_op(name)]
    if unknown:
        raise ValueError(_unknown(unknown[0]))
    previous = _building
    _building = MappingProxyType(dict(ops))
    try:
        yield
    finally:
        _building = previous


def bound_op(name: str) -> LayerOp | None:
    """For a layer's constructor: the implementation of op ``name`` the model is being built with,
    or None (the layer runs its torch code)."""
    if not is_known_op(name):
        raise ValueError(_unknown(name))
    return _building.get(name)
