"""vLLM-style user scripts with the import swapped (``vllm`` -> ``pagedlm.core``), on the tiny
checkpoints: each checks one name of docs/vllm-compat.md behaves as vLLM documents it."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import textwrap

import pytest


def run_script(source: str, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    import os

    return subprocess.run([sys.executable, "-c", textwrap.dedent(source), *args], capture_output=True, text=True,
                          timeout=300, env={**os.environ, **(env or {})})


def test_cli_script_with_flexible_parser_and_engine_args(tiny_llama, tmp_path):
    """vLLM's examples build their command line like this (FlexibleArgumentParser,
    ``parser = EngineArgs.add_cli_args(parser)``, underscores in flags, ``--config``)."""
    config = tmp_path / "engine.yaml"
    config.write_text("max_model_len: 128\nenable_prefix_caching: false\n")
    script = """
        from pagedlm.core import LLM, EngineArgs, SamplingParams
        from pagedlm.core.utils import FlexibleArgumentParser

        parser = FlexibleArgumentParser()
        parser = EngineArgs.add_cli_args(parser)
        parser.add_argument("--max_tokens", type=int, default=4)
        args = vars(parser.parse_args())
        max_tokens = args.pop("max_tokens")
        llm = LLM(**args)
        cfg = llm.llm_engine.vllm_config
        print(cfg.max_model_len, cfg.cache_config.enable_prefix_caching, cfg.model_config.dtype)
        out = llm.generate(["Hello"], SamplingParams(max_tokens=max_tokens, temperature=0), use_tqdm=False)
        print(len(out[0].outputs[0].token_ids))
    """
    proc = run_script(script, "--model", tiny_llama, "--config", str(config), "--max_tokens", "3",
                      "--dtype=float32", "--device", "cpu")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split() == ["128", "False", "torch.float32", "3"], proc.stdout


def test_async_engine_args_and_vllm_options(tiny_llama):
    from pagedlm.core.engine.arg_utils import AsyncEngineArgs, EngineArgs

    args = AsyncEngineArgs(model=tiny_llama, tokenizer_mode="auto", config_format="hf")
    assert isinstance(args, EngineArgs) and args.create_vllm_config().model_config.model == tiny_llama
    with pytest.raises(ValueError, match="tokenizer_mode='mistral' is not supported; allowed: auto, hf"):
        EngineArgs(model=tiny_llama, tokenizer_mode="mistral").create_vllm_config()
    with pytest.raises(ValueError, match="config_format='mistral'"):
        EngineArgs(model=tiny_llama, config_format="mistral").create_vllm_config()


def test_default_sampling_params_and_prefix_cache_reset(tiny_checkpoint_factory, tmp_path):
    import shutil

    from pagedlm.core import LLM, SamplingParams

    model = tmp_path / "with-generation-config"
    shutil.copytree(tiny_checkpoint_factory("qwen3"), model)
    gen = json.loads((model / "generation_config.json").read_text())
    gen.update(temperature=0.6, top_p=0.95, top_k=20, max_new_tokens=7)
    (model / "generation_config.json").write_text(json.dumps(gen))
    llm = LLM(model=str(model), dtype="float32", device="cpu", kv_cache_memory_bytes=16 << 20)
    params = llm.get_default_sampling_params()
    assert (params.temperature, params.top_p, params.top_k, params.max_tokens) == (0.6, 0.95, 20, 7)
    llm.generate(["a shared prefix of some length"] * 2, SamplingParams(max_tokens=2), use_tqdm=False)
    core = llm.llm_engine.core
    assert core.scheduler.kv_cache_manager.num_cached_free_blocks > 0
    assert llm.reset_prefix_cache() is True and llm.llm_engine.reset_prefix_cache() is True
    assert core.scheduler.kv_cache_manager.num_cached_free_blocks == 0


def test_current_platform_and_cleanup(tiny_llama):
    from pagedlm.core import LLM
    from pagedlm.core.distributed import cleanup_dist_env_and_memory
    from pagedlm.core.platforms import current_platform

    assert current_platform.device_name in ("cpu", "cuda")
    llm = LLM(model=tiny_llama, device="cpu", kv_cache_memory_bytes=16 << 20)
    llm.shutdown()
    del llm
    cleanup_dist_env_and_memory()
    LLM(model=tiny_llama, device="cpu", kv_cache_memory_bytes=16 << 20)  # a second engine starts cleanly


def test_vllm_environment_variables_are_never_silently_ignored(tiny_llama, monkeypatch, caplog):
    from pagedlm.core import envs
    from pagedlm.core.engine.arg_utils import EngineArgs

    monkeypatch.setattr(envs, "_warned_vllm", set())
    monkeypatch.setenv("VLLM_LOGGING_LEVEL", "DEBUG")
    monkeypatch.setenv("VLLM_USE_V1", "1")
    with caplog.at_level(logging.WARNING, logger="pagedlm"):
        EngineArgs(model=tiny_llama).create_vllm_config()
    text = caplog.text
    assert "VLLM_LOGGING_LEVEL is not read by pagedlm; pagedlm's equivalent is PAGEDLM_LOGGING_LEVEL" in text
    assert "VLLM_USE_V1 is not read by pagedlm" in text
    monkeypatch.setenv("VLLM_BATCH_INVARIANT", "1")
    with pytest.raises(ValueError, match="VLLM_BATCH_INVARIANT is set, but pagedlm has no batch-invariant mode"):
        EngineArgs(model=tiny_llama).create_vllm_config()


def test_get_metrics_with_vllm_reader_types(tiny_llama):
    """vLLM's metrics example: LLM(disable_log_stats=False) ... for metric in llm.get_metrics()."""
    from pagedlm.core import LLM, SamplingParams
    from pagedlm.core.v1.metrics.reader import Counter, Gauge, Histogram, Vector  # noqa: F401 - vLLM's imports

    llm = LLM(model=tiny_llama, device="cpu", disable_log_stats=False, kv_cache_memory_bytes=16 << 20)
    llm.generate(["one", "two", "three"], SamplingParams(max_tokens=5, ignore_eos=True), use_tqdm=False)
    metrics = {(m.name, m.labels.get("finished_reason")): m for m in llm.get_metrics()}
    assert metrics[("pagedlm:generation_tokens", None)].value == 15
    assert metrics[("pagedlm:request_success", "length")].value == 3
    assert isinstance(metrics[("pagedlm:num_requests_running", None)], Gauge)
    assert metrics[("pagedlm:num_requests_running", None)].value == 0.0
    ttft = metrics[("pagedlm:time_to_first_token_seconds", None)]
    assert isinstance(ttft, Histogram) and ttft.count == 3 and ttft.buckets["+Inf"] == 3 and ttft.sum > 0
    with pytest.raises(ValueError, match="disable_log_stats=False"):
        LLM(model=tiny_llama, device="cpu", kv_cache_memory_bytes=16 << 20).get_metrics()


