"""Model registry, weight loader, and full-model forward against HF transformers.

Tiny random checkpoints are written with ``save_pretrained`` (safetensors) and read back both by
transformers (the reference) and by :func:`pagedlm.core.model_loader.load_model`.

Two attention paths are checked: a dense reference backend defined here (prefill only, no cache;
it isolates the model code from any paged-attention bug) and, when installed, the ``cpu_paged``
backend with a real block table (prefill, then a decode step that reads the cache).
"""

from __future__ import annotations

import itertools
import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
import transformers
from safetensors.torch import save_file

from pagedlm.core.attention import (
    AttentionBackend,
    AttentionImpl,
    AttentionMetadataBuilder,
    CommonAttentionMetadata,
)
from pagedlm.core.config import LoadConfig, ModelConfig, VllmConfig
from pagedlm.core.forward_context import set_forward_context
from pagedlm.core.model_loader import get_model_class, load_model

VOCAB = 512

# name -> (HF config class, architecture, config overrides)
VARIANTS: dict[str, tuple[str, str, dict[str, Any]]] = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {"rope_theta": 500000.0}),
    # Llama 3.1-style scaling, tied embeddings, and both bias options switched on
    "llama-llama3-tied-bias": (
        "LlamaConfig", "LlamaForCausalLM",
        {
            "rope_parameters": {
                "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 16,
            },
            "tie_word_embeddings": True, "attention_bias": True, "mlp_bias": True,
        },
    ),
    # a window shorter than the prompt, so the sliding-window mask matters
    "mistral": ("MistralConfig", "MistralForCausalLM", {"rope_theta": 1000000.0, "sliding_window": 8}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {"rope_theta": 1000000.0}),
    # head_dim 32 != hidden/heads = 16: q_proj is wider than the hidden size
    "qwen3": (
        "Qwen3Config", "Qwen3ForCausalLM", {"rope_theta": 1000000.0, "head_dim": 32, "tie_word_embeddings": True}
    ),
}


def _hf_config(variant: str) -> Any:
    config_cls, arch, overrides = VARIANTS[variant]
    kwargs: dict[str, Any] = {
        "vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256,
        "rms_norm_eps": 1e-6, "architectures": [arch], "tie_word_embeddings": False,
    }
    kwargs.update(overrides)
    return getattr(transformers, config_cls)(**kwargs)


def _randomize(model: torch.nn.Module, seed: int) -> None:
    """HF's init leaves biases 0 and norm weights 1; make every tensor matter."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(torch.rand(p.shape, generator=gen) + 0.5)
            else:
                fan_in = p.shape[-1] if p.dim() > 1 else 64
                p.copy_(torch.randn(p.shape, generator=gen) / fan_in**0.5)


def make_checkpoint(root: Path, variant: str, **save_kwargs: Any) -> tuple[Path, Any]:
    """Write a tiny random checkpoint for ``variant``; return (dir, HF reference model)."""
    config = _hf_config(variant)
    model_cls = getattr(transformers, VARIANTS[variant][1])
    torch.manual_seed(0)
    model = model_cls(config).to(torch.float32)
    _randomize(model, seed=1)
    out = root / variant
    model.save_pretrained(out, **save_kwargs)
    ref = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32, attn_implementation="eager")
    return out, ref.eval()


def _vllm_config(model_dir: Path, load_format: str = "auto") -> VllmConfig:
    return VllmConfig(
        model_config=ModelConfig(model=str(model_dir), dtype=torch.float32, skip_tokenizer_init=True),
        load_config=LoadConfig(load_format=load_format),
    )


def _hf_logits(ref: Any, token_ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return ref(torch.tensor([token_ids])).logits[0].float()


# -- a dense reference attention backend (no paging) ----------------------------------------------


class _DenseImpl(AttentionImpl[CommonAttentionMetadata]):
    """Causal (optionally windowed) attention within each request's new tokens; prefill only."""

    def forward(self, query, key, value, kv_cache, metadata):  # type: ignore[override]
        assert int(metadata.num_computed_tokens_cpu.sum()) == 0, "dense reference backend is prefill-only"
        out = torch.empty_like(query)
        starts = metadata.query_start_loc_cpu.tolist()
        for start, end in itertools.pairwise(starts):
            n = end - start
            pos = torch.arange(n)
            mask = pos[None, :] <= pos[:, None]
            if self.sliding_window is not None:
                mask &= pos[None, :] > pos[:, None] - self.sliding_window
            o = F.scaled_dot_product_attention(
                query[start:end].transpose(0, 1), key[start:end].transpose(0, 1), value[start:end].transpose(0, 1),
                attn_mask=mask, scale=self.scale, enable_gqa=True,
            )
            out[start:end] = o.transpose(0, 1)
        return out


