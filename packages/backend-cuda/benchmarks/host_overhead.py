"""The engine's host-side cost per step, with the model and the sampler stubbed out.

Runs the nano workload (256 requests, 1,041 steps) through ``LLM.generate`` on the CPU with a
one-layer model whose forward returns zeros and whose sampler draws random ids, so what is
timed is the Python around the model: scheduling, KV-cache bookkeeping, input preparation and
output processing. Compare its per-step time with a GPU run's to see how much of a step the host
needs on that machine:

    python3 packages/backend-cuda/benchmarks/host_overhead.py [--async-scheduling] [--repeat 3]
        [--breakdown] [--detokenize] [--stream] [--stream-interval N] [--cpu-time] [--profile 30]

``--breakdown`` times the engine's parts per step (scheduler, its update, the output processor,
the runner's input preparation, ...); the timers add a few microseconds per call. ``--detokenize``
gives the model a trained BPE tokenizer (the stub then samples ids of learned tokens), so the
output processor detokenizes as it would for text prompts; ``--stream`` makes every request
stream DELTA outputs (what the server asks for) instead of ``LLM.generate``'s finished outputs
only, and ``--stream-interval N`` sets the engine's ``stream_interval``. ``--cpu-time`` measures
the thread's CPU time instead of the wall clock (steadier on a shared machine). ``--profile N``
prints cProfile's N most expensive functions (by own time) of the last run.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import tempfile
import time
from collections import defaultdict

import torch

NUM_STEPS = 1041  # of the nano workload, with the default scheduler settings

#: (label, "module:Class.method") of every timed part; a part nested in another is subtracted
#: from it in the report ("runner: rest" is execute_model minus its timed parts)
PARTS = [
    ("engine step (all)", "pagedlm.core.engine.llm_engine:LLMEngine.step"),
    ("scheduler.schedule", "pagedlm.core.sched.scheduler:Scheduler.schedule"),
    ("scheduler.update_from_output", "pagedlm.core.sched.scheduler:Scheduler.update_from_output"),
    ("output processor", "pagedlm.core.engine.output_processor:OutputProcessor.process_outputs"),
    ("runner: execute_model (all)", "pagedlm.core.worker.model_runner:ModelRunner.execute_model"),
    ("runner: InputBatch.update", "pagedlm.core.worker.input_batch:InputBatch.update"),
    ("runner: InputBatch.prepare", "pagedlm.core.worker.input_batch:InputBatch.prepare"),
    ("runner: sampling metadata", "pagedlm.core.worker.model_runner:ModelRunner._sampling_metadata"),
    ("runner: result()", "pagedlm.core.worker.model_runner:AsyncModelRunnerOutput.result"),
]
_RUNNER_INNER = ("runner: InputBatch.update", "runner: InputBatch.prepare", "runner: sampling metadata")


class Timers:
    """Accumulated wall time per wrapped method."""

    def __init__(self, clock=time.perf_counter) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self.clock = clock

    def wrap(self, label: str, target: str) -> None:
        import importlib

        module_name, qualname = target.split(":")
        cls_name, method_name = qualname.split(".")
        cls = getattr(importlib.import_module(module_name), cls_name)
        inner = getattr(cls, method_name)
        seconds, calls, clock = self.seconds, self.calls, self.clock

        def timed(*args, **kwargs):
            start = clock()
            try:
                return inner(*args, **kwargs)
            finally:
                seconds[label] += clock() - start
                calls[label] += 1

        setattr(cls, method_name, timed)

    def reset(self) -> None:
        self.seconds.clear()
        self.calls.clear()

    def report(self, num_steps: int, elapsed: float, *, result_in_runner: bool) -> None:
        """``result_in_runner``: synchronous steps take the result inside execute_model."""
        ms = {label: self.seconds.get(label, 0.0) / num_steps * 1e3 for label, _ in PARTS}
        inner = [*_RUNNER_INNER, "runner: result()"] if result_in_runner else list(_RUNNER_INNER)
        runner_rest = ms["runner: execute_model (all)"] - sum(ms[label] for label in inner)
        step = ms["engine step (all)"]
        outer = ["output processor", "scheduler.schedule", "scheduler.update_from_output",
                 "runner: execute_model (all)"] + ([] if result_in_runner else ["runner: result()"])
        total = elapsed / num_steps * 1e3
        print(f"  {'part':<34} {'ms/step':>8}")
        for label, _ in PARTS:
            print(f"  {label:<34} {ms[label]:8.3f}")
        print(f"  {'runner: rest (stubs, sampling)':<34} {runner_rest:8.3f}")
        print(f"  {'engine step: untimed rest':<34} {step - sum(ms[label] for label in outer):8.3f}")
        print(f"  {'outside engine.step (LLM loop)':<34} {total - step:8.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--async-scheduling", action="store_true")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--breakdown", action="store_true", help="time the engine's parts per step")
    parser.add_argument("--detokenize", action="store_true", help="a real tokenizer: detokenize the outputs")
    parser.add_argument("--stream", action="store_true", help="every request streams DELTA outputs")
    parser.add_argument("--stream-interval", type=int, default=1, help="EngineArgs.stream_interval")
    parser.add_argument("--cpu-time", action="store_true",
                        help="time with the thread's CPU time instead of the wall clock (a busy machine)")
    parser.add_argument("--profile", type=int, default=0, metavar="N",
                        help="print cProfile's N most expensive functions of the last run")
    args = parser.parse_args()

    from pagedlm.core import LLM
    from pagedlm.core.bench.workloads import nano_workload
    from pagedlm.core.layers.causal_lm import CausalLM
    from pagedlm.core.sample import sampler
    from pagedlm.core.sampling_params import RequestOutputKind
    from pagedlm.core.testing.checkpoints import make_dummy_config_dir
    from pagedlm.core.worker.model_runner import ModelRunner

    # ids the stub samples: with a tokenizer, its learned tokens (not the reserved fillers)
    low, high = (9, 1400) if args.detokenize else (0, 10000)

    def run_model(self, step):
        return torch.zeros(len(step.input_ids), 8)

    def sample(self, logits, metadata):
        return sampler.SamplerOutput(torch.randint(low, high, (logits.shape[0],)), None)

    ModelRunner.run_model = run_model
    CausalLM.compute_logits = lambda self, hidden: torch.zeros(hidden.shape[0], 8)
    sampler.Sampler.__call__ = sample

    clock = time.thread_time if args.cpu_time else time.perf_counter
    timers = Timers(clock)
    if args.breakdown:
        for label, target in PARTS:
            timers.wrap(label, target)

    with tempfile.TemporaryDirectory() as model_dir:
        make_dummy_config_dir(model_dir, "qwen3", vocab_size=10240, hidden_size=32, num_layers=1, num_heads=2,
                              num_kv_heads=1, intermediate_size=32, max_position_embeddings=4096)
        if args.detokenize:
            from pagedlm.core.testing.tokenizer import build_bpe_tokenizer

            build_bpe_tokenizer(model_dir, vocab_size=10240)
        extra = {"stream_interval": args.stream_interval} if args.stream_interval != 1 else {}
        llm = LLM(model=model_dir, load_format="dummy", skip_tokenizer_init=not args.detokenize, max_model_len=2048,
                  device="cpu", async_scheduling=args.async_scheduling, **extra)
        workload = nano_workload(vocab_size=10240)
        prompts = [{"prompt_token_ids": p} for p in workload.prompts]
        engine = llm.llm_engine
        for i in range(args.repeat):
            timers.reset()
            profiler = cProfile.Profile() if args.profile and i == args.repeat - 1 else None
            start = clock()
            if profiler is not None:
                profiler.enable()
            num_outputs = 0
            if args.stream:
                for n, (prompt, params) in enumerate(zip(prompts, workload.sampling_params())):
                    params.output_kind = RequestOutputKind.DELTA
                    engine.add_request(f"{i}-{n}", prompt, params)
                while engine.has_unfinished_requests():
                    num_outputs += len(engine.step())
            else:
                llm.generate(prompts, workload.sampling_params(), use_tqdm=False)
            elapsed = clock() - start
            if profiler is not None:
                profiler.disable()
            steps = engine.core.scheduler.make_stats().step
            streamed = f", {num_outputs} streamed outputs" if args.stream else ""
            print(f"host overhead: {elapsed:.2f} s for the nano workload, {elapsed / NUM_STEPS * 1e3:.2f} ms per step"
                  f" (engine step counter {steps}{streamed})")
            if args.breakdown:
                timers.report(NUM_STEPS, elapsed, result_in_runner=not args.async_scheduling)
            if profiler is not None:
                pstats.Stats(profiler).sort_stats("tottime").print_stats(args.profile)


if __name__ == "__main__":
    main()
