"""Mixture-of-experts models beyond the shared parity grid (test_hf_parity.py runs the tiny
Qwen3-MoE and Mixtral checkpoints in every engine mode): logprobs, the routing variants of
Qwen3-MoE's config, random weights (``load_format="dummy"``) for the benchmark configs."""

from __future__ import annotations

import pytest
from test_hf_parity import MAX_NEW, mixed_prompts

from pagedlm.core import LLM, SamplingParams
from pagedlm.core.testing import MOE_ARCHITECTURES, assert_greedy_matches_hf, make_dummy_config_dir


@pytest.mark.parametrize("arch", MOE_ARCHITECTURES)
def test_moe_logprobs_match_hf(arch, tiny_checkpoints):
    llm = LLM(model=tiny_checkpoints[arch], dtype="float32", device="cpu")
    assert_greedy_matches_hf(tiny_checkpoints[arch], mixed_prompts(), MAX_NEW, llm=llm, logprobs=5, logprob_atol=1e-4)


@pytest.mark.parametrize("variant", [
    # top-k weights used as they come out of the softmax (Qwen1.5-MoE-style configs)
    {"norm_topk_prob": False},
    # a dense MLP in layer 0 (mlp_only_layers), top-4 of 16 experts in layer 1
    {"mlp_only_layers": (0,), "num_experts": 16, "num_experts_per_tok": 4},
    # one expert per token: no weighted sum
    {"num_experts_per_tok": 1},
], ids=["no-norm-topk", "dense-layer-top4of16", "top1"])
def test_qwen3_moe_routing_variants_match_hf(variant, tiny_checkpoint_factory):
    path = tiny_checkpoint_factory("qwen3_moe", **variant)
    llm = LLM(model=path, dtype="float32", device="cpu", max_num_batched_tokens=16)
    assert_greedy_matches_hf(path, mixed_prompts(2)[:5], 16, llm=llm, logprobs=2, logprob_atol=1e-4)
    layers = llm.llm_engine.core.executor.worker.model_runner.model.model.layers
    if "mlp_only_layers" in variant:
        assert not hasattr(layers[0].mlp, "experts") and layers[1].mlp.experts.global_num_experts == 16


def _generate(llm: LLM, n: int = 3) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": [5 + i, 6, 7, 8]} for i in range(n)], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


@pytest.mark.parametrize("arch", MOE_ARCHITECTURES)
def test_dummy_weights_run_without_a_checkpoint(arch, tmp_path):
    """What ``pagedlm bench --model-config ... --load-format dummy`` builds: config.json only."""
    path = make_dummy_config_dir(tmp_path / arch, arch, hidden_size=128, num_experts=16, num_experts_per_tok=4)
    kwargs = dict(model=path, load_format="dummy", skip_tokenizer_init=True, dtype="float32", device="cpu")
    first = _generate(LLM(**kwargs))
    assert all(len(t) == 8 for t in first)
    assert _generate(LLM(**kwargs)) == first, "a seed gives the same dummy weights"


@pytest.mark.parametrize("name", ["qwen3-30b-a3b", "mixtral-8x7b"])
def test_benchmark_configs_build_shrunk(name, tmp_path):
    """The shipped configs' own keys (``num_experts`` / ``num_local_experts``, head_dim, ...) reach
    the model classes; shrunk with hf_overrides so the CPU can build them."""
    from pagedlm.core.bench.common import model_config_dir

    path = model_config_dir(name, str(tmp_path / name))
    experts_key = "num_experts" if name.startswith("qwen") else "num_local_experts"
    overrides = {"num_hidden_layers": 2, "hidden_size": 64, "intermediate_size": 64, "vocab_size": 1000,
                 experts_key: 8, "num_attention_heads": 4, "num_key_value_heads": 2, "moe_intermediate_size": 32,
                 "head_dim": 16}
    llm = LLM(model=path, load_format="dummy", skip_tokenizer_init=True, dtype="float32", device="cpu",
              hf_overrides=overrides, max_model_len=256)
    model = llm.llm_engine.core.executor.worker.model_runner.model
    block = model.model.layers[1]
    moe = (block.mlp if name.startswith("qwen") else block.block_sparse_moe).experts
    top_k, renorm = (8, True) if name.startswith("qwen") else (2, True)
    assert (moe.global_num_experts, moe.top_k, moe.renormalize) == (8, top_k, renorm)
    assert all(len(t) == 8 for t in _generate(llm))
