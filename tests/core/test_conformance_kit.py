"""The conformance kit's own checks: its references are core's, and it catches what it claims to.

The kit is run in-process here on the pieces it is made of (one attention case, one op case) with
deliberately broken implementations; tests/plugins runs it as a third party does, as a command.
"""

from __future__ import annotations

import pytest
import torch

from pagedlm.core.testing.conformance import attention, ops
from pagedlm.core.testing.conformance import op_reference as ref
from pagedlm.core.testing.conformance.__main__ import main
from pagedlm.core.testing.conformance.report import CheckResult, ConformanceReport, Tolerance, compare

CPU = torch.device("cpu")
DTYPES = [torch.float32, torch.bfloat16]


# -- the kit's torch references are core's layers ------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_op_references_equal_core_layers(dtype):
    from pagedlm.core.layers import GemmaRMSNorm, RMSNorm, SiluAndMul
    from pagedlm.core.layers.rotary import RotaryEmbedding, _default_inv_freq

    torch.manual_seed(0)
    norm = RMSNorm(64, eps=1e-6).to(dtype)
    norm.weight.data.normal_(1.0, 0.2)
    x, residual = torch.randn(5, 64).to(dtype), torch.randn(5, 64).to(dtype)
    assert torch.equal(ref.rms_norm(x, norm.weight, 1e-6), norm(x))
    for got, want in zip(ref.fused_add_rms_norm(x, residual, norm.weight, 1e-6), norm(x, residual)):
        assert torch.equal(got, want)
    assert torch.equal(ref.silu_and_mul(x), SiluAndMul()(x))
    for neox in (True, False):
        rope = RotaryEmbedding(32, 16, 4096, _default_inv_freq(1e6, 16), is_neox_style=neox)
        assert torch.equal(ref.cos_sin_cache(1e6, 16, 4096), rope.cos_sin_cache)
        pos = torch.tensor([0, 7, 4095])
        q, k = torch.randn(3, 4 * 32).to(dtype), torch.randn(3, 2 * 32).to(dtype)
        for got, want in zip(ref.rotary_embedding(pos, q, k, rope.cos_sin_cache, 32, 16, neox), rope(pos, q, k)):
            assert torch.equal(got, want)
        qn, kn = RMSNorm(32).to(dtype), RMSNorm(32).to(dtype)
        qn.weight.data.normal_(1.0, 0.2)
        got = ref.qk_norm_rotary_embedding(pos, q, k, qn.weight, kn.weight, 1e-6, rope.cos_sin_cache, 32, 16, neox)
        for g, w in zip(got, rope.forward_qk_norm(pos, q, k, qn, kn)):
            assert torch.equal(g, w)
        gq, gk = GemmaRMSNorm(32), GemmaRMSNorm(32)
        gq.weight.data.normal_(0.0, 0.2)
        got = ref.gemma_qk_norm_rotary_embedding(pos, q, k, gq.weight, gk.weight, 1e-6, rope.cos_sin_cache, 32, 16,
                                                 neox)
        for g, w in zip(got, rope.forward_qk_norm(pos, q, k, gq, gk)):
            assert torch.equal(g, w)
    gemma = GemmaRMSNorm(64, eps=1e-6)
    gemma.weight.data.normal_(0.0, 0.2)
    assert torch.equal(ref.gemma_rms_norm(x, gemma.weight, 1e-6), gemma(x))
    for got, want in zip(ref.gemma_fused_add_rms_norm(x, residual, gemma.weight, 1e-6), gemma(x, residual)):
        assert torch.equal(got, want)


# -- op checks -----------------------------------------------------------------------------------


def _cases(op_name):
    return [c for c in ops.op_cases(quick=True) if c.op == op_name]


@pytest.mark.parametrize("op_name", ["rms_norm", "fused_add_rms_norm", "rotary_embedding",
                                     "qk_norm_rotary_embedding", "gemma_rms_norm", "gemma_fused_add_rms_norm",
                                     "gemma_qk_norm_rotary_embedding", "silu_and_mul", "fused_experts",
                                     "unquantized_gemm"])
def test_reference_ops_pass_and_skewed_ops_fail(op_name):
    exact = getattr(ref, op_name)

    def skewed(*args):
        out = exact(*args)
        if isinstance(out, tuple):
            return tuple(None if o is None else o * 1.03 for o in out)
        return out * 1.03

    for seed, case in enumerate(_cases(op_name)):
        for dtype in DTYPES:
            good = ops.check_op_case(exact, CPU, dtype, case, seed)
            assert good.status == "PASS" and good.error == 0.0, good.line()
            bad = ops.check_op_case(skewed, CPU, dtype, case, seed)
            assert bad.status == "FAIL" and bad.error > 0.02, bad.line()