def test_hf_overrides_dict_callable_and_cli(tiny_llama, tiny_checkpoint_factory):
    from pagedlm.core import LLM, EngineArgs
    from pagedlm.core.utils import FlexibleArgumentParser

    llm = LLM(model=tiny_llama, device="cpu", hf_overrides={"max_position_embeddings": 64},
              kv_cache_memory_bytes=16 << 20)
    assert llm.llm_engine.vllm_config.model_config.max_model_len == 64

    def shorter_context(config):
        config.max_position_embeddings = 32
        return config

    llm = LLM(model=tiny_llama, device="cpu", hf_overrides=shorter_context, kv_cache_memory_bytes=16 << 20)
    assert llm.llm_engine.vllm_config.model_config.max_model_len == 32
    gemma = tiny_checkpoint_factory("gemma3")
    args = EngineArgs.add_cli_args(FlexibleArgumentParser()).parse_args(
        ["--model", gemma, "--hf_overrides", '{"sliding_window": 4}'])
    config = EngineArgs.from_cli_args(args).create_vllm_config()
    assert config.model_config.hf_config.sliding_window == 4


def test_enable_expert_parallel_is_vllms_option(tiny_checkpoint_factory):
    """``LLM(enable_expert_parallel=True)`` is accepted as vLLM's (and is a no-op on one rank, as
    there); tests/distributed/test_dist_moe.py runs it across ranks."""
    from pagedlm.core import LLM, SamplingParams

    llm = LLM(model=tiny_checkpoint_factory("mixtral"), dtype="float32", device="cpu", enable_expert_parallel=True)
    assert llm.llm_engine.vllm_config.parallel_config.enable_expert_parallel is True
    moe = llm.llm_engine.core.executor.worker.model_runner.model.model.layers[0].block_sparse_moe.experts
    assert (moe.ep_size, moe.local_num_experts) == (1, moe.global_num_experts)
    out = llm.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(max_tokens=3, temperature=0), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 3


