"""Gemma 3 on a tiny random checkpoint: greedy tokens identical to HF transformers (fp32, CPU).

The checkpoint is built to make every Gemma-specific detail matter: a sliding window of 8 tokens
with prompts several windows long, local and global layers with different RoPE bases, random
(zero-centred) weights in all four block norms and the q/k norms, ``query_pre_attn_scalar`` unlike
``head_dim``, GQA, a tied head and final logit soft-capping. The same checkpoint exported to GGUF
(norms stored as ``1 + w``) must load back to the same tokens.
"""

from __future__ import annotations

import math
import random
from pathlib import Path

import pytest
import torch

from pagedlm.core import LLM
from pagedlm.core.testing import assert_greedy_matches_hf, build_bpe_tokenizer, hf_greedy, top2_gaps

MAX_NEW = 24
WINDOW = 8


def make_tiny_gemma3(out: Path, seed: int = 0) -> str:
    """A 4-layer Gemma 3 text checkpoint (config.json, model.safetensors, tokenizer) in ``out``."""
    import transformers

    from pagedlm.core.testing import BOS_ID, EOS_ID, PAD_ID

    config = transformers.Gemma3TextConfig(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, max_position_embeddings=512, sliding_window=WINDOW,
        layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
        rope_theta=1_000_000.0, rope_local_base_freq=10_000.0, query_pre_attn_scalar=24,
        final_logit_softcapping=30.0, rms_norm_eps=1e-6, tie_word_embeddings=True,
        bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID, architectures=["Gemma3ForCausalLM"],
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = transformers.Gemma3ForCausalLM(config).to(torch.float32).eval()
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if name.endswith("norm.weight"):
                # zero-centred (the model multiplies by 1 + w); q/k norms sharpen attention
                gain = 2.0 if name.endswith(("q_norm.weight", "k_norm.weight")) else 0.0
                p.copy_(gain + torch.rand(p.shape, generator=gen) - 0.5)
            elif "embed_tokens" in name:
                p.copy_(torch.randn(p.shape, generator=gen) / math.sqrt(config.hidden_size))
            else:
                p.copy_(torch.randn(p.shape, generator=gen) / math.sqrt(p.shape[1]))
        # logits = final-normed h (norm ~ sqrt(hidden) * (1 + w)) . embedding row (norm ~ 1)
        model.model.norm.weight.add_(5.0)
        ids = torch.randint(0, 512, (2, 48), generator=gen)
        gaps = top2_gaps(model(input_ids=ids).logits)
    assert float((gaps < 1e-3).float().mean()) < 0.05, "tiny Gemma has too many near-tied logits"
    model.save_pretrained(str(out))
    build_bpe_tokenizer(out, vocab_size=512, model_max_length=512, style="gpt2")
    return str(out)


@pytest.fixture(scope="module")
def tiny_gemma3(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_tiny_gemma3(tmp_path_factory.mktemp("gemma3") / "tiny-gemma3")


def prompts(seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    base = [rng.randrange(4, 500) for _ in range(60)]
    return [
        base[:40],  # five windows long
        base[:40] + [rng.randrange(4, 500) for _ in range(13)],  # shares 40 tokens (prefix cache)
        [rng.randrange(4, 500) for _ in range(3)],  # shorter than the window
        base[:17],  # window + block boundary
        [rng.randrange(4, 500) for _ in range(90)],
    ]


@pytest.fixture(scope="module")
def reference(tiny_gemma3: str):
    return hf_greedy(tiny_gemma3, prompts(), MAX_NEW)


@pytest.mark.parametrize(
    "mode",
    [
        {},
        # chunked prefill: a long prompt's chunks must still see exactly the last WINDOW keys
        {"max_num_batched_tokens": 8, "max_num_seqs": 3, "enable_prefix_caching": False},
        # 2-token blocks: windows span several blocks; preemption recomputes from scratch. One
        # full and three sliding KV-cache groups of one layer each; with 16-token chunks one
        # request needs at most 80 + 3 x 13 blocks, and the full group's growth forces preemption.
        {"block_size": 2, "num_gpu_blocks_override": 120, "max_model_len": 160, "max_num_batched_tokens": 16},
    ],
    ids=["default", "chunked", "small-blocks-preempt"],
)
def test_tiny_gemma3_matches_hf(tiny_gemma3: str, reference, mode: dict) -> None:
    llm = LLM(model=tiny_gemma3, dtype="float32", device="cpu", **mode)
    forgiven = assert_greedy_matches_hf(tiny_gemma3, prompts(), MAX_NEW, llm=llm, reference=reference)
    assert forgiven <= 1
    if "num_gpu_blocks_override" in mode:
        assert llm.llm_engine.core.scheduler.num_preemptions_total > 0


def test_tiny_gemma3_layers_use_their_window_and_rope(tiny_gemma3: str) -> None:
    from pagedlm.backends.cpu.attention import CpuPagedAttentionBackend
    from pagedlm.core.config import LoadConfig, ModelConfig, VllmConfig
    from pagedlm.core.model_loader import load_model

    config = VllmConfig(model_config=ModelConfig(model=tiny_gemma3, dtype="float32"),
                        load_config=LoadConfig(load_format="dummy"))
    model, attention_layers = load_model(config, CpuPagedAttentionBackend, "cpu")
    assert len(attention_layers) == 4
    layers = model.model.layers
    assert [layer.self_attn.attn.sliding_window for layer in layers] == [WINDOW, WINDOW, None, WINDOW]
    local, full = layers[0].self_attn.rotary_emb, layers[2].self_attn.rotary_emb
    assert local is layers[1].self_attn.rotary_emb and local is not full
    assert not torch.equal(local.cos_sin_cache[5], full.cos_sin_cache[5])
    assert layers[0].self_attn.attn.impl.scale == pytest.approx(24**-0.5)


def test_tiny_gemma3_gguf_roundtrip_matches_hf(tiny_gemma3: str, tmp_path: Path) -> None:
    """Exported to GGUF (norms stored as 1 + w in float32), loaded back: the tokens HF computes
    from the same float32-rounded norm weights."""
    import transformers

    from pagedlm.core.model_loader.gguf_export import write_gguf

    path = write_gguf(tiny_gemma3, str(tmp_path / "tiny-gemma3.gguf"), "F32")
    ref_dir = tmp_path / "ref"
    model = transformers.Gemma3ForCausalLM.from_pretrained(tiny_gemma3, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_((p + 1.0) - 1.0)  # what storing 1 + w and reading it back does
    model.save_pretrained(str(ref_dir))
    build_bpe_tokenizer(ref_dir, vocab_size=512, model_max_length=512, style="gpt2")
    ref = hf_greedy(ref_dir, prompts()[:3], MAX_NEW)
    # four KV-cache groups of one layer: 32 blocks each at max_model_len 512
    llm = LLM(model=path, dtype="float32", device="cpu", num_gpu_blocks_override=128)
    assert llm.llm_engine.vllm_config.load_config.load_format == "gguf"
    assert_greedy_matches_hf(path, prompts()[:3], MAX_NEW, llm=llm, reference=ref)


def test_tiny_gemma3_long_request_frees_sliding_blocks(tiny_gemma3: str) -> None:
    """A long request keeps its whole context only in the full group: while it decodes, the
    sliding groups hold about a window of blocks each and give the rest back to the pool."""
    from pagedlm.core import SamplingParams

    block_size, prompt_len, max_new = 2, 90, 40
    llm = LLM(model=tiny_gemma3, dtype="float32", device="cpu", block_size=block_size, enable_prefix_caching=False)
    engine = llm.llm_engine
    kv = engine.core.scheduler.kv_cache_manager
    assert [type(g.spec).__name__ for g in kv.kv_cache_groups] == ["FullAttentionSpec"] + ["SlidingWindowSpec"] * 3
    engine.add_request("long", {"prompt_token_ids": prompts()[4][:prompt_len]},
                       SamplingParams(max_tokens=max_new, temperature=0.0, ignore_eos=True))
    held, free = [], []
    while engine.has_unfinished_requests():
        engine.step()
        request = engine.core.scheduler.requests.get("long")
        if request is not None:
            held.append((request.num_computed_tokens, kv.num_held_blocks("long")))
            free.append(kv.num_free_blocks)
    assert kv.num_free_blocks == kv.num_blocks, "every block is back once the request is done"
    # Decoding: the full group holds every block, each sliding group the window's (W = 8 tokens:
    # the last 7 before the next query plus itself, over at most 5 blocks of 2).
    for num_computed, num_held in held[1:]:
        full = -(-num_computed // block_size)
        assert full <= num_held <= full + 3 * (WINDOW // block_size + 1)
    # without groups every layer would hold every block: 4x the full group's
    num_computed, num_held = held[-1]
    assert num_held < 2 * -(-num_computed // block_size)
    assert free[-1] < free[1], "the full group grows as the request decodes"
    llm.shutdown()