def test_a_crashing_op_is_a_failure_with_its_message():
    def broken(*args):
        raise RuntimeError("kernel launch failed")

    result = ops.check_op_case(broken, CPU, torch.float32, _cases("silu_and_mul")[0], 0)
    assert result.status == "FAIL" and "kernel launch failed" in result.line()


def _torch_gumbel(logits, temperature, seed, offset):
    """A correct ``gumbel_sample`` in torch (noise from ``(seed, offset)``)."""
    gen = torch.Generator(device=logits.device).manual_seed(seed * 1_000_003 + offset)
    noise = -torch.log(-torch.log(torch.rand(logits.shape, generator=gen, device=logits.device)))
    scaled = logits.float() / temperature.clamp_min(1e-5)[:, None]
    drawn = (scaled + noise).argmax(dim=-1)
    return torch.where(temperature < 1e-5, logits.float().argmax(dim=-1), drawn)


def test_gumbel_sample_checks():
    good = ops.check_gumbel_sample(_torch_gumbel, CPU, torch.float32, seed=0)
    assert [r.status for r in good] == ["PASS"] * 3, [r.line() for r in good]

    def last_index_on_ties(logits, temperature, seed, offset):
        flipped = _torch_gumbel(logits.flip(-1), temperature, seed, offset)
        return logits.shape[-1] - 1 - flipped

    def too_hot(logits, temperature, seed, offset):
        return _torch_gumbel(logits, temperature * 1.5, seed, offset)

    assert ops.check_gumbel_sample(last_index_on_ties, CPU, torch.float32, seed=0)[0].status == "FAIL"
    assert ops.check_gumbel_sample(too_hot, CPU, torch.float32, seed=0)[2].status == "FAIL"


NORM_OPS = {"rms_norm", "fused_add_rms_norm", "gemma_rms_norm", "gemma_fused_add_rms_norm", "rotary_embedding",
            "qk_norm_rotary_embedding", "gemma_qk_norm_rotary_embedding"}


def test_platform_ops_of_the_cpu_platform_are_the_gguf_int8_and_norm_kernels():
    from pagedlm.core.platforms import resolve_platform
    from pagedlm.core.testing.conformance.report import ConformanceReport
    from pagedlm.core.testing.conformance.runner import _run_ops

    registered = ops._platform_ops(resolve_platform("cpu"))
    assert set(registered) == {"gguf_mul_mat", "gguf_get_rows", "int8_weight_only_gemm", *NORM_OPS}
    report = ConformanceReport(device="cpu", attention_backend="cpu_paged")
    _run_ops(resolve_platform("cpu"), CPU, [torch.float32, torch.bfloat16], True, report.results.append)
    gguf = [r for r in report.results if r.name.startswith("gguf_")]
    assert len(gguf) == 2 * 8 * 3 and all(r.status == "PASS" for r in gguf), [r.line() for r in gguf]
    int8 = [r for r in report.results if r.name.startswith("int8_weight_only_gemm")]
    assert len(int8) == 2 * 3 and all(r.status == "PASS" for r in int8), [r.line() for r in int8]
    # NOTE: the norm and rotary kernels reproduce core's torch code bit for bit: error 0
    norms = [r for r in report.results if r.name.split()[0] in NORM_OPS]
    assert {r.name.split()[0] for r in norms} == NORM_OPS
    assert all(r.status == "PASS" and r.error == 0.0 for r in norms), [r.line() for r in norms if r.error]


# -- attention checks ----------------------------------------------------------------------------


def _reference_classes():
    from pagedlm.backends.cpu.attention import CpuPagedAttentionBackend, CpuPagedAttentionImpl

    return CpuPagedAttentionBackend, CpuPagedAttentionImpl


def test_a_backend_reading_past_the_context_fails():
    backend, impl = _reference_classes()

    class OffByOneImpl(impl):
        """Also attends to the key one position past each query (a future token, or a padded slot)."""

        def forward(self, query, key, value, kv_cache, metadata):
            for group in metadata.groups:
                mask = group.mask(self.sliding_window)  # [R, Q, S]
                group.masks[self.sliding_window] = mask | torch.nn.functional.pad(mask, (1, 0))[..., :-1]
            return super().forward(query, key, value, kv_cache, metadata)

    class OffByOne(backend):
        name = "off_by_one"

        @staticmethod
        def get_impl_cls():
            return OffByOneImpl

    case = attention.AttentionCase("mixed", 4, 2, 64, 16, torch.float32)
    assert attention.check_attention_case(backend, CPU, case, seed=0).status == "PASS"
    assert attention.check_attention_case(OffByOne, CPU, case, seed=0).status == "FAIL"


