"""Quantized experts (``FusedMoE`` with FP8 and W4A16/W8A16 methods) on the tiny Qwen3-MoE and
Mixtral checkpoints, against HF transformers on the same weights decompressed.

The experts are quantized by the compressed-tensors package (``pagedlm.core.testing.quantized_moe``).

- Weight-only (W4A16 group 32, asymmetric W4A16, W8A16 per channel): HF's greedy tokens on the
  decompressed weights, logprobs within 1e-3 (near-ties forgiven and counted, at most one).
- FP8 (online ``quantization="fp8"``; compressed-tensors FP8 experts with dynamic per-token
  activations, per-tensor and per-channel weights): HF on the FP8 weights decompressed, with the
  input of every quantized projection rounded through FP8 per row as the ``fused_experts_fp8`` /
  ``fp8_scaled_mm`` contracts say (``hf_with_fp8_inputs``: HF's own forward, its linear calls
  wrapped): the same greedy tokens (near-ties of 1e-3 forgiven, at most one), logprobs within 1e-3.
  Against HF *without* activation quantization, the FP8 noise flips routing decisions of these
  random models; that distance is printed (prompts with identical tokens, of M), not asserted.
- TP=2 (gloo) gives TP=1's tokens, with and without expert parallelism (FP8: with it).
"""

from __future__ import annotations

import contextlib
import random

import pytest
import torch

from pagedlm.core import LLM, SamplingParams
from pagedlm.core.testing import assert_greedy_matches_hf, hf_greedy

MAX_NEW = 8
ARCHS = ("qwen3_moe", "mixtral")
#: name -> (compressed-tensors preset, overrides); group 32 divides every expert input, also per rank at TP=2
SCHEMES = {
    "w4a16": ("W4A16", {"group_size": 32}),
    "w4a16-asym": ("W4A16_ASYM", {"group_size": 32}),
    "w8a16-channel": ("W8A16", {"strategy": "channel"}),
    "fp8-tensor": ("FP8_DYNAMIC", {"strategy": "tensor"}),
    "fp8-channel": ("FP8_DYNAMIC", {}),
}
CHECKPOINTS = [("qwen3_moe", "w4a16"), ("qwen3_moe", "w4a16-asym"), ("qwen3_moe", "w8a16-channel"),
               ("qwen3_moe", "fp8-tensor"), ("mixtral", "w4a16"), ("mixtral", "fp8-channel")]
WEIGHT_ONLY = [c for c in CHECKPOINTS if not c[1].startswith("fp8")]
FP8 = [c for c in CHECKPOINTS if c[1].startswith("fp8")]


def prompts(seed: int = 3) -> list[list[int]]:
    rng = random.Random(seed)
    base = [rng.randrange(4, 500) for _ in range(30)]
    return [base, base[:12] + [7, 8, 9], [rng.randrange(4, 500) for _ in range(3)],
            [rng.randrange(4, 500) for _ in range(8)]]


@pytest.fixture(scope="module")
def moe_checkpoints(tiny_checkpoint_factory, tmp_path_factory):
    """(arch, name) -> (quantized dir, reference dir with the quantized tensors decompressed);
    ``(arch, "online-fp8")`` -> (the full-precision checkpoint, the compressed-tensors checkpoint
    of its experts and attention projections in per-tensor FP8 (what online FP8 makes of it)).
    ``(arch, "online-fp8-reference")`` -> that checkpoint decompressed."""
    pytest.importorskip("compressed_tensors")
    from pagedlm.core.testing.quantized_moe import ALL_PROJECTIONS, make_quantized_experts_checkpoint

    root = tmp_path_factory.mktemp("quantized-moe")
    built = {}
    for arch, name in CHECKPOINTS:
        preset, kw = SCHEMES[name]
        built[arch, name] = make_quantized_experts_checkpoint(tiny_checkpoint_factory(arch), root / f"{arch}-{name}",
                                                              preset, **kw)
    for arch in ARCHS:
        src = tiny_checkpoint_factory(arch)
        ct, ref = make_quantized_experts_checkpoint(src, root / f"{arch}-all-fp8", "FP8_DYNAMIC", strategy="tensor",
                                                    targets=ALL_PROJECTIONS)
        built[arch, "online-fp8"] = (src, ct)
        built[arch, "online-fp8-reference"] = (ref, ref)
    return built


def _through_fp8(x: torch.Tensor) -> torch.Tensor:
    """``x`` rounded through float8_e4m3fn per row (scale amax / 448), in x's dtype."""
    xf = x.float()
    scale = (xf.abs().amax(dim=-1, keepdim=True) / 448.0).clamp(min=1e-12)
    return ((xf / scale).clamp(-448.0, 448.0).to(torch.float8_e4m3fn).float() * scale).to(x.dtype)


