"""``collective_rpc`` / ``apply_model`` on every worker, and the torch profiler behind
``start_profile`` / ``stop_profile`` (``profiler_config``, ``VLLM_TORCH_PROFILER_DIR``)."""

from __future__ import annotations

import glob
import logging
import os
import time

import pytest

from pagedlm.core import LLM, SamplingParams
from pagedlm.core.config import ProfilerConfig

CPU = {"device": "cpu", "kv_cache_memory_bytes": 16 << 20}


def num_params(worker, scale=1):
    """A function of the worker (module-level: worker processes load it by name)."""
    return scale * sum(p.numel() for p in worker.get_model().parameters())


def fails(worker):
    raise KeyError("on purpose")


def slow(worker, seconds):
    time.sleep(seconds)
    return "late"


def _generate(llm, n=1):
    return llm.generate(["hello there"] * n, SamplingParams(max_tokens=4, temperature=0), use_tqdm=False)


def test_collective_rpc_in_process(tiny_llama):
    llm = LLM(model=tiny_llama, **CPU)
    assert llm.collective_rpc("kv_cache_bytes_per_block") == llm.llm_engine.collective_rpc("kv_cache_bytes_per_block")
    expected = sum(p.numel() for p in llm.llm_engine.core.executor.worker.get_model().parameters())
    assert llm.collective_rpc(num_params, kwargs={"scale": 2}) == [2 * expected]
    assert llm.collective_rpc(getattr, args=("rank",)) == [0]
    assert llm.apply_model(lambda model: type(model).__name__) == ["LlamaForCausalLM"]
    with pytest.raises(AttributeError, match="the worker .* has no method 'nope'"):
        llm.collective_rpc("nope")
    with pytest.raises(TypeError, match="method name or a callable"):
        llm.collective_rpc(42)
    _generate(llm)  # the engine goes on


def test_collective_rpc_with_worker_processes(tiny_llama):
    llm = LLM(model=tiny_llama, distributed_executor_backend="mp", **CPU)
    try:
        assert llm.collective_rpc(getattr, args=("rank",)) == [0]
        assert llm.collective_rpc(num_params, args=(3,)) == [3 * llm.collective_rpc(num_params)[0]]
        with pytest.raises(RuntimeError, match=r"collective_rpc\('fails'\) failed on worker rank\(s\) \[0\]: KeyError"):
            llm.collective_rpc(fails)
        with pytest.raises(TimeoutError, match=r"rank\(s\) \[0\] did not answer within 0.2s"):
            llm.collective_rpc(slow, timeout=0.2, args=(1.5,))
        # The late reply is dropped: the next call and the next steps get their own answers.
        assert llm.collective_rpc(getattr, args=("rank",)) == [0]
        assert len(_generate(llm, 2)) == 2
    finally:
        llm.shutdown()


def test_collective_rpc_and_logits_processors_with_tensor_parallelism(tiny_llama):
    from pagedlm.core.testing.logits_processors import DummyLogitsProcessor

    llm = LLM(model=tiny_llama, tensor_parallel_size=2, distributed_executor_backend="mp",
              logits_processors=[DummyLogitsProcessor], **CPU)
    try:
        assert llm.collective_rpc(getattr, args=("rank",)) == [0, 1]
        outs = llm.generate(["hello there", "the cat"], [SamplingParams(max_tokens=4, extra_args={"target_token": 9}),
                                                         SamplingParams(max_tokens=4, temperature=0)], use_tqdm=False)
        assert list(outs[0].outputs[0].token_ids) == [9] * 4
    finally:
        llm.shutdown()


def test_collective_rpc_over_data_parallel_replicas(tiny_llama, tmp_path):
    llm = LLM(model=tiny_llama, data_parallel_size=2, profiler_config={"profiler": "torch",
                                                                       "torch_profiler_dir": str(tmp_path)}, **CPU)
    try:
        assert llm.collective_rpc(getattr, args=("rank",)) == [0, 0]
        llm.start_profile("dp")
        _generate(llm, 4)
        llm.stop_profile()
        names = sorted(os.path.basename(p).split(".")[0] for p in glob.glob(str(tmp_path / "*.pt.trace.json.gz")))
        assert names == ["dp_dp0_pp0_tp0", "dp_dp1_pp0_tp0"]
    finally:
        llm.shutdown()


