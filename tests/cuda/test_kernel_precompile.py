"""Start-up compiles every Triton kernel variant a run launches, in parallel, before it is launched
(``CudaModelRunner.compile_kernels``): afterwards neither graph capture nor a run of mixed
requests compiles anything, so no step waits on a compile."""

from __future__ import annotations

import random

import pytest

pytestmark = [pytest.mark.cuda]


def _forget_compiled_kernels() -> None:
    """Drop this process's in-memory variants (earlier tests compiled some); Triton's disk cache
    still serves them, but each must be asked for again, so each shows in the hook."""
    import triton

    from pagedlm.backends.cuda.kernels import fused_moe, layer_ops, paged_attention, sampling

    for module in (layer_ops, paged_attention, sampling, fused_moe):
        for obj in vars(module).values():
            if isinstance(obj, triton.runtime.JITFunction):
                obj.device_caches.clear()


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_moe"])  # the MoE op picks its blocks by batch size
@pytest.mark.parametrize("enforce_eager", [False, True], ids=["graphs", "eager"])
def test_no_kernel_compiles_after_start_up(tiny_checkpoints, device, enforce_eager, arch):
    if device.type != "cuda":
        pytest.skip("compiling is what the interpreter does not do")
    import triton

    from pagedlm.core import LLM, SamplingParams

    _forget_compiled_kernels()
    compiles: list[tuple[str, bool]] = []

    def record(*, fn, is_manual_warmup, **_):
        compiles.append((fn.name, is_manual_warmup))
        return False  # True would skip the compile

    previous = triton.knobs.runtime.jit_cache_hook
    triton.knobs.runtime.jit_cache_hook = record
    try:
        llm = LLM(model=tiny_checkpoints[arch], dtype="bfloat16", device="cuda", max_num_seqs=32,
                  enforce_eager=enforce_eager)
        at_start = len(compiles)
        rng = random.Random(0)
        base = [rng.randrange(4, 500) for _ in range(80)]
        prompts = [base[: rng.randrange(1, 80)] + [rng.randrange(4, 500) for _ in range(rng.randrange(1, 60))]
                   for _ in range(24)]
        kinds = [
            {"temperature": 0.0},
            {"temperature": 0.8},
            {"temperature": 0.7, "presence_penalty": 0.5},  # float32 logits into the fused sampler
            {"temperature": 1.0, "top_k": 5, "top_p": 0.9},
            {"temperature": 0.0, "logprobs": 2},
        ]
        params = [SamplingParams(max_tokens=rng.randrange(2, 40), ignore_eos=True, **kinds[i % len(kinds)])
                  for i in range(len(prompts))]
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    finally:
        triton.knobs.runtime.jit_cache_hook = previous
    assert [len(o.outputs[0].token_ids) for o in outputs] == [p.max_tokens for p in params]
    names = {name for name, _ in compiles}
    assert {"_paged_attention_kernel", "_rms_norm_kernel", "_gumbel_chunk_kernel"} <= names, names
    if arch == "qwen3_moe":
        assert "fused_moe_kernel" in names, names
    lazy = [name for name, warmup in compiles if not warmup]
    assert not lazy, f"compiled on first launch instead of at start-up: {lazy}"
    assert len(compiles) == at_start, f"compiled after start-up: {compiles[at_start:]}"


def test_a_failed_compile_pass_leaves_the_next_one_working(device):
    """A variant that fails to compile fails its ``compile_only`` block with Triton's error, and
    the process's next block (the next ``LLM(...)``) still compiles: Triton 3.6 left its compile
    mode active after the failure, and every later start-up of the process then failed."""
    if device.type != "cuda":
        pytest.skip("compiling is what the interpreter does not do")
    import torch
    import triton
    import triton.language as tl

    from pagedlm.backends.cuda.kernels.launch import compile_only, launch

    @triton.jit
    def refused(x_ptr, N: tl.constexpr):
        tl.static_assert(N > 0, "N must be positive")
        tl.store(x_ptr + tl.arange(0, N), 1.0)

    x = torch.zeros(16, device=device)
    with pytest.raises(Exception, match="N must be positive"):
        with compile_only():
            launch(refused, (1,), x, N=-16)
    with compile_only() as stats:
        launch(refused, (1,), x, N=16)
    assert stats.num_variants == 1
    launch(refused, (1,), x, N=16)
    assert x.sum().item() == 16