@contextlib.contextmanager
def hf_with_fp8_inputs(arch: str, attention_too: bool):
    """While open, HF's experts modules (and with ``attention_too`` its attention modules) round
    the input of each of their ``torch.nn.functional.linear`` calls through FP8 per row; the
    experts run HF's eager per-expert loop (the one that calls ``linear``)."""
    if arch == "qwen3_moe":
        from transformers.models.qwen3_moe import modeling_qwen3_moe as modeling
        classes = [modeling.Qwen3MoeExperts] + ([modeling.Qwen3MoeAttention] if attention_too else [])
    else:
        from transformers.models.mixtral import modeling_mixtral as modeling
        classes = [modeling.MixtralExperts] + ([modeling.MixtralAttention] if attention_too else [])
    functional = torch.nn.functional
    real_linear = functional.linear

    def fp8_linear(x, w, b=None):
        return real_linear(_through_fp8(x), w, b)

    def wrapped(original):
        def forward(self, *args, **kwargs):
            config = getattr(self, "config", None)
            saved = getattr(config, "_experts_implementation", None)
            if config is not None:
                config._experts_implementation = "eager"
            functional.linear = fp8_linear
            try:
                return original(self, *args, **kwargs)
            finally:
                functional.linear = real_linear
                if config is not None:
                    config._experts_implementation = saved
        return forward

    originals = {cls: cls.forward for cls in classes}
    try:
        for cls, original in originals.items():
            cls.forward = wrapped(original)
        yield
    finally:
        for cls, original in originals.items():
            cls.forward = original


def _experts(llm: LLM, layer: int = 0):
    block = llm.llm_engine.core.executor.worker.model_runner.model.model.layers[layer]
    return (block.mlp if hasattr(block, "mlp") else block.block_sparse_moe).experts


@pytest.mark.parametrize(("arch", "name"), WEIGHT_ONLY, ids=[f"{a}-{n}" for a, n in WEIGHT_ONLY])
def test_weight_only_experts_match_hf(arch, name, moe_checkpoints):
    model_dir, reference = moe_checkpoints[arch, name]
    llm = LLM(model=model_dir, dtype="float32", device="cpu")
    assert type(_experts(llm).quant_method).__name__ == "CompressedTensorsWNA16MoEMethod"
    forgiven = assert_greedy_matches_hf(model_dir, prompts(), MAX_NEW, llm=llm,
                                        reference=hf_greedy(reference, prompts(), MAX_NEW), logprobs=5,
                                        logprob_atol=1e-3)
    assert forgiven <= 1


def _fp8_check(arch: str, model_dir: str, reference: str, attention_too: bool, capsys, plain_too: bool = False,
               **llm_kwargs) -> None:
    with hf_with_fp8_inputs(arch, attention_too):
        ref = hf_greedy(reference, prompts(), MAX_NEW)
    llm = LLM(model=model_dir, dtype="float32", device="cpu", **llm_kwargs)
    assert type(_experts(llm).quant_method).__name__ == "Fp8MoEMethod"
    assert _experts(llm).w13_weight.dtype == torch.float8_e4m3fn
    # NOTE: logprobs within 0.1, not 1e-3: activations are rounded to e4m3 (3 mantissa bits) per
    # token, so a last-bit difference upstream (another CPU's float32 matmul blocking) can move one
    # activation by a whole e4m3 step, which shifts that step's logprobs by a few hundredths
    # (0.046 measured on an AMD EPYC host); wrong scales or layouts move them by far more.
    forgiven = assert_greedy_matches_hf(model_dir, prompts(), MAX_NEW, llm=llm, reference=ref, logprobs=5,
                                        logprob_atol=0.1, tie_tol=1e-3)
    assert forgiven <= 1
    if not plain_too:
        return
    plain = hf_greedy(reference, prompts(), MAX_NEW)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts()],
                        SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True), use_tqdm=False)
    same = sum(list(o.outputs[0].token_ids) == r.token_ids for o, r in zip(outs, plain))
    with capsys.disabled():
        print(f"\n[{arch} {model_dir.rsplit('/', 1)[-1]}] vs HF without FP8 activations: {same} of "
              f"{len(plain)} prompts identical; near-ties forgiven vs HF with them: {forgiven}")


@pytest.mark.parametrize(("arch", "name"), FP8, ids=[f"{a}-{n}" for a, n in FP8])
def test_fp8_checkpoint_experts_match_hf_with_fp8_activations(arch, name, moe_checkpoints, capsys):
    model_dir, reference = moe_checkpoints[arch, name]
    _fp8_check(arch, model_dir, reference, False, capsys)


