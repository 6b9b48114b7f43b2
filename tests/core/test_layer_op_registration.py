"""pagedlm_register_ops: a plugin's op replaces core's torch code on its platform, and only there."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagedlm.core.layers import custom_ops
from pagedlm.core.plugins import PluginError, Plugins, get_plugins, hookimpl

#: calls of counting_silu_and_mul, per test
CALLS: list[tuple[int, ...]] = []


def counting_silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``silu_and_mul``'s contract, counting its calls."""
    CALLS.append(tuple(x.shape))
    d = x.shape[-1] // 2
    return F.silu(x[..., :d]) * x[..., d:]


def never_called(*args, **kwargs):
    raise AssertionError("an op registered for another platform was called")


class _OpsPlugin:
    """An in-process plugin registering ``(op_name, platform, function_path)`` triples."""

    def __init__(self, *registrations: tuple[str, str, str], override: bool = False) -> None:
        self.registrations = registrations
        self.override = override

    @hookimpl
    def pagedlm_register_ops(self, register):
        for op_name, platform, path in self.registrations:
            register(op_name, platform, path, override=self.override)


HERE = __name__


@pytest.fixture
def ops_plugin():
    """Register plugins on the process-wide manager for one test (then unregister them)."""
    plugins = get_plugins()
    names: list[str] = []

    def add(name: str, plugin: _OpsPlugin) -> None:
        plugins.register(plugin, name=name)
        names.append(name)

    CALLS.clear()
    yield add
    for name in names:
        plugins.unregister(name)


def _greedy(model_dir: str) -> tuple[list[int], object]:
    from pagedlm.core import LLM, SamplingParams

    llm = LLM(model=model_dir, dtype="float32", device="cpu", num_gpu_blocks_override=64)
    out = llm.generate([{"prompt_token_ids": [5, 6, 7, 8]}],
                       SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False)
    return list(out[0].outputs[0].token_ids), llm.llm_engine.core.executor.worker.model_runner


def test_a_plugin_op_on_the_cpu_platform_is_used_by_the_model(ops_plugin, tiny_llama):
    reference, _ = _greedy(tiny_llama)
    ops_plugin("counting_ops", _OpsPlugin(("silu_and_mul", "cpu", f"{HERE}:counting_silu_and_mul"),
                                          ("rms_norm", "elsewhere", f"{HERE}:never_called")))
    # NOTE: besides the CPU backend's own kernels (GGUF, int8, norms and rotary): its rms_norm
    # stays, the other platform's never reaches the CPU table
    cpu_ops = custom_ops.registered_ops("cpu")
    assert cpu_ops["silu_and_mul"] is counting_silu_and_mul and cpu_ops["rms_norm"] is not never_called
    tokens, runner = _greedy(tiny_llama)
    assert runner.layer_ops["silu_and_mul"] is counting_silu_and_mul
    assert CALLS, "the model's MLPs did not call the registered op"
    assert tokens == reference  # the op keeps the contract, so greedy tokens are unchanged


def test_override_replaces_another_plugins_op(ops_plugin):
    ops_plugin("vendor", _OpsPlugin(("silu_and_mul", "cpu", f"{HERE}:never_called")))
    ops_plugin("site", _OpsPlugin(("silu_and_mul", "cpu", f"{HERE}:counting_silu_and_mul"), override=True))
    assert custom_ops.registered_ops("cpu")["silu_and_mul"] is counting_silu_and_mul


def test_two_plugins_registering_one_op_name_both(ops_plugin):
    ops_plugin("vendor", _OpsPlugin(("silu_and_mul", "cpu", f"{HERE}:never_called")))
    ops_plugin("site", _OpsPlugin(("silu_and_mul", "cpu", f"{HERE}:counting_silu_and_mul")))
    with pytest.raises(PluginError, match="'site'.*'vendor'"):
        custom_ops.registered_ops("cpu")


def test_unknown_op_names_are_refused_and_dotted_ones_are_a_plugins_own(ops_plugin):
    ops_plugin("typo", _OpsPlugin(("rmsnorm", "elsewhere", f"{HERE}:never_called")))
    with pytest.raises(PluginError, match="plugin 'typo' registers unknown layer op 'rmsnorm'; known: rms_norm"):
        custom_ops.registered_ops("cpu")
    plugins = Plugins(autoload=False)
    plugins.register(_OpsPlugin(("demo.fused_gate", "cpu", f"{HERE}:counting_silu_and_mul")), name="demo")
    assert [(s.op_name, s.platform, s.plugin) for s in plugins.ops()] == [("demo.fused_gate", "cpu", "demo")]
    with custom_ops.use_ops({"demo.fused_gate": counting_silu_and_mul}):
        assert custom_ops.bound_op("demo.fused_gate") is counting_silu_and_mul
    with pytest.raises(ValueError, match="unknown layer op 'gelu'"):
        custom_ops.bound_op("gelu")


def test_a_function_that_cannot_be_imported_names_the_plugin(ops_plugin):
    ops_plugin("broken_ops", _OpsPlugin(("silu_and_mul", "cpu", "pagedlm_no_such_module_xyz:fn")))
    with pytest.raises(PluginError, match="plugin 'broken_ops'.*silu_and_mul.*pagedlm_no_such_module_xyz"):
        custom_ops.registered_ops("cpu")
    assert custom_ops.registered_ops("elsewhere") == {}  # other platforms import nothing of it


