"""The Triton LoRA kernels (``lora_shrink`` / ``lora_expand``) against torch, on a GPU or under
``TRITON_INTERPRET=1`` on the CPU; an adapted layer with the kernels equals core's torch path; and
on a GPU, LoRA under CUDA graphs gives HF + PEFT's greedy tokens."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
pytestmark = [] if INTERPRET else [pytest.mark.cuda]
DTYPES = [torch.float32, torch.float16] + ([] if INTERPRET else [torch.bfloat16])


def _state(device, dtype, ops: bool, max_loras=3, rank=16, tokens=64):
    from pagedlm.core.lora.punica import LoRAStepState

    shrink = expand = None
    if ops:
        from pagedlm.backends.cuda.kernels.lora import lora_expand, lora_shrink

        shrink, expand = lora_shrink, lora_expand
    return LoRAStepState(max_loras=max_loras, max_lora_rank=rank, max_num_tokens=tokens, dtype=dtype, device=device,
                         shrink=shrink, expand=expand)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("num_tokens", "size_in", "size_out", "rank"),
                         [(37, 96, 80, 8), (5, 64, 130, 16), (1, 64, 64, 4)])
def test_shrink_expand_match_torch(device, dtype, num_tokens, size_in, size_out, rank):
    gen = torch.Generator().manual_seed(num_tokens)
    num_slots = 3
    slots = torch.randint(-1, num_slots, (num_tokens,), generator=gen).numpy()
    state = _state(device, dtype, ops=True, max_loras=num_slots, rank=rank)
    state.set_step(slots)
    x = torch.randn(num_tokens, size_in, generator=gen).to(device, dtype)
    a = (torch.randn(num_slots, rank, size_in, generator=gen) * 0.1).to(device, dtype)
    b = (torch.randn(num_slots, size_out + 6, rank, generator=gen) * 0.1).to(device, dtype)
    scale = torch.tensor([0.5, 2.0, 1.25], device=device)
    wide = torch.randn(num_tokens, size_out + 10, generator=gen).to(device, dtype)
    y = wide.narrow(1, 3, size_out)  # a column slice, as a q/k/v slice of a fused output
    expected = wide.clone()
    from pagedlm.backends.cuda.kernels.lora import lora_expand, lora_shrink

    shrunk = lora_shrink(x, a, state.sorted_token_ids, state.slot_starts, state.slot_counts)
    lora_expand(y, shrunk, b[:, :size_out], state.sorted_token_ids, state.slot_starts, state.slot_counts, scale)
    for t, s in enumerate(slots.tolist()):
        if s < 0:
            continue
        ref_shrunk = x[t].float() @ a[s].float().T
        tol = 1e-4 if dtype == torch.float32 else 3e-2
        torch.testing.assert_close(shrunk[t], ref_shrunk, atol=tol, rtol=tol)
        expected[t, 3 : 3 + size_out] = (expected[t, 3 : 3 + size_out].float()
                                         + (ref_shrunk @ b[s, :size_out].float().T) * scale[s]).to(dtype)
    tol = 1e-4 if dtype == torch.float32 else 5e-2
    torch.testing.assert_close(wide, expected, atol=tol, rtol=tol)  # base rows and the other columns untouched


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_adapted_qkv_layer_kernels_equal_torch_path(device, dtype):
    """A fused q/k/v layer with three slots filled, once through the kernels and once through
    core's torch code, on the same step."""
    from pagedlm.core.layers.linear import QKVParallelLinear
    from pagedlm.core.lora.layers import LinearWithLoRA, adaptable_layers

    torch.manual_seed(0)
    base = QKVParallelLinear(64, 16, 4, 2, prefix="model.layers.0.self_attn.qkv_proj", params_dtype=dtype).to(device)
    base.weight.data.normal_(0, 0.1)
    model = torch.nn.Module()
    model.qkv_proj = base
    model.stacked_params = (("qkv_proj", "q_proj", "q"), ("qkv_proj", "k_proj", "k"), ("qkv_proj", "v_proj", "v"))
    (_, _, slices), = adaptable_layers(model)
    outs = []
    slots = np.array([2, -1, 0, 0, 1, 2, -1, 1, 0])
    for ops in (True, False):
        state = _state(device, dtype, ops=ops)
        layer = LinearWithLoRA(base, slices, state)
        gen = torch.Generator().manual_seed(1)
        layer.lora_a.copy_(torch.randn(layer.lora_a.shape, generator=gen) * 0.2)
        for b in layer.lora_b:
            b.copy_(torch.randn(b.shape, generator=gen) * 0.2)
        for slot, rank in enumerate([16, 8, 4]):
            layer.lora_a[slot, :, rank:] = 0
            for b in layer.lora_b:
                b[slot, :, rank:] = 0
            state.rank[slot], state.scale_host[slot] = rank, 0.5 + slot
            state.scale[slot] = 0.5 + slot
        state.set_step(slots)
        x = torch.randn(len(slots), 64, generator=gen).to(device, dtype)
        outs.append(layer(x))
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(outs[0], outs[1], atol=tol, rtol=tol)


