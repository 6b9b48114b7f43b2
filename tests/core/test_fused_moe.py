"""FusedMoE without a model: routing against HF's routers, the torch op against a per-token loop,
the block-aligned layout, per-expert weight loading, TP and expert-parallel sharding (partial
outputs of simulated ranks sum to the whole), op binding, the quantization seam and the option."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
import torch
import torch.nn.functional as F

from pagedlm.core.layers import custom_ops
from pagedlm.core.layers.fused_moe import (
    ExpertWeightLoader,
    FusedMoE,
    determine_expert_map,
    fused_experts,
    fused_topk,
    moe_align_block_size,
    reference,
)

DTYPES = [torch.float32, torch.bfloat16]


def loop_reference(x, w13, w2, weights, ids, expert_map=None):
    """One (token, expert) pair at a time, in float64."""
    inter = w13.shape[1] // 2
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for k in range(ids.shape[1]):
            e = int(ids[t, k]) if expert_map is None else int(expert_map[int(ids[t, k])])
            if e < 0:
                continue
            h = w13[e].double() @ x[t].double()
            out[t] += float(weights[t, k]) * (w2[e].double() @ (F.silu(h[:inter]) * h[inter:]))
    return out


def random_moe(tokens=23, hidden=48, inter=40, experts=8, top_k=2, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=gen).to(dtype)
    w13 = (torch.randn(experts, 2 * inter, hidden, generator=gen) / hidden**0.5).to(dtype)
    w2 = (torch.randn(experts, hidden, inter, generator=gen) / inter**0.5).to(dtype)
    weights, ids = fused_topk(x, torch.randn(tokens, experts, generator=gen), top_k, True)
    return x, w13, w2, weights, ids


# -- routing -------------------------------------------------------------------------------------


@pytest.mark.parametrize("norm", [True, False])
def test_topk_matches_hf_qwen3_moe_router(norm):
    import transformers
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    config = transformers.Qwen3MoeConfig(hidden_size=32, num_experts=16, num_experts_per_tok=4, norm_topk_prob=norm)
    router = Qwen3MoeTopKRouter(config)
    # NOTE: seeded: with the global RNG's state of the moment, a row's top-4 could sum to 1.0 in float32
    gen = torch.Generator().manual_seed(0)
    torch.nn.init.normal_(router.weight, generator=gen)
    x = torch.randn(37, 32, generator=gen)
    logits, hf_weights, hf_ids = router(x)
    weights, ids = fused_topk(x, logits, 4, norm)
    assert ids.dtype == torch.int32 and weights.dtype == torch.float32
    assert torch.equal(ids.long(), hf_ids)
    torch.testing.assert_close(weights, hf_weights.float(), atol=1e-7, rtol=1e-6)
    if norm:
        torch.testing.assert_close(weights.sum(-1), torch.ones(37))
    else:
        assert (weights.sum(-1) < 1).all()


def test_topk_matches_hf_mixtral_router():
    import transformers
    from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter

    config = transformers.MixtralConfig(hidden_size=32, num_local_experts=8, num_experts_per_tok=2)
    router = MixtralTopKRouter(config)
    torch.nn.init.normal_(router.weight)
    x = torch.randn(19, 32).bfloat16()
    router = router.bfloat16()
    logits, hf_weights, hf_ids = router(x)
    weights, ids = fused_topk(x, logits, 2, True)  # router logits in bf16, softmax in float32
    assert torch.equal(ids.long(), hf_ids)
    torch.testing.assert_close(weights, hf_weights.float())


def test_topk_rejects_bad_arguments():
    with pytest.raises(ValueError, match="top_k=9"):
        fused_topk(torch.zeros(2, 4), torch.zeros(2, 8), 9, True)
    with pytest.raises(ValueError, match="3 tokens"):
        fused_topk(torch.zeros(2, 4), torch.zeros(3, 8), 2, True)


# -- the torch op --------------------------------------------------------------------------------


@pytest.mark.parametrize("shape", [(1, 32, 16, 4, 1), (23, 48, 40, 8, 2), (64, 32, 24, 16, 8)],
                         ids=lambda s: "T{}-H{}-I{}-E{}-top{}".format(*s))
def test_reference_matches_loop(shape):
    t, h, i, e, k = shape
    x, w13, w2, weights, ids = random_moe(t, h, i, e, k)
    out = fused_experts(x, w13, w2, weights, ids)
    assert out.shape == x.shape and out.dtype == x.dtype
    torch.testing.assert_close(out.double(), loop_reference(x, w13, w2, weights, ids), atol=2e-5, rtol=1e-5)


def test_reference_in_bf16_rounds_like_per_expert_linears():
    x, w13, w2, weights, ids = random_moe(dtype=torch.bfloat16)
    out = fused_experts(x, w13, w2, weights, ids)
    assert out.dtype == torch.bfloat16
    want = loop_reference(x, w13, w2, weights, ids)
    torch.testing.assert_close(out.double(), want, atol=3e-2, rtol=3e-2)


def test_reference_with_expert_map_computes_only_local_experts():
    x, w13, w2, weights, ids = random_moe(experts=8)
    local, expert_map = determine_expert_map(2, 1, 8)
    assert local == 4 and expert_map.tolist() == [-1, -1, -1, -1, 0, 1, 2, 3]
    out = fused_experts(x, w13[4:], w2[4:], weights, ids, expert_map)
    torch.testing.assert_close(out.double(), loop_reference(x, w13[4:], w2[4:], weights, ids, expert_map),
                               atol=2e-5, rtol=1e-5)
    _, first = determine_expert_map(2, 0, 8)
    both = out + fused_experts(x, w13[:4], w2[:4], weights, ids, first)
    torch.testing.assert_close(both, fused_experts(x, w13, w2, weights, ids), atol=1e-5, rtol=1e-5)


def test_padded_bmm_fallback_equals_grouped_matmul(monkeypatch):
    x, w13, w2, weights, ids = random_moe(tokens=31)
    want = fused_experts(x, w13, w2, weights, ids)
    monkeypatch.setattr(reference, "_grouped_mm", None)  # torch < 2.9
    torch.testing.assert_close(fused_experts(x, w13, w2, weights, ids), want, atol=1e-6, rtol=1e-6)


def test_uneven_expert_split():
    assert determine_expert_map(1, 0, 6) == (6, None)
    maps = [determine_expert_map(4, r, 6) for r in range(4)]
    assert [m[0] for m in maps] == [2, 2, 1, 1]
    assert maps[2][1].tolist() == [-1, -1, -1, -1, 0, -1]
    with pytest.raises(ValueError, match="at least 4 experts"):
        determine_expert_map(4, 0, 3)


# -- the block-aligned layout --------------------------------------------------------------------


@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("expert_parallel", [False, True])
def test_moe_align_block_size(block_size, expert_parallel):
    _, _, _, _, ids = random_moe(tokens=37, experts=8, top_k=3)
    num_experts, expert_map = (4, determine_expert_map(2, 1, 8)[1]) if expert_parallel else (8, None)
    sorted_ids, expert_ids, num_post = moe_align_block_size(ids, block_size, num_experts, expert_map)
    pairs = ids.numel()
    local = ids.flatten().long() if expert_map is None else expert_map[ids.flatten().long()].long()
    assert sorted_ids.dtype == expert_ids.dtype == num_post.dtype == torch.int32
    assert len(sorted_ids) >= pairs + num_experts * (block_size - 1) and len(sorted_ids) % block_size == 0
    assert len(expert_ids) == len(sorted_ids) // block_size
    total = int(num_post)
    assert total % block_size == 0
    valid = sorted_ids[:total][sorted_ids[:total] < pairs]
    assert sorted(valid.tolist()) == sorted(p for p in range(pairs) if local[p] >= 0), "each local pair once"
    assert (sorted_ids[total:] == pairs).all(), "the tail is padding"
    for b in range(total // block_size):
        rows = sorted_ids[b * block_size : (b + 1) * block_size]
        rows = rows[rows < pairs].long()
        assert (local[rows] == int(expert_ids[b])).all(), f"block {b} mixes experts"
        assert rows.tolist() == sorted(rows.tolist()), "pairs ascending within an expert"
    assert (expert_ids[total // block_size :] == -1).all()
    counts = torch.bincount(local[local >= 0], minlength=num_experts)
    assert total == int(((counts + block_size - 1) // block_size * block_size).sum())


# -- the layer: weights, sharding, ops -----------------------------------------------------------


@contextlib.contextmanager
def as_tp_rank(rank: int, size: int) -> Iterator[None]:
    """Build layers as rank ``rank`` of a ``size``-rank tensor-parallel group (no processes: the
    layers are only constructed, loaded and run with ``reduce_results=False``)."""
    from pagedlm.core.distributed import init_model_parallel

    init_model_parallel(rank, size, None)
    try:
        yield
    finally:
        init_model_parallel(0, 1, None)


def checkpoint_tensors(w13, w2, prefix="mlp.experts"):
    """A per-expert HF checkpoint (Qwen names) of the stacked weights."""
    inter = w13.shape[1] // 2
    for e in range(w13.shape[0]):
        yield f"{prefix}.{e}.gate_proj.weight", w13[e, :inter].clone()
        yield f"{prefix}.{e}.up_proj.weight", w13[e, inter:].clone()
        yield f"{prefix}.{e}.down_proj.weight", w2[e].clone()


class Block(torch.nn.Module):
    def __init__(self, experts, top_k, hidden, inter, **kwargs):
        super().__init__()
        self.mlp = torch.nn.Module()
        self.mlp.experts = FusedMoE(experts, top_k, hidden, inter, prefix="mlp.experts", **kwargs)


def load_block(w13, w2, top_k, **kwargs) -> tuple[Block, set[str]]:
    block = Block(w13.shape[0], top_k, w13.shape[2], w13.shape[1] // 2, **kwargs)
    loader = ExpertWeightLoader(block, FusedMoE.make_expert_params_mapping("gate_proj", "down_proj", "up_proj",
                                                                          w13.shape[0]))
    rest = list(loader.filter(checkpoint_tensors(w13, w2)))
    assert rest == []
    return block, loader.loaded


def test_weight_loader_stacks_experts_and_forward_matches():
    x, w13, w2, _, _ = random_moe()
    block, loaded = load_block(w13, w2, 2, renormalize=True)
    assert loaded == {"mlp.experts.w13_weight", "mlp.experts.w2_weight"}
    moe = block.mlp.experts
    assert torch.equal(moe.w13_weight, w13) and torch.equal(moe.w2_weight, w2)
    logits = torch.randn(x.shape[0], 8)
    weights, ids = fused_topk(x, logits, 2, True)
    torch.testing.assert_close(moe(x, logits), fused_experts(x, w13, w2, weights, ids))


def test_missing_expert_is_not_loaded_and_other_tensors_pass_through():
    _, w13, w2, _, _ = random_moe(experts=4)
    block = Block(4, 2, w13.shape[2], w13.shape[1] // 2)
    loader = ExpertWeightLoader(block, FusedMoE.make_expert_params_mapping("gate_proj", "down_proj", "up_proj", 4))
    tensors = [(n, t) for n, t in checkpoint_tensors(w13, w2) if not n.startswith("mlp.experts.3.up_proj")]
    tensors.append(("mlp.gate.weight", torch.zeros(4, 8)))
    assert [n for n, _ in loader.filter(tensors)] == ["mlp.gate.weight"]
    assert loader.loaded == {"mlp.experts.w2_weight"}, "w13 lacks expert 3's up projection"
    with pytest.raises(ValueError, match="matches no parameter"):
        list(loader.filter([("other.experts.0.gate_proj.weight", torch.zeros(1))]))


@pytest.mark.parametrize("expert_parallel", [False, True], ids=["tp", "ep"])
def test_ranks_partial_outputs_sum_to_the_whole(expert_parallel):
    x, w13, w2, _, _ = random_moe(experts=8, inter=40)
    logits = torch.randn(x.shape[0], 8)
    whole, _ = load_block(w13, w2, 2)
    want = whole.mlp.experts(x, logits)
    total = torch.zeros_like(want)
    for rank in range(2):
        with as_tp_rank(rank, 2):
            block, loaded = load_block(w13, w2, 2, enable_expert_parallel=expert_parallel)
        moe = block.mlp.experts
        assert loaded == {"mlp.experts.w13_weight", "mlp.experts.w2_weight"}
        if expert_parallel:
            assert (moe.tp_size, moe.ep_size, moe.local_num_experts) == (1, 2, 4)
            assert torch.equal(moe.w13_weight, w13[rank * 4 : rank * 4 + 4])
        else:
            assert (moe.tp_size, moe.ep_size, moe.intermediate_size_per_partition) == (2, 1, 20)
            assert torch.equal(moe.w13_weight[:, :20], w13[:, rank * 20 : rank * 20 + 20])
            assert torch.equal(moe.w13_weight[:, 20:], w13[:, 40 + rank * 20 : 60 + rank * 20])
            assert torch.equal(moe.w2_weight, w2[:, :, rank * 20 : rank * 20 + 20])
        total += moe(x, logits)  # reduce_results=False: this rank's partial sum
    torch.testing.assert_close(total, want, atol=1e-5, rtol=1e-5)


def test_intermediate_not_divisible_by_tp_names_expert_parallelism():
    with as_tp_rank(0, 2), pytest.raises(ValueError, match="enable_expert_parallel"):
        FusedMoE(4, 2, 16, 15, prefix="layers.0.mlp.experts")
    with as_tp_rank(0, 2):
        assert FusedMoE(4, 2, 16, 15, enable_expert_parallel=True).intermediate_size_per_partition == 15


def test_expert_parallel_comes_from_the_config_being_built():
    from pagedlm.core.config import ParallelConfig, VllmConfig
    from pagedlm.core.forward_context import set_current_vllm_config

    config = VllmConfig(parallel_config=ParallelConfig(enable_expert_parallel=True))
    with as_tp_rank(1, 2), set_current_vllm_config(config, object):  # type: ignore[arg-type]
        moe = FusedMoE(8, 2, 16, 32)
    assert moe.use_ep and moe.local_num_experts == 4 and moe.expert_map.tolist()[4:] == [0, 1, 2, 3]


def test_layer_binds_the_platform_op():
    calls = []

    def op(*args):
        calls.append(len(args))
        return fused_experts(*args)

    with custom_ops.use_ops({"fused_experts": op}):
        moe = FusedMoE(4, 2, 16, 8)
    moe.w13_weight.data.normal_()
    moe.w2_weight.data.normal_()
    moe(torch.randn(3, 16), torch.randn(3, 4))
    assert calls == [6]
    assert FusedMoE(4, 2, 16, 8)._fused_experts_op is None, "outside use_ops: core's torch code"


class _QuantConfig:
    def __init__(self, method):
        self.method = method

    def get_name(self):
        return "fp8"

    def get_quant_method(self, layer, prefix):
        return self.method


def test_a_method_that_does_not_quantize_experts_is_refused_by_name():
    assert isinstance(FusedMoE(4, 2, 16, 8, quant_config=_QuantConfig(None)).w13_weight, torch.nn.Parameter)
    with pytest.raises(NotImplementedError, match=r"layers\.3\.mlp\.experts: quantization method 'fp8' gave"):
        FusedMoE(4, 2, 16, 8, quant_config=_QuantConfig(object()), prefix="layers.3.mlp.experts")


def test_bad_layer_arguments():
    with pytest.raises(ValueError, match="scoring_func"):
        FusedMoE(4, 2, 16, 8, scoring_func="sigmoid")
    with pytest.raises(ValueError, match="activation"):
        FusedMoE(4, 2, 16, 8, activation="gelu")
    moe = FusedMoE(4, 2, 16, 8)
    with pytest.raises(ValueError, match="expert 4"):
        moe.weight_loader(moe.w2_weight, torch.zeros(16, 8), "x", "w2", 4)
    with pytest.raises(ValueError, match=r"gives \(8, 17\)"):
        moe.weight_loader(moe.w13_weight, torch.zeros(8, 17), "x", "w1", 0)


def test_enable_expert_parallel_option():
    from pagedlm.core.engine.arg_utils import EngineArgs

    parser = EngineArgs.add_cli_args(__import__("argparse").ArgumentParser())
    args = EngineArgs.from_cli_args(parser.parse_args(["--enable-expert-parallel"]))
    assert args.enable_expert_parallel is True
    assert args.create_vllm_config().parallel_config.enable_expert_parallel is True
    assert EngineArgs().create_vllm_config().parallel_config.enable_expert_parallel is False