def test_layers_bind_the_table_they_are_built_with():
    from pagedlm.core.layers import RMSNorm, SiluAndMul

    def fake_norm(x, weight, eps):
        return x * 0

    with custom_ops.use_ops({"silu_and_mul": counting_silu_and_mul, "rms_norm": fake_norm}):
        act, norm = SiluAndMul(), RMSNorm(8)
    plain = RMSNorm(8)  # built outside: torch
    x = torch.randn(3, 8)
    assert torch.equal(norm(x), torch.zeros(3, 8))
    assert not torch.equal(plain(x), torch.zeros(3, 8))
    CALLS.clear()
    act(x)
    assert CALLS == [(3, 8)]
    assert custom_ops.bound_op("silu_and_mul") is None  # the table ends with the block


def test_docs_cover_every_op_contract():
    from pathlib import Path

    text = (Path(__file__).resolve().parents[2] / "docs" / "plugins.md").read_text()
    missing = [name for name in custom_ops.OP_CONTRACTS if f"`{name}`" not in text]
    assert not missing, f"docs/plugins.md does not document the ops {missing}"


def test_linear_layers_bind_unquantized_gemm():
    """A full-precision linear built with an ``unquantized_gemm`` op calls it (a [..., K] input
    flattened to [T, K] and back; the bias handed to the op); built without one, F.linear runs."""
    from pagedlm.core.layers import QKVParallelLinear, ReplicatedLinear, RowParallelLinear

    calls: list[tuple[tuple[int, ...], tuple[int, ...], bool]] = []

    def fake_gemm(x, weight, bias):
        calls.append((tuple(x.shape), tuple(weight.shape), bias is not None))
        return F.linear(x, weight, bias) + 1.0  # marked, so the result shows the op ran

    with custom_ops.use_ops({"unquantized_gemm": fake_gemm}):
        layers = [ReplicatedLinear(8, 6, bias=True), RowParallelLinear(8, 5),
                  QKVParallelLinear(8, 2, 2, 1, bias=True)]
    plain = ReplicatedLinear(8, 6, bias=True)  # built outside: F.linear
    assert custom_ops.bound_op("unquantized_gemm") is None
    gen = torch.Generator().manual_seed(0)
    for layer in [*layers, plain]:
        for p in layer.parameters():
            p.data.copy_(torch.randn(p.shape, generator=gen))
    x = torch.randn(2, 3, 8, generator=gen)
    for layer in layers:
        calls.clear()
        out = layer(x)
        want = F.linear(x, layer.weight, layer.bias) + 1.0
        assert out.shape == want.shape and torch.allclose(out, want)
        assert calls == [((6, 8), tuple(layer.weight.shape), layer.bias is not None)]
    calls.clear()
    assert torch.equal(plain(x), F.linear(x, plain.weight, plain.bias)) and not calls
    assert plain.quant_method.op is None


def test_wna16_layers_keep_the_platforms_repacked_weights():
    """A W4A16 layer built with a ``wna16_repack`` op stores what it returns after loading and
    hands exactly that to ``wna16_gemm`` (API 1.11); built without one, the reference layout."""
    from pagedlm.core.layers import ReplicatedLinear
    from pagedlm.core.layers.quantization.gptq import GPTQConfig
    from pagedlm.core.layers.quantization.utils import pack_rows, wna16_gemm_ref

    config = GPTQConfig.from_config({"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": False,
                                     "sym": True})
    seen = []

    def fake_repack(qweight, scales, zeros, g_idx, bits, group_size):
        assert (zeros, g_idx, bits, group_size) == (None, None, 4, 32)
        return qweight.flip(0)  # a "layout": the op below undoes it

    def fake_gemm(x, qweight, scales, zeros, g_idx, bits, group_size):
        seen.append(qweight)
        return wna16_gemm_ref(x, qweight.flip(0), scales, zeros, g_idx, bits, group_size)

    with custom_ops.use_ops({"wna16_repack": fake_repack, "wna16_gemm": fake_gemm}):
        layer = ReplicatedLinear(64, 16, bias=False, quant_config=config)
    plain = ReplicatedLinear(64, 16, bias=False, quant_config=config)
    gen = torch.Generator().manual_seed(0)
    q = torch.randint(0, 16, (64, 16), generator=gen, dtype=torch.int32)
    for lin in (layer, plain):
        lin.qweight.data.copy_(pack_rows(q, 4))
        lin.scales.data.copy_(torch.rand(2, 16, generator=gen) * 0.1)
        lin.quant_method.process_weights_after_loading(lin)
    assert torch.equal(layer.w_qweight, plain.w_qweight.flip(0))
    assert torch.equal(plain.w_qweight, pack_rows(q, 4))
    x = torch.randn(3, 64, generator=gen)
    assert torch.allclose(layer(x), wna16_gemm_ref(x, plain.w_qweight, layer.w_scales, None, None, 4, 32))
    assert len(seen) == 1 and seen[0] is layer.w_qweight
