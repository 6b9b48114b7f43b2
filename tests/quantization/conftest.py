"""Quantized tiny checkpoints, built once per session from one wide-enough tiny Llama.

hidden 256 / intermediate 512, so group size 128 (what published W4A16 and GPTQ checkpoints
use) divides every input, also per rank at tensor-parallel size 2.
"""

from __future__ import annotations

import pytest

BASE = dict(hidden_size=256, intermediate_size=512, num_heads=4, num_kv_heads=2)


@pytest.fixture(scope="session")
def quant_base(tiny_checkpoint_factory):
    return tiny_checkpoint_factory("llama", **BASE)


@pytest.fixture(scope="session")
def quant_checkpoints(quant_base, tmp_path_factory):
    """name -> (quantized dir, HF reference dir). compressed-tensors files come from the real
    compressed-tensors package; GPTQ/AWQ are packed by pagedlm.core.testing.quantized (see there)."""
    pytest.importorskip("compressed_tensors")
    from pagedlm.core.testing.quantized import (
        dequantized_compressed_tensors_reference,
        make_awq_checkpoint,
        make_compressed_tensors_checkpoint,
        make_fp8_block_checkpoint,
        make_gptq_checkpoint,
    )

    root = tmp_path_factory.mktemp("quantized")
    built: dict[str, tuple[str, str]] = {}

    def ct(name: str, scheme: str, **kw):
        d = make_compressed_tensors_checkpoint(quant_base, root / name, scheme, **kw)
        built[name] = (d, d)

    ct("w4a16", "W4A16")
    ct("w4a16-channel", "W4A16", group_size=-1)
    ct("w8a16", "W8A16")
    ct("fp8-dynamic", "FP8_DYNAMIC")
    ct("fp8-static", "FP8")
    ct("w8a8-int8", "W8A8")
    d = make_compressed_tensors_checkpoint(quant_base, root / "w4a16-asym", "W4A16_ASYM")
    built["w4a16-asym"] = (d, dequantized_compressed_tensors_reference(d, root / "w4a16-asym-dequantized"))
    built["gptq"] = make_gptq_checkpoint(quant_base, root / "gptq", bits=4, group_size=128)
    built["gptq-act-order"] = make_gptq_checkpoint(quant_base, root / "gptq-act-order", bits=4, group_size=128,
                                                   desc_act=True)
    built["gptq-8bit-asym"] = make_gptq_checkpoint(quant_base, root / "gptq-8bit-asym", bits=8, group_size=128,
                                                   sym=False)
    built["awq"] = make_awq_checkpoint(quant_base, root / "awq", group_size=128)
    # the LM head quantized too: no ignore list (compressed-tensors' "Linear" target covers it),
    # GPTQ's and AWQ's "lm_head": true
    ct("w4a16-lm-head", "W4A16", ignore=())
    built["gptq-lm-head"] = make_gptq_checkpoint(quant_base, root / "gptq-lm-head", bits=4, group_size=128,
                                                 lm_head=True)
    # GPTQModel's per-module overrides: layer 1's MLP left in full precision, every other
    # down_proj at 8 bits (the first matching pattern decides)
    built["gptq-dynamic"] = make_gptq_checkpoint(quant_base, root / "gptq-dynamic", bits=4, group_size=128, dynamic={
        r"-:model\.layers\.1\.mlp\..*": {}, r"+:.*\.down_proj": {"bits": 8}})
    # the token embedding packed too (targets "Embedding"): transformers 5 cannot load such files
    # (its weight init meets an Embedding with no weight), so HF runs compressed-tensors'
    # decompression of them
    for name, scheme in (("w4a16-embed", "W4A16"), ("w4a16-asym-embed", "W4A16_ASYM")):
        d = make_compressed_tensors_checkpoint(quant_base, root / name, scheme, targets=("Linear", "Embedding"))
        built[name] = (d, dequantized_compressed_tensors_reference(d, root / f"{name}-dequantized"))
    built["awq-lm-head"] = make_awq_checkpoint(quant_base, root / "awq-lm-head", group_size=128, lm_head=True)
    # block-wise FP8: compressed-tensors' FP8_BLOCK preset, and the fp8 method's weight_block_size
    # layout (DeepSeek-V3, Qwen3-FP8), which HF reads itself; [64, 64] blocks stay whole at TP=2
    ct("fp8-block", "FP8_BLOCK")
    for name, block in (("fp8-block-native", (128, 128)), ("fp8-block-native-64", (64, 64))):
        d = make_fp8_block_checkpoint(quant_base, root / name, block_size=block)
        built[name] = (d, d)
    return built