@pytest.fixture
def lora_engine_kwargs(device, monkeypatch):
    """On a GPU: the CUDA platform. Under the interpreter: the CUDA runner on the CPU with its
    graph stand-in (tests/cuda/test_cuda_e2e.py), Triton attention and the Triton LoRA ops."""
    if device.type == "cuda":
        return {"device": "cuda"}
    from pagedlm.backends.cpu.platform import CpuPlatform
    from pagedlm.backends.cuda.model_runner import CudaModelRunner
    from pagedlm.core.layers import custom_ops

    registered = custom_ops.registered_ops
    monkeypatch.setattr(custom_ops, "registered_ops",
                        lambda name: {k: v for k, v in registered("cuda").items() if k.startswith("lora_")})
    monkeypatch.setattr(CpuPlatform, "get_model_runner_cls",
                        lambda self, cfg: "pagedlm.backends.cuda.model_runner:CudaModelRunner")
    monkeypatch.setattr(CudaModelRunner, "emulate_graphs", True)
    return {"device": "cpu", "attention_backend": "triton", "num_gpu_blocks_override": 64, "max_num_seqs": 8,
            "async_scheduling": True}


def test_graphs_lora_matches_hf_peft(tiny_checkpoint_factory, tmp_path, lora_engine_kwargs):
    from pagedlm.core import LLM, LoRARequest, SamplingParams
    from pagedlm.core.testing import compare_greedy
    from pagedlm.core.testing.lora import hf_peft_greedy, make_peft_adapter

    model = tiny_checkpoint_factory("llama")
    paths = [make_peft_adapter(model, tmp_path / f"a{i}", rank=r, seed=i, use_rslora=i == 1)
             for i, r in enumerate([8, 4, 16])]
    prompts = [[5, 6, 7, 8, 9, 10, 11], [40, 41, 42], [300, 200, 100, 7, 77, 177]]
    llm = LLM(model, dtype="float32", enable_lora=True, max_loras=2, max_lora_rank=16, max_model_len=128,
              **lora_engine_kwargs)
    runner = llm.llm_engine.core.executor.worker.model_runner
    assert runner._graphs and runner.lora_manager.state.uses_ops
    pairs = [(a, p) for p in range(3) for a in (None, 0, 1, 2)]
    loras = [None] + [LoRARequest(f"a{i}", i + 1, path) for i, path in enumerate(paths)]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": prompts[p]} for _, p in pairs], params, use_tqdm=False,
                        lora_request=[loras[0 if a is None else a + 1] for a, _ in pairs])
    refs = {a: hf_peft_greedy(model, None if a is None else paths[a], prompts, 8) for a in (None, 0, 1, 2)}
    mismatches, _ = compare_greedy([list(o.outputs[0].token_ids) for o in outs], [refs[a][p] for a, p in pairs],
                                   tie_tol=1e-3)
    assert mismatches == 0
    llm.shutdown()
