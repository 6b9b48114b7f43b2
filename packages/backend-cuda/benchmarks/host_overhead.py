"""The engine's host-side cost per step, with the model and the sampler stubbed out.

Runs the nano workload (256 requests, 1,041 steps) through ``LLM.generate`` on the CPU with a
one-layer model whose forward returns zeros and whose sampler draws random ids, so what is
timed is the Python around the model: scheduling, KV-cache bookkeeping, input preparation and
output processing. Compare its per-step time with a GPU run's to see how much of a step the host
needs on that machine:

    python3 packages/backend-cuda/benchmarks/host_overhead.py [--async-scheduling] [--repeat 3]
"""

from __future__ import annotations

import argparse
import tempfile
import time

import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--async-scheduling", action="store_true")
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()

    from pagedlm.core import LLM
    from pagedlm.core.bench.workloads import nano_workload
    from pagedlm.core.layers.causal_lm import CausalLM
    from pagedlm.core.sample import sampler
    from pagedlm.core.testing.checkpoints import make_dummy_config_dir
    from pagedlm.core.worker.model_runner import ModelRunner

    def run_model(self, step):
        return torch.zeros(len(step.input_ids), 8)

    def sample(self, logits, metadata):
        return sampler.SamplerOutput(torch.randint(0, 10000, (logits.shape[0],)), None)

    ModelRunner.run_model = run_model
    CausalLM.compute_logits = lambda self, hidden: torch.zeros(hidden.shape[0], 8)
    sampler.Sampler.__call__ = sample

    with tempfile.TemporaryDirectory() as model_dir:
        make_dummy_config_dir(model_dir, "qwen3", vocab_size=10240, hidden_size=32, num_layers=1, num_heads=2,
                              num_kv_heads=1, intermediate_size=32, max_position_embeddings=4096)
        llm = LLM(model=model_dir, load_format="dummy", skip_tokenizer_init=True, max_model_len=2048,
                  device="cpu", async_scheduling=args.async_scheduling)
        workload = nano_workload(vocab_size=10240)
        prompts = [{"prompt_token_ids": p} for p in workload.prompts]
        for _ in range(args.repeat):
            start = time.perf_counter()
            llm.generate(prompts, workload.sampling_params(), use_tqdm=False)
            elapsed = time.perf_counter() - start
            steps = llm.llm_engine.core.scheduler.make_stats().step
            print(f"host overhead: {elapsed:.2f} s for the nano workload, {elapsed / 1041 * 1e3:.2f} ms per step"
                  f" (engine step counter {steps})")


if __name__ == "__main__":
    main()
