"""The test helpers themselves: tiny checkpoints, tokenizer, HF reference and the conformance check.

Every correctness test of the engine leans on these, so they are checked against transformers
directly, without the engine.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from pagedlm.core.testing import (
    ARCHITECTURES,
    BOS_ID,
    EOS_ID,
    PAD_ID,
    HFGreedyResult,
    assert_greedy_matches_hf,
    build_bpe_tokenizer,
    compare_greedy,
    hf_greedy,
    make_dummy_config_dir,
    make_tiny_checkpoint,
)

PROMPTS = [[BOS_ID, 40, 41, 42, 43, 44], [BOS_ID, 300], [BOS_ID, *range(100, 140)], [17, 17, 17, 17]]


def _safetensors_keys(model_dir: str) -> set[str]:
    from safetensors import safe_open

    keys: set[str] = set()
    for shard in Path(model_dir).glob("*.safetensors"):
        with safe_open(str(shard), framework="pt") as f:
            keys.update(f.keys())
    return keys


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_checkpoint_loads_with_transformers(tiny_checkpoints: dict[str, str], arch: str) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    model_dir = tiny_checkpoints[arch]
    config = AutoConfig.from_pretrained(model_dir)
    assert config.model_type == {"gemma3": "gemma3_text"}.get(arch, arch)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    assert type(model).__name__ == config.architectures[0]
    tok = AutoTokenizer.from_pretrained(model_dir)
    assert len(tok) == config.vocab_size == model.get_output_embeddings().weight.shape[0]
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (BOS_ID, EOS_ID, PAD_ID)
    assert (config.bos_token_id, config.eos_token_id) == (BOS_ID, EOS_ID)
    gen = json.loads((Path(model_dir) / "generation_config.json").read_text())
    assert gen["eos_token_id"] == EOS_ID
    raw = json.loads((Path(model_dir) / "config.json").read_text())
    assert raw["rope_theta"] != 10000.0, "a non-default RoPE base catches engines that ignore config.json"


def test_arch_specific_weights(tiny_checkpoints: dict[str, str]) -> None:
    qwen2 = _safetensors_keys(tiny_checkpoints["qwen2"])
    assert {f"model.layers.0.self_attn.{p}_proj.bias" for p in "qkv"} <= qwen2
    qwen3 = _safetensors_keys(tiny_checkpoints["qwen3"])
    assert {"model.layers.0.self_attn.q_norm.weight", "model.layers.0.self_attn.k_norm.weight"} <= qwen3
    assert not any(k.endswith(".bias") for k in qwen3)
    llama = _safetensors_keys(tiny_checkpoints["llama"])
    assert "lm_head.weight" in llama and not any(k.endswith(".bias") for k in llama)


def test_tokenizer_round_trips_text(tiny_llama: str) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_llama)
    text = "The quick brown fox, 42 cafés and a 🚀!\n  def f(x): return x * 2"
    ids = tok(text).input_ids
    assert ids[0] == BOS_ID and BOS_ID not in ids[1:]
    assert len(ids) < len(text.encode()), "BPE merges should compress ordinary text"
    assert tok.decode(ids, skip_special_tokens=True) == text
    assert tok.decode(tok(text, add_special_tokens=False).input_ids) == text


def test_tokenizer_is_consistent_with_tokenizer_json(tiny_checkpoints: dict[str, str]) -> None:
    # transformers may rebuild a tokenizer from its model type (it does for qwen2); components
    # that read tokenizer.json directly must still see the same ids.
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    text = "Numbers 2024 and 3.14159, naïve café, 你好, tabs\tand\r\nnew lines   "
    for model_dir in tiny_checkpoints.values():
        auto = AutoTokenizer.from_pretrained(model_dir)
        raw = Tokenizer.from_file(str(Path(model_dir) / "tokenizer.json"))
        assert auto(text).input_ids == raw.encode(text).ids, model_dir


def test_chat_template_renders(tiny_llama: str) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_llama)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == "<s><|system|>\nBe brief.<|end|>\n<|user|>\nHi there<|end|>\n<|assistant|>\n"
    no_prompt = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
    assert isinstance(no_prompt, str)
    assert not no_prompt.endswith("<|assistant|>\n")
    ids = tok(text, add_special_tokens=False).input_ids
    assert ids.count(BOS_ID) == 1
    assert tok.convert_tokens_to_ids("<|assistant|>") in ids


def test_tokenizer_is_deterministic_and_sized(tmp_path: Path) -> None:
    a = build_bpe_tokenizer(tmp_path / "a", vocab_size=400)
    b = build_bpe_tokenizer(tmp_path / "b", vocab_size=400)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (Path(a) / name).read_bytes() == (Path(b) / name).read_bytes()
    from transformers import AutoTokenizer

    assert len(AutoTokenizer.from_pretrained(a)) == 400
    with pytest.raises(ValueError, match="too small"):
        build_bpe_tokenizer(tmp_path / "c", vocab_size=100)


def test_checkpoint_is_deterministic(tmp_path: Path) -> None:
    a = make_tiny_checkpoint(tmp_path / "a", "qwen2", seed=3)
    b = make_tiny_checkpoint(tmp_path / "b", "qwen2", seed=3)
    c = make_tiny_checkpoint(tmp_path / "c", "qwen2", seed=4)
    weights = [(Path(d) / "model.safetensors").read_bytes() for d in (a, b, c)]
    assert weights[0] == weights[1] != weights[2]


def test_sharded_checkpoint_has_index(tiny_checkpoint_factory) -> None:
    sharded = tiny_checkpoint_factory("llama", sharded=True)
    index = json.loads((Path(sharded) / "model.safetensors.index.json").read_text())
    shards = set(index["weight_map"].values())
    assert len(shards) > 1
    assert all((Path(sharded) / s).exists() for s in shards)
    # Same seed, same weights: sharding changes only the files.
    plain = tiny_checkpoint_factory("llama")
    assert hf_greedy(sharded, PROMPTS[:2], 8)[1].token_ids == hf_greedy(plain, PROMPTS[:2], 8)[1].token_ids


@pytest.mark.parametrize("kwargs", [{"tie_word_embeddings": True}, {"dtype": "bfloat16"}])
def test_checkpoint_variants_load(tiny_checkpoint_factory, kwargs: dict) -> None:
    from safetensors import safe_open

    model_dir = tiny_checkpoint_factory("llama", **kwargs)
    (result,) = hf_greedy(model_dir, PROMPTS[:1], 4)
    assert len(result.token_ids) == 4
    with safe_open(str(Path(model_dir) / "model.safetensors"), framework="pt") as f:
        keys = set(f.keys())
        dtype = f.get_tensor("model.embed_tokens.weight").dtype
    assert dtype == getattr(torch, kwargs.get("dtype", "float32"))
    assert ("lm_head.weight" in keys) is not kwargs.get("tie_word_embeddings", False)


def test_dummy_config_dir(tmp_path: Path) -> None:
    from transformers import AutoConfig

    out = make_dummy_config_dir(tmp_path / "cfg", "qwen3", hidden_size=128, num_heads=4)
    assert [p.name for p in Path(out).iterdir()] == ["config.json"]
    config = AutoConfig.from_pretrained(out)
    assert config.model_type == "qwen3" and config.hidden_size == 128
    assert config.head_dim == 64, "qwen3 decouples head_dim from hidden_size // num_heads"
    with pytest.raises(ValueError, match="arch"):
        make_dummy_config_dir(tmp_path / "bad", "gpt2")  # type: ignore[arg-type]


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_hf_greedy_and_wide_logits(tiny_checkpoints: dict[str, str], arch: str) -> None:
    results = hf_greedy(tiny_checkpoints[arch], PROMPTS, 24)
    gaps = []
    for prompt, r in zip(PROMPTS, results):
        assert r.prompt_token_ids == prompt
        assert len(r.token_ids) == len(r.top2_gaps) == 24
        assert r.logprobs.shape == (24, 512)
        assert r.prompt_logprobs.shape == (len(prompt) - 1, 512)
        assert r.token_ids == r.logprobs.argmax(-1).tolist()
        assert torch.allclose(r.logprobs.exp().sum(-1), torch.ones(24), atol=1e-4)
        gaps += r.top2_gaps
    wide = sum(g > 1e-3 for g in gaps) / len(gaps)
    assert wide >= 0.95, f"only {wide:.0%} of top-2 gaps exceed 1e-3: greedy comparisons would be flaky"
    # Random models easily collapse into repeating one token, which hides position bugs.
    assert all(len(set(r.token_ids)) >= 6 for r in results), [r.token_ids for r in results]


def test_hf_greedy_same_with_and_without_cache(tiny_llama: str) -> None:
    cached = hf_greedy(tiny_llama, PROMPTS, 12)
    fresh = hf_greedy(tiny_llama, PROMPTS, 12, use_cache=False)
    assert [r.token_ids for r in cached] == [r.token_ids for r in fresh]
    for a, b in zip(cached, fresh):
        assert torch.allclose(a.logprobs, b.logprobs, atol=1e-4)


def _ref(tokens: list[int], gaps: list[float]) -> HFGreedyResult:
    logprobs = torch.full((len(tokens), 8), -10.0)
    for s, t in enumerate(tokens):
        logprobs[s, t] = -0.1
    return HFGreedyResult([1], tokens, gaps, logprobs, torch.zeros(0, 8))


def test_compare_greedy_forgives_only_near_ties() -> None:
    ref = [
        _ref([1, 2, 3, 4], [1.0, 1.0, 1.0, 1.0]),
        _ref([1, 2, 3, 4], [1.0, 5e-5, 1.0, 1.0]),
        _ref([1, 2, 3, 4], [1.0, 1.0, 1.0, 1.0]),
        _ref([1, 2, 3, 4], [1.0, 1.0, 1.0, 1.0]),
    ]
    ours = [
        [1, 2, 3, 4],  # identical
        [1, 5, 6, 7],  # differs at a near-tie; what follows is not compared
        [1, 2, 7, 4],  # a real mismatch
        [1, 2, 3],  # stopped early
    ]
    assert compare_greedy(ours, ref) == (2, 1)
    assert compare_greedy(ours, ref, tie_tol=1e-6) == (3, 0)
    assert compare_greedy(ours[:1], ref[:1]) == (0, 0)
    with pytest.raises(ValueError):
        compare_greedy(ours[:2], ref)


@dataclass
class _FakeCompletion:
    token_ids: list[int]
    logprobs: list[dict] | None = None


@dataclass
class _FakeRequestOutput:
    outputs: list[_FakeCompletion]


class _FakeLLM:
    """Stands in for pagedlm.core.LLM so the conformance check is tested without the engine."""

    def __init__(self, answers: list[list[int]]) -> None:
        self.answers = answers
        self.params: Any = None

    def generate(self, prompts, params, use_tqdm=True):
        self.params = params
        assert [p["prompt_token_ids"] for p in prompts] == PROMPTS[: len(prompts)]
        return [_FakeRequestOutput([_FakeCompletion(list(a))]) for a in self.answers]


def test_assert_greedy_matches_hf(tiny_llama: str) -> None:
    ref = hf_greedy(tiny_llama, PROMPTS, 10)
    good = _FakeLLM([r.token_ids for r in ref])
    assert assert_greedy_matches_hf(tiny_llama, PROMPTS, 10, llm=good, reference=ref) == 0
    assert good.params.temperature == 0.0 and good.params.ignore_eos and good.params.max_tokens == 10

    wrong = [list(r.token_ids) for r in ref]
    wrong[2][5] = (wrong[2][5] + 1) % 512
    with pytest.raises(AssertionError) as excinfo:
        assert_greedy_matches_hf(tiny_llama, PROMPTS, 10, llm=_FakeLLM(wrong), reference=ref)
    message = str(excinfo.value)
    assert "1 of 4 prompts mismatch" in message and "prompt 2" in message and "step 5" in message