def test_custom_logits_processor_script(tiny_llama):
    """vLLM's examples/offline_inference/logits_processor/custom.py and custom_req.py, import swapped."""
    script = """
        import sys
        import torch
        from pagedlm.core import LLM, SamplingParams
        from pagedlm.core.config import VllmConfig
        from pagedlm.core.v1.sample.logits_processor import (AdapterLogitsProcessor, BatchUpdate, LogitsProcessor,
                                                            MoveDirectionality, RequestLogitsProcessor)

        class DummyLogitsProcessor(LogitsProcessor):
            def __init__(self, vllm_config: VllmConfig, device: torch.device, is_pin_memory: bool):
                self.req_info: dict[int, int] = {}

            def is_argmax_invariant(self) -> bool:
                return False

            def update_state(self, batch_update: BatchUpdate | None):
                if not batch_update:
                    return
                for index, params, _, _ in batch_update.added:
                    if params.extra_args and (target_token := params.extra_args.get("target_token")):
                        self.req_info[index] = target_token
                    else:
                        self.req_info.pop(index, None)
                if self.req_info:
                    for index in batch_update.removed:
                        self.req_info.pop(index, None)
                    for adx, bdx, direct in batch_update.moved:
                        a_val = self.req_info.pop(adx, None)
                        b_val = self.req_info.pop(bdx, None)
                        if a_val is not None:
                            self.req_info[bdx] = a_val
                        if direct == MoveDirectionality.SWAP and b_val is not None:
                            self.req_info[adx] = b_val

            def apply(self, logits: torch.Tensor) -> torch.Tensor:
                if not self.req_info:
                    return logits
                cols = torch.tensor(list(self.req_info.values()), dtype=torch.long, device=logits.device)
                rows = torch.tensor(list(self.req_info.keys()), dtype=torch.long, device=logits.device)
                values_to_keep = logits[rows, cols].clone()
                logits[rows] = float("-inf")
                logits[rows, cols] = values_to_keep
                return logits

        class DummyPerReqLogitsProcessor:
            def __init__(self, target_token: int) -> None:
                self.target_token = target_token

            def __call__(self, output_ids: list[int], logits: torch.Tensor) -> torch.Tensor:
                val_to_keep = logits[self.target_token].item()
                logits[:] = float("-inf")
                logits[self.target_token] = val_to_keep
                return logits

        class WrappedPerReqLogitsProcessor(AdapterLogitsProcessor):
            def is_argmax_invariant(self) -> bool:
                return False

            def new_req_logits_processor(self, params: SamplingParams) -> RequestLogitsProcessor | None:
                if not params.extra_args or "target_token" not in params.extra_args:
                    return None
                return DummyPerReqLogitsProcessor(params.extra_args["target_token"])

        prompts = ["Hello, my name is", "The president of the United States is", "The capital of France is",
                   "The future of AI is"]
        sampling_params_list = [
            SamplingParams(temperature=0.0, max_tokens=6, extra_args={"target_token": 128}),
            SamplingParams(temperature=0.0, max_tokens=6),
            SamplingParams(temperature=0.0, max_tokens=6, extra_args={"target_token": 67}),
            SamplingParams(temperature=0.0, max_tokens=6),
        ]
        plain = [o.outputs[0].token_ids for o in LLM(model=sys.argv[1], device="cpu").generate(
            prompts, sampling_params_list, use_tqdm=False)]
        for cls in (DummyLogitsProcessor, WrappedPerReqLogitsProcessor):
            llm = LLM(model=sys.argv[1], device="cpu", logits_processors=[cls])
            outs = [o.outputs[0].token_ids for o in llm.generate(prompts, sampling_params_list, use_tqdm=False)]
            assert outs[0] == [128] * 6 and outs[2] == [67] * 6, outs
            assert outs[1] == plain[1] and outs[3] == plain[3]
        print("ok")
    """
    proc = run_script(script, tiny_llama)
    assert proc.returncode == 0 and proc.stdout.split() == ["ok"], proc.stderr[-3000:]