@pytest.mark.parametrize("backend", ["uni", "mp"])
def test_start_and_stop_profile_write_torch_traces(tiny_llama, tmp_path, backend):
    llm = LLM(model=tiny_llama, distributed_executor_backend=backend,
              profiler_config=ProfilerConfig(profiler="torch", torch_profiler_dir=str(tmp_path / "traces"),
                                             torch_profiler_with_stack=False), **CPU)
    try:
        llm.start_profile(profile_prefix="run1")
        _generate(llm)
        llm.stop_profile()
        traces = glob.glob(str(tmp_path / "traces" / "run1_dp0_pp0_tp0.*.pt.trace.json.gz"))
        assert len(traces) == 1 and os.path.getsize(traces[0]) > 0
        assert "Self CPU" in (tmp_path / "traces" / "profiler_out_0.txt").read_text()
        llm.stop_profile()  # not running: nothing happens, as in vLLM
    finally:
        llm.shutdown()


def test_profiler_stops_itself_after_max_iterations(tiny_llama, tmp_path):
    llm = LLM(model=tiny_llama, profiler_config={"profiler": "torch", "torch_profiler_dir": str(tmp_path),
                                                 "delay_iterations": 1, "max_iterations": 2,
                                                 "torch_profiler_use_gzip": False}, **CPU)
    llm.start_profile()
    assert not glob.glob(str(tmp_path / "*.pt.trace.json"))
    _generate(llm)  # 4 steps: one skipped, two recorded, then the trace is written
    assert len(glob.glob(str(tmp_path / "*.pt.trace.json"))) == 1
    llm.stop_profile()


def test_vllm_torch_profiler_dir_is_honoured(tiny_llama, tmp_path, monkeypatch, caplog):
    from pagedlm.core import envs

    monkeypatch.setattr(envs, "_warned_vllm", set())
    monkeypatch.setenv("VLLM_TORCH_PROFILER_DIR", str(tmp_path))
    monkeypatch.setenv("VLLM_TORCH_PROFILER_WITH_STACK", "0")
    with caplog.at_level(logging.WARNING, logger="pagedlm"):
        llm = LLM(model=tiny_llama, **CPU)
    assert "VLLM_TORCH_PROFILER" not in caplog.text
    config = llm.llm_engine.vllm_config.profiler_config
    assert (config.profiler, config.torch_profiler_dir, config.torch_profiler_with_stack) == ("torch", str(tmp_path),
                                                                                               False)
    llm.start_profile()
    _generate(llm)
    llm.stop_profile()
    assert glob.glob(str(tmp_path / "*.pt.trace.json.gz"))


def test_profiler_config_is_checked(tiny_llama):
    with pytest.raises(RuntimeError, match="profiling is not enabled: pass LLM\\(profiler_config="):
        LLM(model=tiny_llama, **CPU).start_profile()
    with pytest.raises(ValueError, match="'cuda' profiler is not implemented"):
        LLM(model=tiny_llama, profiler_config={"profiler": "cuda"}, **CPU)
    with pytest.raises(ValueError, match="needs torch_profiler_dir"):
        ProfilerConfig(profiler="torch")
    with pytest.raises(ValueError, match=r"unknown fields \['torch_profiler_dri'\]"):
        LLM(model=tiny_llama, profiler_config={"profiler": "torch", "torch_profiler_dri": "x"}, **CPU)
    from pagedlm.core import EngineArgs
    from pagedlm.core.utils import FlexibleArgumentParser

    args = EngineArgs.add_cli_args(FlexibleArgumentParser()).parse_args(
        ["--model", tiny_llama, "--profiler-config", '{"profiler": "torch", "torch_profiler_dir": "/tmp/t"}'])
    config = EngineArgs.from_cli_args(args).create_vllm_config().profiler_config
    assert (config.profiler, config.torch_profiler_dir) == ("torch", "/tmp/t")