def test_a_backend_writing_padding_slots_fails():
    backend, impl = _reference_classes()

    class WritesPadding(impl):
        """Stores the padding rows too (at the spare block), as if slot -1 meant 'the last slot'."""

        @staticmethod
        def _write_kv(key, value, key_cache, value_cache, slot_mapping):
            slots = torch.where(slot_mapping < 0, slot_mapping + key_cache.shape[0], slot_mapping)
            key_cache.index_copy_(0, slots, key.to(key_cache.dtype))
            value_cache.index_copy_(0, slots, value.to(value_cache.dtype))

    class Padding(backend):
        name = "writes_padding"

        @staticmethod
        def get_impl_cls():
            return WritesPadding

    case = attention.AttentionCase("padded", 8, 2, 64, 16, torch.float32)
    result = attention.check_attention_case(Padding, CPU, case, seed=0)
    assert result.status == "FAIL" and "outside the new tokens' slots" in result.detail, result.line()


def test_another_cache_layout_is_filled_by_the_backend_itself():
    """A backend with its own cache shape (a flat ``[2, slots, Hkv, D]``) gets its cached prefixes
    written by a first step of its own; the outputs are still compared."""
    backend, _ = _reference_classes()

    class FlatCache(backend):
        name = "flat_cache"

        @staticmethod
        def get_kv_cache_shape(num_blocks, block_size, num_kv_heads, head_size):
            return (2, num_blocks * block_size, num_kv_heads, head_size)

    case = attention.AttentionCase("mixed", 4, 2, 64, 16, torch.float32)
    result = attention.check_attention_case(FlatCache, CPU, case, seed=0)
    assert result.status == "PASS" and "layout differs" in result.detail, result.line()


def test_declared_limits_are_skips():
    backend, _ = _reference_classes()

    class Narrow(backend):
        name = "narrow"
        supported_head_sizes = (64,)
        supported_dtypes = (torch.float32,)
        block_size_multiple = 16

    for case in (attention.AttentionCase("mixed", 4, 2, 128, 16, torch.float32),
                 attention.AttentionCase("mixed", 4, 2, 64, 16, torch.bfloat16),
                 attention.AttentionCase("mixed", 4, 2, 64, 1, torch.float32)):
        assert attention.check_attention_case(Narrow, CPU, case, seed=0).status == "SKIP"


# -- report and command line -----------------------------------------------------------------------


def test_compare_flags_non_finite_outputs():
    ok, err, why = compare(torch.tensor([1.0, float("nan")]), torch.tensor([1.0, 2.0]), Tolerance(1e-3, 0))
    assert not ok and "non-finite" in why


def test_an_empty_or_all_skipped_report_does_not_conform():
    report = ConformanceReport("cpu", "x")
    assert not report.ok
    report.add(CheckResult("ops", "y", "SKIP"))
    assert not report.ok and "DOES NOT CONFORM" in report.text()


def test_command_line_usage_errors_exit_2(capsys):
    assert main(["--device", "no_such_device"]) == 2
    assert main(["--device", "cpu", "--dtype", "float8"]) == 2
    assert "float8" in capsys.readouterr().err


# -- the one-call pytest helper --------------------------------------------------------------------


def _skewed_backend():
    """The reference backend with scores 3% too large (a module attribute, so a class path names it)."""
    backend, impl = _reference_classes()

    class SkewedImpl(impl):
        def __init__(self, *, scale, **kwargs):
            super().__init__(scale=scale * 1.03, **kwargs)

    class Skewed(backend):
        name = "skewed_in_process"

        @staticmethod
        def get_impl_cls():
            return SkewedImpl

    return Skewed


SkewedBackend = _skewed_backend()


class _SkewedPlugin:
    from pagedlm.core.plugins import hookimpl

    @staticmethod
    @hookimpl
    def pagedlm_register_attention_backends(register):
        register("skewed_in_process", f"{__name__}:SkewedBackend")


def test_assert_conformance_in_one_test():
    from pagedlm.core.plugins import get_plugins
    from pagedlm.core.testing import assert_conformance

    report = assert_conformance("cpu", "cpu_paged", dtypes="float32", quick=True, skip_e2e=True)
    assert report.ok and report.attention_backend == "cpu_paged"
    plugins = get_plugins()
    plugins.register(_SkewedPlugin, name="skewed_in_process")
    try:
        with pytest.raises(AssertionError, match=r"FAIL attention: mixed .* max_abs_err="):
            assert_conformance("cpu", "skewed_in_process", dtypes="float32", quick=True, skip_e2e=True)
    finally:
        plugins.unregister("skewed_in_process")
