"""Run a ``pagedlm`` command with one CUDA-backend optimisation switched off, to attribute a
throughput change to it (the attribution runs of 2026-11-29 in docs/cuda.md were made this way).

    python packages/backend-cuda/benchmarks/ablate.py SWITCH pagedlm-args...
    python packages/backend-cuda/benchmarks/ablate.py torch-sampler bench throughput \\
        --model-config qwen3-0.6b --load-format dummy --workload nano

Switches:
  none            change nothing (the baseline, in the same way of starting)
  torch-sampler   core's torch sampler instead of the fused ``gumbel_sample`` kernel
  request-order   decode programs in batch order instead of longest context first
  two-per-sm      the earlier split-KV rule: split only below one program per SM, up to two
  float32-logits  logits cast to float32 in the model (a [B, vocab] copy per step) as before
  torch-argmax    all-greedy batches sampled by torch.argmax instead of the fused op
"""

from __future__ import annotations

import runpy
import sys


def _torch_sampler() -> None:
    from pagedlm.core.layers import custom_ops

    registered = custom_ops.registered_ops

    def registered_all_but_sampler(platform_name: str) -> dict:
        ops = registered(platform_name)
        ops.pop("gumbel_sample", None)
        return ops

    custom_ops.registered_ops = registered_all_but_sampler


def _request_order() -> None:
    from pagedlm.backends.cuda import triton_attn

    build = triton_attn.TritonAttentionMetadataBuilder.build

    def build_unordered(self, common):
        metadata = build(self, common)
        metadata.req_order = None
        return metadata

    triton_attn.TritonAttentionMetadataBuilder.build = build_unordered


def _two_per_sm() -> None:
    from pagedlm.backends.cuda import triton_attn

    def choose(num_tiles: int, num_kv_heads: int, max_seq_len: int, num_sms: int, block_n: int = 64) -> int:
        programs = max(1, num_tiles * num_kv_heads)
        if programs >= num_sms:
            return 1
        limit = min(2 * num_sms // programs, max(1, max_seq_len // (2 * block_n)), 16)
        splits = 1
        while splits * 2 <= limit:
            splits *= 2
        return splits

    triton_attn.choose_num_splits = choose


def _float32_logits() -> None:
    from pagedlm.backends.cuda.model_runner import CudaModelRunner
    from pagedlm.core.layers.vocab_embedding import LogitsProcessor

    load = CudaModelRunner.load_model

    def load_float32(self) -> None:
        load(self)
        for module in self.model.modules():
            if isinstance(module, LogitsProcessor):
                module.float32_output = True

    CudaModelRunner.load_model = load_float32


def _torch_argmax() -> None:
    from pagedlm.core.sample import sampler

    sample = sampler.sample

    def sample_argmax(logits, md, gumbel_sample=None):
        return sample(logits, md, None if md.all_greedy else gumbel_sample)

    sampler.sample = sample_argmax


SWITCHES = {"none": lambda: None, "torch-sampler": _torch_sampler, "request-order": _request_order,
            "two-per-sm": _two_per_sm, "float32-logits": _float32_logits, "torch-argmax": _torch_argmax}


def main() -> None:
    if len(sys.argv) < 3 or sys.argv[1] not in SWITCHES:
        sys.exit(__doc__)
    SWITCHES[sys.argv[1]]()
    sys.argv = ["pagedlm", *sys.argv[2:]]
    runpy.run_module("pagedlm.core.cli", run_name="__main__")


if __name__ == "__main__":
    main()
