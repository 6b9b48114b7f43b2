"""Shared model layers: rotary and RMSNorm against HF, tensor-parallel sharding math."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import (
    LlamaRMSNorm,
    LlamaRotaryEmbedding,
    apply_rotary_pos_emb,
)

import pagedlm.core.distributed as dist_mod
from pagedlm.core.distributed import GroupCoordinator
from pagedlm.core.layers import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    ParallelLMHead,
    QKVParallelLinear,
    ReplicatedLinear,
    RMSNorm,
    RowParallelLinear,
    SiluAndMul,
    VocabParallelEmbedding,
    compute_logits,
    get_rope,
)
from pagedlm.core.layers.rotary import rope_parameters

HEAD_DIM = 64
NUM_HEADS = 4
NUM_KV_HEADS = 2
MAX_POS = 512


# -- rotary ----------------------------------------------------------------------------------------


def _hf_rotary(config: LlamaConfig, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
    """HF's rotary on flat ``q [T, H*D]``, ``k [T, Hkv*D]``; returns flat tensors."""
    rope = LlamaRotaryEmbedding(config)
    num_tokens = positions.shape[0]
    qh = q.view(1, num_tokens, -1, HEAD_DIM).transpose(1, 2)
    kh = k.view(1, num_tokens, -1, HEAD_DIM).transpose(1, 2)
    cos, sin = rope(qh, positions[None])
    q_out, k_out = apply_rotary_pos_emb(qh, kh, cos, sin)
    return q_out.transpose(1, 2).reshape(num_tokens, -1), k_out.transpose(1, 2).reshape(num_tokens, -1)


def _llama_config(**rope: object) -> LlamaConfig:
    return LlamaConfig(
        hidden_size=HEAD_DIM * NUM_HEADS, num_attention_heads=NUM_HEADS, num_key_value_heads=NUM_KV_HEADS,
        max_position_embeddings=MAX_POS, **rope,
    )


LLAMA3 = {
    "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
    # small so the head's frequencies fall in all three bands (kept, smoothed, divided)
    "original_max_position_embeddings": 64,
}


@pytest.mark.parametrize(
    "rope_kwargs",
    [
        {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}},
        {"rope_parameters": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0}},
        {"rope_parameters": {**LLAMA3, "rope_theta": 500000.0}},
        {"rope_parameters": {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}},
        {"rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                             "original_max_position_embeddings": MAX_POS // 4}},
    ],
    ids=["default", "linear", "llama3", "dynamic", "yarn"],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_matches_hf(rope_kwargs: dict, dtype: torch.dtype) -> None:
    config = _llama_config(**rope_kwargs)
    gen = torch.Generator().manual_seed(0)
    positions = torch.tensor([0, 1, 2, 3, 7, 100, 255, 511, 300, 5])
    q = torch.randn(len(positions), NUM_HEADS * HEAD_DIM, generator=gen).to(dtype)
    k = torch.randn(len(positions), NUM_KV_HEADS * HEAD_DIM, generator=gen).to(dtype)

    rope = get_rope(HEAD_DIM, MAX_POS, config)
    q_ours, k_ours = rope(positions, q, k)
    q_hf, k_hf = _hf_rotary(config, positions, q, k)
    assert q_ours.dtype == dtype and q_ours.shape == q.shape and k_ours.shape == k.shape
    # Same float32 table and the same sequence of rounded ops as HF: equal bit for bit.
    torch.testing.assert_close(q_ours, q_hf, atol=0, rtol=0)
    torch.testing.assert_close(k_ours, k_hf, atol=0, rtol=0)


def test_rope_reads_old_config_layout() -> None:
    """``rope_theta`` + ``rope_scaling`` (pre-transformers-5 attributes, ``type`` key) give the
    same embedding as the new ``rope_parameters`` dict."""
    old = SimpleNamespace(rope_theta=500000.0, rope_scaling={**{k: v for k, v in LLAMA3.items() if k != "rope_type"},
                                                              "type": "llama3"})
    params = rope_parameters(old)
    assert params["rope_type"] == "llama3" and params["rope_theta"] == 500000.0
    assert params["partial_rotary_factor"] == 1.0
    new = _llama_config(rope_parameters={**LLAMA3, "rope_theta": 500000.0})
    a = get_rope(HEAD_DIM, MAX_POS, old)
    b = get_rope(HEAD_DIM, MAX_POS, new)
    assert torch.equal(a.cos_sin_cache, b.cos_sin_cache)
    plain = get_rope(HEAD_DIM, MAX_POS, SimpleNamespace(rope_theta=10000.0))
    assert not torch.equal(plain.cos_sin_cache, a.cos_sin_cache)


def test_rope_is_shared_between_identical_requests() -> None:
    config = _llama_config()
    assert get_rope(HEAD_DIM, MAX_POS, config) is get_rope(HEAD_DIM, MAX_POS, config)


