"""Choosing and validating a quantization method: detection, bad input, the plugin hook, dummy
weights of quantized layouts, and the FP8 KV cache on the CPU backend."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from pagedlm.core import LLM, SamplingParams
from pagedlm.core.config import CacheConfig, ModelConfig, VllmConfig
from pagedlm.core.layers.quantization import get_quant_config, registered_quantization_methods
from pagedlm.core.plugins import get_plugins, hookimpl
from pagedlm.core.testing import make_dummy_config_dir


def _with_quant_config(tmp_path: Path, quantization_config: dict, **hyper) -> str:
    d = make_dummy_config_dir(tmp_path / "cfg", "llama", **{"hidden_size": 256, "intermediate_size": 512, **hyper})
    path = Path(d) / "config.json"
    data = json.loads(path.read_text())
    data["quantization_config"] = quantization_config
    path.write_text(json.dumps(data))
    return d


@pytest.mark.parametrize("user, ckpt", [("gptq_marlin", "gptq"), ("gptq_bitblas", "gptq"), ("awq_marlin", "awq")])
def test_vllm_kernel_names_select_the_format(tmp_path, user, ckpt):
    """vLLM's kernel names (its log advises ``quantization=gptq_marlin``) run the format's method."""
    config = ({"quant_method": "gptq", "bits": 4, "group_size": 128} if ckpt == "gptq"
              else {"quant_method": "awq", "w_bit": 4, "q_group_size": 128})
    d = _with_quant_config(tmp_path, config)
    assert get_quant_config(ModelConfig(model=d, quantization=user)).get_name() == ckpt


def test_builtin_methods_register_through_the_hook():
    methods = registered_quantization_methods()
    assert {"fp8", "compressed-tensors", "gptq", "awq", "gguf", "int8"} <= set(methods)
    assert "core" not in get_plugins().plugin_names()


def test_detection_from_config_json_and_user_option(tmp_path):
    d = _with_quant_config(tmp_path, {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": True})
    qc = get_quant_config(ModelConfig(model=d))
    assert qc.get_name() == "gptq" and qc.desc_act
    assert get_quant_config(ModelConfig(model=d, quantization="gptq")).get_name() == "gptq"
    with pytest.raises(ValueError, match="quantized with 'gptq'"):
        VllmConfig(model_config=ModelConfig(model=d, quantization="awq"))
    plain = make_dummy_config_dir(tmp_path / "plain", "llama")
    assert VllmConfig(model_config=ModelConfig(model=plain)).quant_config is None
    assert VllmConfig(model_config=ModelConfig(model=plain, quantization="fp8")).quant_config.get_name() == "fp8"


@pytest.mark.parametrize("config, match", [
    ({"quant_method": "nosuch"},
     "unknown quantization method 'nosuch'; supported: awq, compressed-tensors, fp8, gguf, gptq"),
    ({"quant_method": "gptq", "bits": 3, "group_size": 128}, r"GPTQ bits=3 is not supported; supported: \[4, 8\]"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 96}, "GPTQ group_size=96 is not supported"),
    ({"quant_method": "awq", "w_bit": 4, "q_group_size": 128, "version": "gemv"}, "AWQ version='gemv'"),
    ({"quant_method": "fp8", "weight_block_size": [128]},
     r"weight_block_size=\[128\] is not supported; supported: two"),
    ({"quant_method": "fp8", "activation_scheme": "static", "weight_block_size": [128, 128]},
     "block-wise weights with activation_scheme='static' are not supported"),
    ({"quant_method": "compressed-tensors", "format": "float-quantized", "config_groups": {"g": {
        "targets": ["Linear"], "weights": {"num_bits": 8, "type": "float", "strategy": "block",
                                           "block_structure": [128, 128]},
        "input_activations": {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True}}},
      "ignore": ["lm_head"]}, "block-wise FP8 weights need dynamic float8 activations per group of 128"),
    ({"quant_method": "compressed-tensors", "format": "marlin-24", "config_groups": {"g": {
        "targets": ["Linear"], "weights": {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 128}}},
      "ignore": ["lm_head"]}, "format 'marlin-24'.*supported: pack-quantized"),
    ({"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {"g": {
        "targets": ["Linear"], "weights": {"num_bits": 3, "type": "int", "strategy": "group", "group_size": 128}}},
      "ignore": ["lm_head"]}, "int3 weights.*supported: int4, int8"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 128, "dynamic": {"+:.*down_proj": {"bits": 3}}},
     r"gptq dynamic\['\+:\.\*down_proj'\]: bits=3 is not supported"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 128, "dynamic": {"+:.*down_proj": {"damp": 0.1}}},
     "supported overrides are a dict of bits, group_size, desc_act, sym"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 128, "dynamic": {"-:(": {}}}, "is not a regular expression"),
])
def test_bad_quantization_config_names_what_is_supported(tmp_path, config, match):
    d = _with_quant_config(tmp_path, config)
    with pytest.raises(ValueError, match=match):
        VllmConfig(model_config=ModelConfig(model=d))


def test_group_size_must_divide_the_input(tmp_path):
    d = make_dummy_config_dir(tmp_path / "narrow", "llama")  # hidden 64
    path = Path(d) / "config.json"
    data = json.loads(path.read_text())
    data["quantization_config"] = {"quant_method": "gptq", "bits": 4, "group_size": 128}
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match="not a multiple of group_size=128"):
        LLM(model=d, load_format="dummy", skip_tokenizer_init=True, device="cpu", dtype="float32")


def test_kv_cache_dtype_values():
    assert CacheConfig(cache_dtype="fp8").cache_dtype == "fp8"
    with pytest.raises(ValueError, match="kv_cache_dtype='int4' is not supported; supported: auto, fp8, fp8_e4m3"):
        CacheConfig(cache_dtype="int4")


class _MyMethodPlugin:
    @hookimpl
    def pagedlm_register_quantization_methods(self, register):
        register("fp8", "pagedlm.core.layers.quantization.gptq:GPTQConfig", override=True)
        register("mymethod", "pagedlm.core.layers.quantization.awq:AWQConfig")


def test_a_plugin_adds_and_overrides_methods():
    plugins = get_plugins()
    plugins.register(_MyMethodPlugin(), name="mymethod-plugin")
    try:
        methods = registered_quantization_methods()
        assert methods["mymethod"].endswith("awq:AWQConfig")
        assert methods["fp8"].endswith("gptq:GPTQConfig")  # override=True wins over core's
    finally:
        plugins.unregister("mymethod-plugin")
    assert registered_quantization_methods()["fp8"].endswith("fp8:Fp8Config")


@pytest.mark.parametrize("quantization_config", [
    {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": True},
    {"quant_method": "awq", "w_bit": 4, "q_group_size": 128, "zero_point": True, "version": "gemm"},
    {"quant_method": "compressed-tensors", "format": "pack-quantized", "ignore": ["lm_head"], "config_groups": {"g": {
        "targets": ["Linear"], "weights": {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 128,
                                           "symmetric": False}}}},
    {"quant_method": "compressed-tensors", "format": "float-quantized", "ignore": ["lm_head"], "config_groups": {"g": {
        "targets": ["Linear"], "weights": {"num_bits": 8, "type": "float", "strategy": "channel"},
        "input_activations": {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True}}}},
    {"quant_method": "compressed-tensors", "format": "pack-quantized", "ignore": [], "config_groups": {"g": {
        "targets": ["Linear", "Embedding"], "weights": {"num_bits": 4, "type": "int", "strategy": "group",
                                                        "group_size": 128, "symmetric": False}}}},
    None,  # quantization="fp8" on a full-precision config
])
def test_dummy_weights_of_quantized_layouts_run(tmp_path, quantization_config):
    if quantization_config is None:
        d, kw = make_dummy_config_dir(tmp_path / "plain", "llama", hidden_size=256, intermediate_size=512), \
            {"quantization": "fp8"}
    else:
        d, kw = _with_quant_config(tmp_path, quantization_config), {}
    llm = LLM(model=d, load_format="dummy", skip_tokenizer_init=True, device="cpu", dtype="float32", **kw)
    out = llm.generate([{"prompt_token_ids": [1, 2, 3, 4]}], SamplingParams(max_tokens=4, ignore_eos=True),
                       use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4


def test_fp8_kv_cache_attention_matches_fp8_rounded_reference():
    """The CPU backend's FP8 cache: what attention reads is exactly the FP8 rounding of k / scale
    times scale, so its output equals attention over those values."""
    from pagedlm.backends.cpu.attention import CpuPagedAttentionBackend, CpuPagedAttentionImpl
    from pagedlm.core.attention import CommonAttentionMetadata

    torch.manual_seed(0)
    heads, kv_heads, d, block, n = 4, 2, 16, 4, 10
    impl = CpuPagedAttentionImpl(num_heads=heads, head_size=d, scale=d**-0.5, num_kv_heads=kv_heads)
    impl.kv_cache_dtype, impl.k_scale, impl.v_scale = "fp8", torch.tensor([0.5]), torch.tensor([2.0])
    q, k, v = torch.randn(n, heads, d), torch.randn(n, kv_heads, d), torch.randn(n, kv_heads, d)
    cache = torch.zeros(CpuPagedAttentionBackend.get_kv_cache_shape(4, block, kv_heads, d), dtype=torch.float8_e4m3fn)
    qsl = torch.tensor([0, n], dtype=torch.int32)
    common = CommonAttentionMetadata(
        query_start_loc=qsl, query_start_loc_cpu=qsl, seq_lens=torch.tensor([n], dtype=torch.int32),
        seq_lens_cpu=torch.tensor([n], dtype=torch.int32), num_computed_tokens_cpu=torch.tensor([0], dtype=torch.int32),
        block_table=torch.tensor([[2, 0, 3]], dtype=torch.int32),
        slot_mapping=torch.tensor([2 * block + i for i in range(4)] + list(range(4)) + [12, 13]),
        num_reqs=1, num_actual_tokens=n, max_query_len=n, max_seq_len=n)
    md = CpuPagedAttentionBackend.get_builder_cls()(block_size=block, device=torch.device("cpu")).build(common)
    out = impl.forward(q, k, v, cache, md)
    kr = (k / 0.5).to(torch.float8_e4m3fn).float() * 0.5
    vr = (v / 2.0).to(torch.float8_e4m3fn).float() * 2.0
    ref = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1)[None], kr.repeat_interleave(2, 1).transpose(0, 1)[None],
        vr.repeat_interleave(2, 1).transpose(0, 1)[None], is_causal=True, scale=d**-0.5)[0].transpose(0, 1)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    assert cache.dtype == torch.float8_e4m3fn and cache.float().abs().sum() > 0


def test_fp8_kv_cache_end_to_end(quant_base, tmp_path):
    """kv_cache_dtype="fp8": the cache is float8 (half of float16's bytes per block), scales load
    from the checkpoint (``self_attn.k_scale``), and the output stays close to HF (FP8's 3
    mantissa bits: the first token of every prompt equal; this tiny model's sharp attention (q/k
    scaled up so attention selects positions) then drifts from HF within a few tokens, which is
    why the exact check is the attention test above)."""
    import shutil

    from safetensors.torch import load_file, save_file

    from pagedlm.core.testing import hf_greedy

    d = tmp_path / "with-scales"
    shutil.copytree(quant_base, d)
    state = load_file(str(d / "model.safetensors"))
    for i in range(2):
        state[f"model.layers.{i}.self_attn.k_scale"] = torch.tensor(0.25)
        state[f"model.layers.{i}.self_attn.v_scale"] = torch.tensor(0.5)
    save_file(state, str(d / "model.safetensors"))
    prompts = [[1, 5, 9, 100, 7, 8], [1, 300, 200, 17], list(range(4, 60))]
    llm = LLM(model=str(d), dtype="float32", device="cpu", kv_cache_dtype="fp8")
    runner = llm.llm_engine.core.executor.worker.model_runner
    assert runner.kv_caches[0].dtype == torch.float8_e4m3fn
    layer = next(iter(runner.attention_layers.values()))
    assert float(layer.k_scale) == 0.25 and float(layer.v_scale) == 0.5
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    ref = hf_greedy(str(d), prompts, 8)
    ours = [list(o.outputs[0].token_ids) for o in outs]
    assert all(a[0] == r.token_ids[0] for a, r in zip(ours, ref)), (ours, [r.token_ids for r in ref])


def test_fp8_kv_cache_refused_by_a_backend_that_cannot_read_it(tmp_path, monkeypatch):
    from pagedlm.backends.cpu.attention import CpuPagedAttentionBackend

    monkeypatch.setattr(CpuPagedAttentionBackend, "supported_kv_cache_dtypes", ("auto",))
    d = make_dummy_config_dir(tmp_path / "plain", "llama")
    with pytest.raises(ValueError, match="cannot read an FP8 KV cache"):
        LLM(model=d, load_format="dummy", skip_tokenizer_init=True, device="cpu", kv_cache_dtype="fp8")


@pytest.mark.parametrize("method", ["compressed-tensors", "gptq", "awq", "fp8"])
def test_dummy_load_of_a_method_named_on_the_command_line(tmp_path, method):
    """``--load-format dummy --quantization NAME`` on a config without quantization_config: the
    method's dummy layout (compressed-tensors: W4A16 group 128), as `pagedlm bench` uses it."""
    d = make_dummy_config_dir(tmp_path / "plain", "llama", hidden_size=256, intermediate_size=512)
    llm = LLM(model=d, load_format="dummy", skip_tokenizer_init=True, device="cpu", dtype="float32",
              quantization=method)
    qkv = llm.llm_engine.core.executor.worker.model_runner.model.model.layers[0].self_attn.qkv_proj
    assert qkv.quant_method.quantized
    out = llm.generate([{"prompt_token_ids": [1, 2, 3]}], SamplingParams(max_tokens=2, ignore_eos=True),
                       use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 2


_W4_GROUP = {"targets": ["Linear"], "weights": {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 128}}


@pytest.mark.parametrize("config, quantized", [
    ({"quant_method": "gptq", "bits": 4, "group_size": 128}, False),
    ({"quant_method": "gptq", "bits": 4, "group_size": 128, "lm_head": True}, True),
    ({"quant_method": "awq", "w_bit": 4, "q_group_size": 128, "lm_head": True}, True),
    ({"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {"g": _W4_GROUP},
      "ignore": ["lm_head"]}, False),
    ({"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {"g": _W4_GROUP}}, True),
    ({"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {"g": _W4_GROUP},
      "ignore": ["re:.*lm_head"]}, False),
])
def test_lm_head_quantized_is_read_from_the_checkpoint(tmp_path, config, quantized):
    """vLLM's ``lm_head_quantized``: GPTQ's and AWQ's ``lm_head`` key; compressed-tensors quantizes
    the head when a group's targets cover it and the ignore list does not hold it."""
    d = _with_quant_config(tmp_path, config)
    assert VllmConfig(model_config=ModelConfig(model=d)).quant_config.lm_head_quantized is quantized


def test_quantized_lm_head_needs_whole_packed_words_of_vocabulary(tmp_path):
    """GPTQ packs zero points along the output: a head over a vocabulary that is not a multiple
    of 8 (4-bit values per word) is refused by name."""
    d = _with_quant_config(tmp_path, {"quant_method": "gptq", "bits": 4, "group_size": 128, "lm_head": True},
                           vocab_size=500)
    with pytest.raises(ValueError, match="lm_head: 500 output features per rank are not a multiple of 8"):
        LLM(model=d, load_format="dummy", device="cpu", dtype="float32", skip_tokenizer_init=True)


def test_block_fp8_needs_whole_blocks_per_rank(tmp_path):
    """A fused part (here k and v: 2 heads x 64 = 128 features) that is not a whole number of
    blocks is refused by name, as vLLM refuses it."""
    d = _with_quant_config(tmp_path, {"quant_method": "fp8", "activation_scheme": "dynamic",
                                      "weight_block_size": [256, 128]})
    with pytest.raises(ValueError, match=r"qkv_proj: output parts \[256, 128, 128\] and input 256 per rank must be "
                                         r"whole blocks of \[256, 128\]"):
        LLM(model=d, load_format="dummy", device="cpu", dtype="float32", skip_tokenizer_init=True)


def test_gptq_dynamic_must_agree_across_a_fused_layer(tmp_path):
    """q_proj alone at 8 bits would split the fused q/k/v layer: refused, naming it."""
    d = _with_quant_config(tmp_path, {"quant_method": "gptq", "bits": 4, "group_size": 128,
                                      "dynamic": {r"+:.*\.q_proj": {"bits": 8}}})
    with pytest.raises(ValueError, match=r"the modules fused into model\.layers\.0\.self_attn\.qkv_proj get different"):
        LLM(model=d, load_format="dummy", device="cpu", dtype="float32", skip_tokenizer_init=True)


def _ct_group(targets, fmt="pack-quantized", ignore=()):
    weights = ({"num_bits": 4, "type": "int", "strategy": "group", "group_size": 128} if fmt == "pack-quantized"
               else {"num_bits": 8, "type": "float", "strategy": "channel"})
    return {"quant_method": "compressed-tensors", "format": fmt, "ignore": list(ignore),
            "config_groups": {"g": {"targets": targets, "weights": weights}}}


@pytest.mark.parametrize("config, packed", [
    (_ct_group(["Linear"]), False),  # the class name "Linear" names no embedding
    (_ct_group(["Linear", "Embedding"]), True),
    (_ct_group(["Linear", "re:.*embed_tokens$"]), True),  # a module-name pattern names it
    (_ct_group(["Linear", "Embedding"], ignore=["re:.*embed_tokens"]), False),
])
def test_compressed_tensors_packs_the_embeddings_its_targets_name(tmp_path, config, packed):
    d = _with_quant_config(tmp_path, config)
    llm = LLM(model=d, load_format="dummy", skip_tokenizer_init=True, device="cpu", dtype="float32")
    embed = llm.llm_engine.core.executor.worker.model_runner.model.model.embed_tokens
    assert hasattr(embed, "weight_packed") is packed and hasattr(embed, "weight") is not packed


def test_compressed_tensors_refuses_an_fp8_embedding_table(tmp_path):
    d = _with_quant_config(tmp_path, _ct_group(["Linear", "Embedding"], fmt="float-quantized"))
    with pytest.raises(ValueError, match="embed_tokens: a float-quantized embedding table .* supported for "
                                         "embeddings: pack-quantized int4/int8"):
        LLM(model=d, load_format="dummy", skip_tokenizer_init=True, device="cpu", dtype="float32")
