"""Quantized experts without a model: the torch references of the quantized ``fused_experts`` ops
against per-pair loops, the FP8 / packed-integer methods' loading (online FP8 scales, TP slices of
packed weights, scales and zero points, whole experts per rank), and the refusals."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from test_fused_moe import as_tp_rank, random_moe

from pagedlm.core.layers.fused_moe import ExpertWeightLoader, FusedMoE, fused_topk
from pagedlm.core.layers.fused_moe.quantized_reference import fused_experts_fp8, fused_experts_wna16
from pagedlm.core.layers.quantization.compressed_tensors import CompressedTensorsConfig
from pagedlm.core.layers.quantization.fp8 import Fp8Config
from pagedlm.core.layers.quantization.utils import pack_cols, pack_rows

FP8 = torch.float8_e4m3fn


def _through_fp8(x):
    s = (x.abs().amax(-1, keepdim=True) / 448).clamp(min=1e-12)
    return (x / s).clamp(-448, 448).to(FP8).float() * s


def _loop(x, w13, w2, weights, ids, quantize_inputs):
    """One (token, expert) pair at a time in float32, weights given in full precision."""
    inter = w13.shape[1] // 2
    out = torch.zeros(x.shape)
    xs = _through_fp8(x) if quantize_inputs else x
    for t in range(x.shape[0]):
        for k in range(ids.shape[1]):
            e = int(ids[t, k])
            h = w13[e] @ xs[t]
            act = F.silu(h[:inter]) * h[inter:]
            if quantize_inputs:
                act = _through_fp8(act)
            out[t] += float(weights[t, k]) * (w2[e] @ act)
    return out


def _int_experts(w, bits, group, symmetric, seed=0):
    """Random packed experts of ``w``'s shape ``[E, N, K]``: (packed, scales, zeros | None,
    their dequantized weights [E, N, K], written out elementwise)."""
    gen = torch.Generator().manual_seed(seed)
    e, n, k = w.shape
    groups = 1 if group == -1 else k // group
    q = torch.randint(0, 1 << bits, (e, n, k), generator=gen, dtype=torch.int32)
    scales = torch.rand(e, n, groups, generator=gen) * 0.02 + 0.005
    zeros = None if symmetric else torch.randint(0, 1 << bits, (e, n, groups), generator=gen, dtype=torch.int32)
    g_of_k = torch.zeros(k, dtype=torch.long) if group == -1 else torch.arange(k) // group
    z = (1 << (bits - 1)) if zeros is None else zeros[:, :, g_of_k]
    deq = (q - z).float() * scales[:, :, g_of_k]
    packed = torch.stack([pack_cols(q[i], bits) for i in range(e)])
    return packed, scales, zeros, deq


def test_fp8_reference_matches_a_loop():
    x, w13, w2, weights, ids = random_moe(tokens=9, experts=6, top_k=3)
    s13, s2 = w13.abs().amax(-1) / 448, w2.abs().amax(-1) / 448
    q13, q2 = (w13 / s13[..., None]).to(FP8), (w2 / s2[..., None]).to(FP8)
    want = _loop(x, q13.float() * s13[..., None], q2.float() * s2[..., None], weights, ids, quantize_inputs=True)
    torch.testing.assert_close(fused_experts_fp8(x, q13, q2, s13, s2, weights, ids), want, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize(("bits", "group", "symmetric"), [(4, 8, True), (4, 8, False), (8, -1, True)])
def test_wna16_reference_matches_a_loop_and_skips_other_ranks_experts(bits, group, symmetric):
    x, w13, w2, weights, ids = random_moe(tokens=9, hidden=32, inter=16, experts=6, top_k=2)
    p13, s13, z13, d13 = _int_experts(w13, bits, group, symmetric)
    p2, s2, z2, d2 = _int_experts(w2, bits, group, symmetric, seed=1)
    out = fused_experts_wna16(x, p13, p2, s13, s2, z13, z2, weights, ids, None, bits, group)
    torch.testing.assert_close(out, _loop(x, d13, d2, weights, ids, quantize_inputs=False), atol=1e-5, rtol=1e-4)
    # rank 1 of 2 (experts 3..5): only its pairs
    expert_map = torch.tensor([-1, -1, -1, 0, 1, 2], dtype=torch.int32)
    local = fused_experts_wna16(x, p13[3:], p2[3:], s13[3:], s2[3:], None if z13 is None else z13[3:],
                                None if z2 is None else z2[3:], weights, ids, expert_map, bits, group)
    keep = ids >= 3
    want = _loop(x, d13, d2, weights * keep, ids, quantize_inputs=False)
    torch.testing.assert_close(local, want, atol=1e-5, rtol=1e-4)


# -- loading ----------------------------------------------------------------------------------------


def _ct_config(bits=4, group=8, symmetric=True, **weights):
    strategy = "group" if group != -1 else "channel"
    return CompressedTensorsConfig.from_config({"format": "pack-quantized", "ignore": ["lm_head"], "config_groups": {
        "g": {"targets": ["Linear"], "weights": {"num_bits": bits, "type": "int", "symmetric": symmetric,
                                                 "strategy": strategy, "group_size": None if group == -1 else group,
                                                 **weights}}}})


def _ct_tensors(p13, s13, z13, p2, s2, z2, bits):
    """Per-expert compressed-tensors checkpoint tensors (Qwen names) of stacked packed experts."""
    inter = p13.shape[1] // 2
    for e in range(p13.shape[0]):
        for proj, rows in (("gate_proj", slice(0, inter)), ("up_proj", slice(inter, 2 * inter))):
            yield f"mlp.experts.{e}.{proj}.weight_packed", p13[e, rows].clone()
            yield f"mlp.experts.{e}.{proj}.weight_scale", s13[e, rows].clone()
            yield f"mlp.experts.{e}.{proj}.weight_shape", torch.tensor([inter, p13.shape[2] * 32 // bits])
            if z13 is not None:
                yield f"mlp.experts.{e}.{proj}.weight_zero_point", pack_rows(z13[e, rows], bits)
        yield f"mlp.experts.{e}.down_proj.weight_packed", p2[e].clone()
        yield f"mlp.experts.{e}.down_proj.weight_scale", s2[e].clone()
        yield f"mlp.experts.{e}.down_proj.weight_shape", torch.tensor([p2.shape[1], inter])
        if z2 is not None:
            yield f"mlp.experts.{e}.down_proj.weight_zero_point", pack_rows(z2[e], bits)


class _Block(torch.nn.Module):
    def __init__(self, experts, hidden, inter, quant_config, **kwargs):
        super().__init__()
        self.mlp = torch.nn.Module()
        self.mlp.experts = FusedMoE(experts, 2, hidden, inter, quant_config=quant_config, prefix="mlp.experts",
                                    **kwargs)


def _load(tensors, experts, hidden, inter, quant_config, **kwargs):
    block = _Block(experts, hidden, inter, quant_config, **kwargs)
    loader = ExpertWeightLoader(block, FusedMoE.make_expert_params_mapping("gate_proj", "down_proj", "up_proj",
                                                                          experts))
    assert list(loader.filter(tensors)) == []
    moe = block.mlp.experts
    moe.quant_method.process_weights_after_loading(moe)
    return moe, loader.loaded


@pytest.mark.parametrize("expert_parallel", [False, True], ids=["tp", "ep"])
@pytest.mark.parametrize("symmetric", [True, False], ids=["sym", "asym"])
def test_wna16_ranks_hold_their_slices_and_partial_outputs_sum_to_the_whole(expert_parallel, symmetric):
    x, w13, w2, _, _ = random_moe(tokens=7, hidden=32, inter=32, experts=4)
    p13, s13, z13, _ = _int_experts(w13, 4, 8, symmetric)
    p2, s2, z2, _ = _int_experts(w2, 4, 8, symmetric, seed=1)
    logits = torch.randn(x.shape[0], 4)
    tensors = list(_ct_tensors(p13, s13, z13, p2, s2, z2, 4))
    whole, loaded = _load(tensors, 4, 32, 32, _ct_config(symmetric=symmetric))
    assert {"mlp.experts.w13_weight_packed", "mlp.experts.w2_weight_scale"} <= loaded
    assert torch.equal(whole.w13_weight_packed, p13) and torch.equal(whole.w2_weight_scale, s2)
    assert whole.w13_zeros is None if symmetric else torch.equal(whole.w13_zeros, z13)
    want = whole(x, logits)
    total = torch.zeros_like(want)
    for rank in range(2):
        with as_tp_rank(rank, 2):
            moe, _ = _load(tensors, 4, 32, 32, _ct_config(symmetric=symmetric), enable_expert_parallel=expert_parallel)
        if expert_parallel:
            assert torch.equal(moe.w13_weight_packed, p13[rank * 2 : rank * 2 + 2])
        else:
            half = slice(rank * 16, rank * 16 + 16)
            up = slice(32 + rank * 16, 48 + rank * 16)
            assert torch.equal(moe.w13_weight_packed, torch.cat([p13[:, half], p13[:, up]], 1))
            assert torch.equal(moe.w2_weight_packed, p2[:, :, rank * 2 : rank * 2 + 2])  # 16 columns = 2 words
            assert torch.equal(moe.w2_weight_scale, s2[:, :, rank * 2 : rank * 2 + 2])  # 16 columns = 2 groups
            if not symmetric:
                assert torch.equal(moe.w13_zeros, torch.cat([z13[:, half], z13[:, up]], 1))
                assert torch.equal(moe.w2_zeros, z2[:, :, rank * 2 : rank * 2 + 2])
        total += moe(x, logits)
    torch.testing.assert_close(total, want, atol=1e-5, rtol=1e-5)


def _fp_tensors(w13, w2):
    inter = w13.shape[1] // 2
    for e in range(w13.shape[0]):
        yield f"mlp.experts.{e}.gate_proj.weight", w13[e, :inter].clone()
        yield f"mlp.experts.{e}.up_proj.weight", w13[e, inter:].clone()
        yield f"mlp.experts.{e}.down_proj.weight", w2[e].clone()


def test_online_fp8_quantizes_each_checkpoint_tensor_with_its_own_scale():
    x, w13, w2, _, _ = random_moe(tokens=7, hidden=32, inter=16, experts=4)
    online = Fp8Config.from_config({})
    moe, loaded = _load(_fp_tensors(w13, w2), 4, 32, 16, online)
    assert loaded == {"mlp.experts.w13_weight", "mlp.experts.w2_weight"}
    gate, up = w13[:, :16].abs().amax((1, 2)) / 448, w13[:, 16:].abs().amax((1, 2)) / 448
    assert torch.equal(moe.w13_weight_scale, torch.cat([gate[:, None].expand(4, 16), up[:, None].expand(4, 16)], 1))
    assert torch.equal(moe.w2_weight_scale, (w2.abs().amax((1, 2)) / 448)[:, None].expand(4, 32))
    assert moe.w13_weight.dtype == FP8
    dequantized = moe.w13_weight.float() * moe.w13_weight_scale[..., None]
    assert (dequantized - w13).abs().max() <= w13.abs().max() / 16  # within FP8's relative step
    logits = torch.randn(7, 4)
    weights, ids = fused_topk(x, logits, 2, True)
    want = _loop(x, dequantized, moe.w2_weight.float() * moe.w2_weight_scale[..., None], weights, ids, True)
    torch.testing.assert_close(moe(x, logits), want, atol=1e-5, rtol=1e-4)
    # every rank quantizes alike (the scale of the whole tensor); whole experts per rank sum exactly
    total = torch.zeros(7, 32)
    for rank in range(2):
        with as_tp_rank(rank, 2):
            sliced, _ = _load(_fp_tensors(w13, w2), 4, 32, 16, online)
            assert torch.equal(sliced.w13_weight_scale[:, :8], moe.w13_weight_scale[:, :8])
            assert torch.equal(sliced.w13_weight[:, :8], moe.w13_weight[:, rank * 8 : rank * 8 + 8])
            placed, _ = _load(_fp_tensors(w13, w2), 4, 32, 16, online, enable_expert_parallel=True)
        total += placed(x, logits)
    torch.testing.assert_close(total, moe(x, logits), atol=1e-6, rtol=1e-6)


def test_dummy_weights_of_quantized_experts_are_usable():
    from pagedlm.core.model_loader.weight_utils import initialize_dummy_weights

    for config in (Fp8Config.from_config({}), _ct_config(symmetric=False)):
        block = _Block(4, 32, 16, config)
        initialize_dummy_weights(block, seed=0)
        moe = block.mlp.experts
        moe.quant_method.process_weights_after_loading(moe)
        out = moe(torch.randn(3, 32), torch.randn(3, 4))
        assert out.shape == (3, 32) and torch.isfinite(out).all()


def test_unsupported_expert_schemes_are_refused_by_name():
    with pytest.raises(ValueError, match=r"mlp\.experts: act-order"):
        _Block(4, 32, 16, _ct_config(actorder="group"))
    with pytest.raises(ValueError, match="intermediate size per rank is 12; it must be a multiple of 4 .* group_size"):
        _Block(4, 32, 12, _ct_config(bits=8))
    static_fp8 = Fp8Config.from_config({"quant_method": "fp8", "activation_scheme": "static"})
    with pytest.raises(ValueError, match="activation_scheme='static' are not supported"):
        _Block(4, 32, 16, static_fp8)
    int8 = CompressedTensorsConfig.from_config({"format": "int-quantized", "config_groups": {"g": {
        "targets": ["Linear"], "weights": {"num_bits": 8, "type": "int", "strategy": "channel"},
        "input_activations": {"num_bits": 8, "type": "int", "dynamic": True, "strategy": "token"}}},
        "ignore": ["lm_head"]})
    with pytest.raises(ValueError, match="int-quantized experts .* supported for experts: pack-quantized"):
        _Block(4, 32, 16, int8)
    ignored = CompressedTensorsConfig.from_config({"format": "pack-quantized", "ignore": ["lm_head", "re:.*experts.*"],
                                                   "config_groups": {"g": {"targets": ["Linear"], "weights": {
                                                       "num_bits": 4, "type": "int", "strategy": "channel"}}}})
    assert type(_Block(4, 32, 16, ignored).mlp.experts.quant_method).__name__ == "UnquantizedFusedMoEMethod"