def test_profiling_and_collective_rpc_script(tiny_llama, tmp_path):
    """vLLM's simple_profiling.py (profiler_config, start_profile/stop_profile), the older
    VLLM_TORCH_PROFILER_DIR way, and collective_rpc with a method name and a function."""
    script = """
        import glob, os, sys
        from pagedlm.core import LLM, SamplingParams
        from pagedlm.core.config import ProfilerConfig

        def get_rank_and_device(worker):
            return worker.rank, str(worker.device)

        out_dir = sys.argv[2]
        llm = LLM(model=sys.argv[1], device="cpu",
                  profiler_config={"profiler": "torch", "torch_profiler_dir": os.path.join(out_dir, "a")})
        llm.start_profile()
        llm.generate(["Hello, my name is"], SamplingParams(max_tokens=4), use_tqdm=False)
        llm.stop_profile()
        print(len(glob.glob(os.path.join(out_dir, "a", "*.pt.trace.json.gz"))))
        print(llm.collective_rpc(get_rank_and_device), len(llm.collective_rpc("get_kv_cache_specs")))
        os.environ["VLLM_TORCH_PROFILER_DIR"] = os.path.join(out_dir, "b")
        llm = LLM(model=sys.argv[1], device="cpu")
        llm.start_profile()
        llm.generate(["Hello"], SamplingParams(max_tokens=2), use_tqdm=False)
        llm.stop_profile()
        print(len(glob.glob(os.path.join(out_dir, "b", "*.pt.trace.json.gz"))), isinstance(
            llm.llm_engine.vllm_config.profiler_config, ProfilerConfig))
    """
    proc = run_script(script, tiny_llama, str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.splitlines()[-3:] == ["1", "[(0, 'cpu')] 1", "1 True"], proc.stdout
    assert "VLLM_TORCH_PROFILER_DIR is not read" not in proc.stderr


def test_prompt_embeds_script(tiny_llama):
    """vLLM's prompt_embed_inference.py: embeddings from the HF model's input embeddings."""
    script = """
        import sys
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer
        from pagedlm.core import LLM, SamplingParams

        tokenizer = AutoTokenizer.from_pretrained(sys.argv[1])
        embedding_layer = AutoModelForCausalLM.from_pretrained(sys.argv[1]).get_input_embeddings()
        llm = LLM(model=sys.argv[1], device="cpu", dtype="float32", enable_prompt_embeds=True)
        token_ids = tokenizer("Please tell me about the capital of France.", return_tensors="pt").input_ids
        with torch.no_grad():
            prompt_embeds = embedding_layer(token_ids).squeeze(0)
        params = SamplingParams(temperature=0, max_tokens=8)
        by_embeds = llm.generate({"prompt_embeds": prompt_embeds}, params, use_tqdm=False)[0].outputs[0]
        by_ids = llm.generate({"prompt_token_ids": token_ids[0].tolist()}, params, use_tqdm=False)[0].outputs[0]
        assert by_embeds.token_ids == by_ids.token_ids and by_embeds.text == by_ids.text
        print("ok")
    """
    proc = run_script(script, tiny_llama)
    assert proc.returncode == 0 and proc.stdout.split() == ["ok"], proc.stderr[-3000:]


def test_async_llm_pause_resume_script(tiny_llama):
    """The RL weight-update pattern: pause (abort in flight), update, resume."""
    script = """
        import asyncio, sys
        from pagedlm.core import SamplingParams
        from pagedlm.core.engine.arg_utils import AsyncEngineArgs
        from pagedlm.core.engine.async_llm import AsyncLLM

        async def main():
            engine = AsyncLLM.from_engine_args(AsyncEngineArgs(model=sys.argv[1], device="cpu"))
            params = SamplingParams(max_tokens=400, ignore_eos=True)
            started = asyncio.Event()

            async def run(request_id):
                last = None
                async for out in engine.generate("Hello", params, request_id):
                    last = out
                    started.set()
                return last.outputs[0].finish_reason

            task = asyncio.create_task(run("r1"))
            await started.wait()
            await engine.pause_generation(mode="abort", clear_cache=True)
            print(await task, await engine.is_paused())
            await engine.resume_generation()
            print(await run("r2"), await engine.is_paused())
            engine.shutdown()

        asyncio.run(main())
    """
    proc = run_script(script, tiny_llama)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.splitlines()[-2:] == ["abort True", "length False"], proc.stdout


def test_structured_outputs_and_chat_tools_script(tiny_llama):
    from pagedlm.core import LLM, SamplingParams
    from pagedlm.core.sampling_params import StructuredOutputsParams

    llm = LLM(model=tiny_llama, dtype="float32", device="cpu", max_model_len=256,
              structured_outputs_config={"backend": "xgrammar"})
    choice = SamplingParams(structured_outputs=StructuredOutputsParams(choice=["Positive", "Negative"]), max_tokens=8)
    assert llm.generate("Classify: great!", choice, use_tqdm=False)[0].outputs[0].text in ("Positive", "Negative")
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    template = ("{% for t in tools %}[tool {{ t.function.name }}]{% endfor %}"
                "{% for m in messages %}{{ m.content }}{% endfor %}")
    out = llm.chat([{"role": "user", "content": "hi"}], SamplingParams(max_tokens=2), chat_template=template,
                   tools=tools, use_tqdm=False)[0]
    assert out.prompt.startswith("[tool get_weather]hi")