@pytest.mark.parametrize("arch", ARCHS)
def test_online_fp8_experts_match_hf_with_fp8_activations(arch, moe_checkpoints, capsys):
    """``quantization="fp8"`` on the float32 checkpoint: per-tensor FP8 weights (amax / 448 of
    each checkpoint tensor, gate and up each their own) for the experts and the attention
    projections; HF on compressed-tensors' per-tensor FP8 of the same tensors is the reference."""
    src, _ = moe_checkpoints[arch, "online-fp8"]
    reference, _ = moe_checkpoints[arch, "online-fp8-reference"]
    _fp8_check(arch, src, reference, True, capsys, plain_too=True, quantization="fp8")


def test_online_fp8_equals_the_compressed_tensors_fp8_checkpoint(moe_checkpoints):
    """The same quantization, made at load time or read from compressed-tensors' files: the same
    FP8 expert weights and scales."""
    src, ct = moe_checkpoints["qwen3_moe", "online-fp8"]
    online = _experts(LLM(model=src, dtype="float32", device="cpu", quantization="fp8"))
    stored = _experts(LLM(model=ct, dtype="float32", device="cpu"))
    for name in ("w13_weight", "w2_weight", "w13_weight_scale", "w2_weight_scale"):
        a, b = getattr(online, name), getattr(stored, name)
        assert a.shape == b.shape and torch.equal(a.float(), b.float()), name


def _tp_tokens(model_dir: str, **extra) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    llm = LLM(model=model_dir, dtype="float32", device="cpu", **extra)
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts()], params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]
    finally:
        llm.shutdown()


@pytest.mark.timeout(240)
@pytest.mark.parametrize(("arch", "name", "layouts"), [
    ("qwen3_moe", "w4a16-asym", ({"tensor_parallel_size": 2},
                                 {"tensor_parallel_size": 2, "enable_expert_parallel": True})),
    ("mixtral", "fp8-channel", ({"tensor_parallel_size": 2, "enable_expert_parallel": True},)),
], ids=["qwen3_moe-w4a16-asym", "mixtral-fp8-channel"])
def test_tensor_and_expert_parallel_give_single_rank_tokens(arch, name, layouts, moe_checkpoints):
    """TP=2 (gloo) slices every expert's packed weights, scales and zero points along the
    intermediate dimension, or with expert parallelism places whole experts: TP=1's tokens.

    NOTE: FP8 experts sliced by TP are not compared token for token: each rank quantizes its half
    of the down projection's input row with its own scale (as vLLM does), noise that flips
    routing decisions of these random models; with expert parallelism the arithmetic is TP=1's."""
    model_dir = moe_checkpoints[arch, name][0]
    one = _tp_tokens(model_dir)
    for layout in layouts:
        assert _tp_tokens(model_dir, **layout) == one, layout


@pytest.mark.parametrize(("quantization", "method"), [("fp8", "Fp8MoEMethod"),
                                                      ("compressed-tensors", "CompressedTensorsWNA16MoEMethod")])
def test_benchmark_config_runs_with_dummy_quantized_experts(quantization, method, tmp_path):
    """What ``pagedlm bench --model-config qwen3-30b-a3b --load-format dummy --quantization ...``
    builds (compressed-tensors: its dummy W4A16 group 128), shrunk so the CPU runs it."""
    from pagedlm.core.bench.common import model_config_dir

    path = model_config_dir("qwen3-30b-a3b", str(tmp_path / "qwen3-30b-a3b"))
    overrides = {"num_hidden_layers": 2, "hidden_size": 256, "intermediate_size": 256, "vocab_size": 1000,
                 "num_experts": 8, "num_attention_heads": 4, "num_key_value_heads": 2, "moe_intermediate_size": 256,
                 "head_dim": 64}
    llm = LLM(model=path, load_format="dummy", skip_tokenizer_init=True, dtype="float32", device="cpu",
              hf_overrides=overrides, max_model_len=128, quantization=quantization)
    moe = _experts(llm)
    assert type(moe.quant_method).__name__ == method
    # FP8: a quarter of the float32 experts' bytes; int4: an eighth (plus scales)
    stored = sum(p.numel() * p.element_size() for p in moe.parameters())
    assert stored <= (0.27 if quantization == "fp8" else 0.14) * 8 * 3 * 256 * 256 * 4
    outs = llm.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(max_tokens=4, ignore_eos=True),
                        use_tqdm=False)
    assert len(outs[0].outputs[0].token_ids) == 4