def test_partial_rotary_factor() -> None:
    """Only the first ``head_size * factor`` features rotate, as a full rope of that width."""
    half = SimpleNamespace(rope_theta=10000.0, partial_rotary_factor=0.5)
    partial = get_rope(HEAD_DIM, MAX_POS, half)
    assert partial.rotary_dim == HEAD_DIM // 2
    full_small = get_rope(HEAD_DIM // 2, MAX_POS, SimpleNamespace(rope_theta=10000.0))
    positions = torch.arange(9)
    q = torch.randn(9, 2, HEAD_DIM)
    q_out, _ = partial(positions, q.reshape(9, -1))
    q_out = q_out.view(9, 2, HEAD_DIM)
    expected, _ = full_small(positions, q[..., : HEAD_DIM // 2].reshape(9, -1))
    torch.testing.assert_close(q_out[..., : HEAD_DIM // 2], expected.view(9, 2, -1), atol=0, rtol=0)
    assert torch.equal(q_out[..., HEAD_DIM // 2 :], q[..., HEAD_DIM // 2 :])


def test_unsupported_rope_type_is_refused() -> None:
    with pytest.raises(ValueError, match="rope_type='longrope'"):
        get_rope(HEAD_DIM, MAX_POS, SimpleNamespace(rope_parameters={"rope_type": "longrope", "rope_theta": 1.0}))


# -- norm / activation -------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_rmsnorm_matches_hf_bitwise(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    hidden = 96
    ours = RMSNorm(hidden, eps=1e-5).to(dtype)
    theirs = LlamaRMSNorm(hidden, eps=1e-5).to(dtype)
    weight = torch.rand(hidden) + 0.5
    ours.weight.data.copy_(weight)
    theirs.weight.data.copy_(weight)
    x = (torch.randn(7, hidden) * 3).to(dtype)
    residual = torch.randn(7, hidden).to(dtype)
    assert torch.equal(ours(x), theirs(x))
    normed, summed = ours(x, residual)
    assert torch.equal(summed, residual + x)
    assert torch.equal(normed, theirs(residual + x))


def test_silu_and_mul() -> None:
    x = torch.randn(5, 2 * 12)
    expected = torch.nn.functional.silu(x[:, :12]) * x[:, 12:]
    assert torch.equal(SiluAndMul()(x), expected)


# -- tensor-parallel sharding --------------------------------------------------------------------------


class _PartialGroup(GroupCoordinator):
    """A fake TP group: collectives return this rank's local tensor, so a test can run every
    rank in turn and combine the partial results itself."""

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    def all_gather(self, tensor: torch.Tensor, dim: int = -1) -> torch.Tensor:
        return tensor


@pytest.fixture
def fake_tp(monkeypatch: pytest.MonkeyPatch):
    """``fake_tp(rank, size)`` makes layers built afterwards see that TP rank and size."""

    def set_rank(rank: int, size: int = 2) -> None:
        monkeypatch.setattr(dist_mod, "_TP", _PartialGroup(rank_in_group=rank, world_size=size))

    return set_rank


def test_replicated_and_single_rank_linear_match_nn_linear() -> None:
    torch.manual_seed(0)
    ref = torch.nn.Linear(16, 24)
    x = torch.randn(3, 16)
    for layer in (ReplicatedLinear(16, 24, bias=True), ColumnParallelLinear(16, 24, bias=True)):
        layer.weight.weight_loader(layer.weight, ref.weight.data)
        layer.bias.weight_loader(layer.bias, ref.bias.data)
        assert torch.equal(layer(x), ref(x))
    row = RowParallelLinear(16, 24, bias=True)
    row.weight.weight_loader(row.weight, ref.weight.data)
    row.bias.weight_loader(row.bias, ref.bias.data)
    assert torch.equal(row(x), ref(x))


def test_qkv_sharding_with_replicated_kv_heads(fake_tp) -> None:
    """4 query heads, 1 KV head, tp=2: each rank gets 2 query heads and a copy of the KV head."""
    head, hidden, heads, kv_heads = 8, 16, 4, 1
    torch.manual_seed(0)
    wq = torch.randn(heads * head, hidden)
    wk = torch.randn(kv_heads * head, hidden)
    wv = torch.randn(kv_heads * head, hidden)
    bq, bk, bv = torch.randn(heads * head), torch.randn(kv_heads * head), torch.randn(kv_heads * head)
    for rank in range(2):
        fake_tp(rank)
        layer = QKVParallelLinear(hidden, head, heads, kv_heads, bias=True)
        assert (layer.num_heads, layer.num_kv_heads, layer.num_kv_head_replicas) == (2, 1, 2)
        assert layer.weight.shape == ((2 + 2 * 1) * head, hidden)
        for sid, w, b in (("q", wq, bq), ("k", wk, bk), ("v", wv, bv)):
            layer.weight.weight_loader(layer.weight, w, sid)
            layer.bias.weight_loader(layer.bias, b, sid)
        q_rows = slice(rank * 2 * head, (rank + 1) * 2 * head)
        assert torch.equal(layer.weight[: 2 * head], wq[q_rows])
        assert torch.equal(layer.weight[2 * head : 3 * head], wk)
        assert torch.equal(layer.weight[3 * head :], wv)
        assert torch.equal(layer.bias, torch.cat([bq[q_rows], bk, bv]))
        # A checkpoint that stores q/k/v fused loads identically.
        fused = QKVParallelLinear(hidden, head, heads, kv_heads, bias=False)
        fused.weight.weight_loader(fused.weight, torch.cat([wq, wk, wv]))
        assert torch.equal(fused.weight, layer.weight)


def test_qkv_sharding_with_split_kv_heads(fake_tp) -> None:
    """4 query heads, 2 KV heads, tp=2: KV heads are split, not replicated."""
    head, hidden = 4, 8
    wk = torch.arange(2 * head * hidden, dtype=torch.float32).view(2 * head, hidden)
    for rank in range(2):
        fake_tp(rank)
        layer = QKVParallelLinear(hidden, head, 4, 2)
        assert (layer.num_heads, layer.num_kv_heads, layer.num_kv_head_replicas) == (2, 1, 1)
        layer.weight.weight_loader(layer.weight, wk, "k")
        assert torch.equal(layer.weight[2 * head : 3 * head], wk[rank * head : (rank + 1) * head])


def test_indivisible_heads_are_refused(fake_tp) -> None:
    fake_tp(0, 3)
    with pytest.raises(ValueError, match="not divisible by the tensor-parallel size 3"):
        QKVParallelLinear(16, 4, 4, 2)


def test_column_then_row_parallel_sums_to_full_mlp(fake_tp) -> None:
    """gate_up (merged column) -> SiluAndMul -> down (row): per-rank partial outputs sum to the
    unsharded MLP, and the row bias is stored whole and added once after the reduction."""
    torch.manual_seed(0)
    hidden, inter = 8, 12
    gate, up, down = torch.randn(inter, hidden), torch.randn(inter, hidden), torch.randn(hidden, inter)
    x = torch.randn(5, hidden)
    expected = (torch.nn.functional.silu(x @ gate.T) * (x @ up.T)) @ down.T
    total = torch.zeros_like(expected)
    for rank in range(2):
        fake_tp(rank)
        gate_up = MergedColumnParallelLinear(hidden, [inter, inter])
        gate_up.weight.weight_loader(gate_up.weight, gate, 0)
        gate_up.weight.weight_loader(gate_up.weight, up, 1)
        half = inter // 2
        assert torch.equal(gate_up.weight[:half], gate[rank * half : (rank + 1) * half])
        assert torch.equal(gate_up.weight[half:], up[rank * half : (rank + 1) * half])
        row = RowParallelLinear(inter, hidden, bias=True)
        row.weight.weight_loader(row.weight, down)
        bias = torch.randn(hidden)
        row.bias.weight_loader(row.bias, bias)
        assert row.weight.shape == (hidden, half) and row.bias.shape == (hidden,)
        # the fake all-reduce is the identity, so each rank returns partial + bias
        total += row(SiluAndMul()(gate_up(x))) - bias
    torch.testing.assert_close(total, expected, atol=1e-5, rtol=1e-5)


def test_vocab_parallel_embedding_and_logits(fake_tp) -> None:
    """Vocab 10 over 2 ranks (5 rows each): lookups are masked per rank and sum to the full
    embedding; each rank's logits are its vocab columns."""
    torch.manual_seed(0)
    vocab, dim = 10, 4
    table = torch.randn(vocab, dim)
    ids = torch.tensor([0, 4, 5, 9, 3])
    hidden = torch.randn(3, dim)
    total = torch.zeros(len(ids), dim)
    for rank in range(2):
        fake_tp(rank)
        emb = VocabParallelEmbedding(vocab, dim)
        emb.weight.weight_loader(emb.weight, table)
        assert torch.equal(emb.weight, table[rank * 5 : (rank + 1) * 5])
        total += emb(ids)
        head = ParallelLMHead(vocab, dim).tie_weights(emb)
        assert head.weight is emb.weight
        logits = compute_logits(head, hidden, vocab_size=vocab)
        torch.testing.assert_close(logits, hidden @ table[rank * 5 : (rank + 1) * 5].T)
    assert torch.equal(total, table[ids])


def test_vocab_padding_rows_are_zero(fake_tp) -> None:
    """Vocab 9 over 2 ranks pads to 10; rank 1 holds 4 real rows and one zero row."""
    table = torch.randn(9, 3)
    fake_tp(1)
    emb = VocabParallelEmbedding(9, 3)
    emb.weight.data.fill_(float("nan"))
    emb.weight.weight_loader(emb.weight, table)
    assert (emb.vocab_start, emb.vocab_end, emb.weight.shape[0]) == (5, 9, 5)
    assert torch.equal(emb.weight[:4], table[5:]) and torch.equal(emb.weight[4], torch.zeros(3))


def test_single_rank_logits_are_float32() -> None:
    emb = VocabParallelEmbedding(7, 4, params_dtype=torch.bfloat16)
    emb.weight.weight_loader(emb.weight, torch.randn(7, 4))
    logits = compute_logits(emb, torch.randn(2, 4, dtype=torch.bfloat16))
    assert logits.dtype == torch.float32 and logits.shape == (2, 7)