class _DenseBuilder(AttentionMetadataBuilder[CommonAttentionMetadata]):
    def build(self, common: CommonAttentionMetadata) -> CommonAttentionMetadata:
        return common


class DenseBackend(AttentionBackend):
    name = "test_dense"

    @staticmethod
    def get_kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_size: int) -> tuple[int, ...]:
        return (0,)

    @staticmethod
    def get_builder_cls() -> type[_DenseBuilder]:
        return _DenseBuilder

    @staticmethod
    def get_impl_cls() -> type[_DenseImpl]:
        return _DenseImpl


def _common_metadata(
    query_lens: list[int], computed: list[int], block_tables: list[list[int]], block_size: int
) -> CommonAttentionMetadata:
    """Metadata for requests with ``query_lens[i]`` new tokens after ``computed[i]`` cached ones."""
    seq_lens = [q + c for q, c in zip(query_lens, computed, strict=True)]
    qsl = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
    slots = [
        block_tables[i][pos // block_size] * block_size + pos % block_size
        for i in range(len(query_lens))
        for pos in range(computed[i], seq_lens[i])
    ]
    width = max(len(b) for b in block_tables)
    return CommonAttentionMetadata(
        query_start_loc=qsl,
        query_start_loc_cpu=qsl.clone(),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        seq_lens_cpu=torch.tensor(seq_lens, dtype=torch.int32),
        num_computed_tokens_cpu=torch.tensor(computed, dtype=torch.int32),
        block_table=torch.tensor([b + [0] * (width - len(b)) for b in block_tables], dtype=torch.int32),
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        num_reqs=len(query_lens),
        num_actual_tokens=sum(query_lens),
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
    )


# -- full-model forward ---------------------------------------------------------------------------


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_forward_matches_hf_dense(tmp_path: Path, variant: str) -> None:
    """Two prompts batched flat in one step give HF's per-prompt logits."""
    model_dir, ref = make_checkpoint(tmp_path, variant)
    model, layers = load_model(_vllm_config(model_dir), DenseBackend, "cpu")
    assert sorted(layers) == ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]
    prompts = [[3, 17, 99, 250, 7, 7, 401, 12, 5, 88, 300, 1], [42, 43, 44, 511, 0]]
    ids = torch.tensor([t for p in prompts for t in p])
    positions = torch.cat([torch.arange(len(p)) for p in prompts])
    metadata = _common_metadata([len(p) for p in prompts], [0, 0], [[0], [0]], 16)
    with torch.no_grad(), set_forward_context(metadata):
        hidden = model(ids, positions)
        logits = model.compute_logits(hidden)
    assert hidden.shape == (len(ids), 64) and logits.shape == (len(ids), VOCAB)
    assert logits.dtype == torch.float32
    expected = torch.cat([_hf_logits(ref, p) for p in prompts])
    torch.testing.assert_close(logits, expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_forward_matches_hf_cpu_paged(tmp_path: Path, variant: str) -> None:
    """Prefill through the paged CPU backend, then decode one token that reads the cache."""
    pytest.importorskip("pagedlm.backends.cpu.attention")
    from pagedlm.core.plugins import get_plugins, resolve_class_path

    backend = resolve_class_path(get_plugins().attention_backends()["cpu_paged"])
    model_dir, ref = make_checkpoint(tmp_path, variant)
    model, layers = load_model(_vllm_config(model_dir), backend, "cpu")
    block_size, num_blocks = 4, 8
    for layer in layers.values():
        shape = backend.get_kv_cache_shape(num_blocks, block_size, layer.num_kv_heads, layer.head_size)
        layer.kv_cache = torch.zeros(shape, dtype=torch.float32)
    # scrambled blocks, so a wrong slot or block-table lookup cannot pass by accident
    block_table = [5, 2, 7, 0]
    tokens = [3, 17, 99, 250, 7, 7, 401, 12, 5, 88, 300, 1, 64]
    expected = _hf_logits(ref, tokens)
    builder = backend.get_builder_cls()(block_size=block_size, device=torch.device("cpu"))

    def step(new_tokens: list[int], computed: int) -> torch.Tensor:
        common = _common_metadata([len(new_tokens)], [computed], [block_table], block_size)
        positions = torch.arange(computed, computed + len(new_tokens))
        with torch.no_grad(), set_forward_context(builder.build(common)):
            return model.compute_logits(model(torch.tensor(new_tokens), positions))

    prefill = step(tokens[:-1], 0)
    torch.testing.assert_close(prefill, expected[:-1], atol=1e-4, rtol=1e-4)
    decode = step(tokens[-1:], len(tokens) - 1)
    torch.testing.assert_close(decode, expected[-1:], atol=1e-4, rtol=1e-4)


# -- registry ---------------------------------------------------------------------------------------


def test_registry_resolves_and_lists_architectures() -> None:
    from pagedlm.models.llama import LlamaForCausalLM, MistralForCausalLM
    from pagedlm.models.qwen import Qwen2ForCausalLM, Qwen3ForCausalLM

    assert get_model_class(["LlamaForCausalLM"]) is LlamaForCausalLM
    assert get_model_class(["NotAModel", "MistralForCausalLM"]) is MistralForCausalLM
    assert get_model_class(["Qwen2ForCausalLM"]) is Qwen2ForCausalLM
    assert get_model_class(["Qwen3ForCausalLM"]) is Qwen3ForCausalLM
    with pytest.raises(ValueError) as info:
        get_model_class(["GPTNotAModel"])
    message = str(info.value)
    for name in ("GPTNotAModel", "LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
                 "pagedlm-models-llama", "pip install pagedlm-models-"):
        assert name in message


# -- loader -----------------------------------------------------------------------------------------


def _params_equal_hf(model: torch.nn.Module, ref: Any) -> None:
    """Spot-check loaded parameters against the HF model's (fused ones by slice)."""
    hf = dict(ref.named_parameters())
    ours = dict(model.named_parameters())
    assert torch.equal(ours["model.embed_tokens.weight"], hf["model.embed_tokens.weight"])
    qkv = ours["model.layers.1.self_attn.qkv_proj.weight"]
    q, k = hf["model.layers.1.self_attn.q_proj.weight"], hf["model.layers.1.self_attn.k_proj.weight"]
    assert torch.equal(qkv[: q.shape[0]], q) and torch.equal(qkv[q.shape[0] : q.shape[0] + k.shape[0]], k)
    up = hf["model.layers.0.mlp.up_proj.weight"]
    assert torch.equal(ours["model.layers.0.mlp.gate_up_proj.weight"][up.shape[0] :], up)


def test_loader_reads_sharded_safetensors(tmp_path: Path) -> None:
    model_dir, ref = make_checkpoint(tmp_path, "qwen2", max_shard_size="100KB")
    index = json.loads((model_dir / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    assert not (model_dir / "model.safetensors").exists()
    model, _ = load_model(_vllm_config(model_dir, "safetensors"), DenseBackend, "cpu")
    assert not model.training
    _params_equal_hf(model, ref)


def test_loader_refuses_pickle_only_checkpoint_unless_pt(tmp_path: Path) -> None:
    _, ref = make_checkpoint(tmp_path, "llama")
    pickle_dir = tmp_path / "pickled"
    pickle_dir.mkdir()
    ref.config.save_pretrained(pickle_dir)
    torch.save(ref.state_dict(), pickle_dir / "pytorch_model.bin")
    with pytest.raises(ValueError, match=r'pickle.*load_format="pt"'):
        load_model(_vllm_config(pickle_dir, "auto"), DenseBackend, "cpu")
    with pytest.raises(ValueError, match="no \\*.safetensors"):
        load_model(_vllm_config(pickle_dir, "safetensors"), DenseBackend, "cpu")
    model, _ = load_model(_vllm_config(pickle_dir, "pt"), DenseBackend, "cpu")
    _params_equal_hf(model, ref)


def test_loader_reports_parameters_never_loaded(tmp_path: Path) -> None:
    _, ref = make_checkpoint(tmp_path, "llama")
    partial_dir = tmp_path / "partial"
    partial_dir.mkdir()
    ref.config.save_pretrained(partial_dir)
    state = {k: v.contiguous() for k, v in ref.state_dict().items() if "layers.1.self_attn.k_proj" not in k}
    save_file(state, str(partial_dir / "model.safetensors"))
    with pytest.raises(ValueError, match="model.layers.1.self_attn.qkv_proj.weight"):
        load_model(_vllm_config(partial_dir), DenseBackend, "cpu")


def test_loader_rejects_unknown_checkpoint_tensor(tmp_path: Path) -> None:
    _, ref = make_checkpoint(tmp_path, "llama")
    extra_dir = tmp_path / "extra"
    extra_dir.mkdir()
    ref.config.save_pretrained(extra_dir)
    state = {k: v.contiguous() for k, v in ref.state_dict().items()}
    state["model.layers.0.self_attn.surprise.weight"] = torch.zeros(2)
    save_file(state, str(extra_dir / "model.safetensors"))
    with pytest.raises(ValueError, match="surprise"):
        load_model(_vllm_config(extra_dir), DenseBackend, "cpu")


def test_dummy_weights_need_no_files_and_follow_the_seed(tmp_path: Path) -> None:
    config_dir = tmp_path / "config-only"
    _hf_config("qwen3").save_pretrained(config_dir)
    a, _ = load_model(_vllm_config(config_dir, "dummy"), DenseBackend, "cpu")
    b, _ = load_model(_vllm_config(config_dir, "dummy"), DenseBackend, "cpu")
    for (name, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters(), strict=True):
        assert torch.equal(pa, pb), name
        assert pa.abs().max() <= 1e-3 and pa.abs().max() > 0, name


def test_model_dtype_is_the_configured_dtype(tmp_path: Path) -> None:
    config_dir = tmp_path / "config-only"
    _hf_config("llama").save_pretrained(config_dir)
    vllm_config = _vllm_config(config_dir, "dummy")
    vllm_config.model_config.dtype = torch.bfloat16
    model, _ = load_model(vllm_config, DenseBackend, "cpu")
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert torch.get_default_dtype() == torch.float32  # restored after building
    metadata = _common_metadata([3], [0], [[0]], 16)
    with torch.no_grad(), set_forward_context(metadata):
        logits = model.compute_logits(model(torch.tensor([1, 2, 3]), torch.arange(3)))
    assert logits.dtype == torch.float32 and torch.isfinite(logits).all()


# -- tensor parallelism over gloo -----------------------------------------------------------------


def _tp_worker(rank: int, world_size: int, model_dir: str, rendezvous: str, out: str) -> None:
    """One TP rank: build the sharded model, run a prefill, and (rank 0) save the logits."""
    import torch.distributed as dist

    from pagedlm.core.distributed import init_model_parallel

    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=world_size)
    try:
        init_model_parallel(rank, world_size, dist.group.WORLD)
        model, layers = load_model(_vllm_config(Path(model_dir)), DenseBackend, "cpu")
        tokens = [3, 17, 99, 250, 7, 7, 401, 12, 5, 88]
        with torch.no_grad(), set_forward_context(_common_metadata([len(tokens)], [0], [[0]], 16)):
            logits = model.compute_logits(model(torch.tensor(tokens), torch.arange(len(tokens))))
        layer = layers["model.layers.0.self_attn.attn"]
        if rank == 0:
            torch.save({"logits": logits, "heads": (layer.num_heads, layer.num_kv_heads)}, out)
        dist.barrier()
    except BaseException:
        dist.destroy_process_group()
        raise
    # NOTE: no gloo teardown once every rank is past the barrier: under CI load rank 0 aborted in
    # std::terminate while tearing it down, before the barrier existed and once after (2026-12-07);
    # the test's result is already saved, so the process leaves without running it
    os._exit(0)


@pytest.mark.parametrize(("variant", "world_size"), [("llama-llama3-tied-bias", 2), ("qwen3", 4)])
def test_tensor_parallel_matches_hf(tmp_path: Path, variant: str, world_size: int) -> None:
    """Sharded layers + real all-reduce/all-gather reproduce HF's logits; with tp=4 and 2 KV
    heads each KV head is replicated on two ranks."""
    import torch.multiprocessing as mp

    model_dir, ref = make_checkpoint(tmp_path, variant)
    out = tmp_path / "tp_logits.pt"
    mp.spawn(_tp_worker, args=(world_size, str(model_dir), str(tmp_path / "rdzv"), str(out)), nprocs=world_size)
    result = torch.load(out)
    assert result["heads"] == (4 // world_size, max(1, 2 // world_size))
    expected = _hf_logits(ref, [3, 17, 99, 250, 7, 7, 401, 12, 5, 88])
    torch.testing.assert_close(result["logits"], expected, atol=1e-4, rtol=1e-4)
