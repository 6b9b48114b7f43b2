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
