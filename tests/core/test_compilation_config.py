"""``compilation_config`` (vLLM's ``CompilationConfig``): what it accepts and refuses, the command
line (``--compilation-config`` / ``-cc``), and what the runners capture with it: the CUDA runner
(on the CPU, with its graphs emulated) and the CPU platform's graphs."""

from __future__ import annotations

import argparse

import pytest

from pagedlm.core import LLM, SamplingParams
from pagedlm.core.config import CompilationConfig, VllmConfig
from pagedlm.core.engine.arg_utils import EngineArgs


def test_accepted_forms():
    assert CompilationConfig.from_any(None) == CompilationConfig()
    assert CompilationConfig.from_any(3).level == 3
    config = CompilationConfig.from_any({"cudagraph_mode": "FULL_DECODE_ONLY", "cudagraph_capture_sizes": [8, 1, 4, 4]})
    assert config.cudagraph_mode == "FULL_DECODE_ONLY" and config.cudagraph_capture_sizes == [1, 4, 8]
    assert CompilationConfig.from_any(config) is config
    assert CompilationConfig().cudagraph_num_of_warmups == 0  # vLLM's default
    assert CompilationConfig.from_any({"cudagraph_num_of_warmups": 2}).cudagraph_num_of_warmups == 2


@pytest.mark.parametrize("value, message", [
    ({"cudagraph_mode": "FULLY"}, r"cudagraph_mode='FULLY' is not supported; allowed: NONE, FULL_DECODE_ONLY"),
    ({"cudagraph_capture_sizes": [1, 0]}, r"cudagraph_capture_sizes=\[1, 0\] must be a list of integers >= 1"),
    ({"cudagraph_capture_sizes": 8}, r"cudagraph_capture_sizes=8 must be a list"),
    ({"max_cudagraph_capture_size": True}, r"max_cudagraph_capture_size=True must be an integer >= 1"),
    ({"cudagraph_num_of_warmups": -1}, r"cudagraph_num_of_warmups=-1 must be an integer >= 0"),
    ({"cudagraph_num_of_warmups": 1.5}, r"cudagraph_num_of_warmups=1.5 must be an integer >= 0"),
    ({"level": 4}, r"compilation_config.level=4 must be one of 0, 1, 2, 3"),
    (7, r"compilation_config.level=7"),
    ({"custom_ops": ["all"]}, r"unknown fields \['custom_ops'\]; allowed: \['level'"),
    ("FULL", r"compilation_config='FULL' must be a CompilationConfig"),
])
def test_bad_values_name_the_field(value, message):
    with pytest.raises(ValueError, match=message):
        CompilationConfig.from_any(value)


def test_command_line_and_alias():
    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    args = EngineArgs.from_cli_args(parser.parse_args(
        ["--compilation-config", '{"cudagraph_mode": "NONE", "max_cudagraph_capture_size": 64}']))
    assert args.compilation_config == {"cudagraph_mode": "NONE", "max_cudagraph_capture_size": 64}
    assert EngineArgs.from_cli_args(parser.parse_args(["-cc", "3"])).compilation_config == 3


def test_mode_none_means_enforce_eager():
    config = VllmConfig(compilation_config=CompilationConfig(cudagraph_mode="NONE"))
    config.finalize()
    assert config.enforce_eager


def test_capture_sizes():
    from pagedlm.backends.cuda.model_runner import capture_sizes, default_capture_sizes, default_mixed_capture_sizes

    assert capture_sizes(256, 8192, None, None) == (default_capture_sizes(256), default_mixed_capture_sizes(8192))
    assert capture_sizes(6, 8192, [1, 2, 4, 8, 16], None) == ([1, 2, 4], default_mixed_capture_sizes(8192))
    decode, mixed = capture_sizes(256, 8192, None, 60)
    assert decode == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 60] and mixed == []
    assert capture_sizes(256, 8192, [1, 64, 128], 100) == ([1, 64], [])
    assert capture_sizes(256, 8192, None, 600)[1] == [256, 512]


def runner_of(llm):
    return llm.llm_engine.core.executor.worker.model_runner


def test_cuda_runner_takes_the_sizes(tiny_checkpoint_factory, monkeypatch):
    """The CUDA runner's graph sizes come from the config (on the CPU it captures nothing; the
    GPU test in tests/cuda/test_cuda_e2e.py replays them)."""
    from pagedlm.backends.cpu.platform import CpuPlatform

    monkeypatch.setattr(CpuPlatform, "get_model_runner_cls",
                        lambda self, cfg: "pagedlm.backends.cuda.model_runner:CudaModelRunner")
    llm = LLM(model=tiny_checkpoint_factory("llama"), dtype="float32", device="cpu", max_num_seqs=8,
              compilation_config={"cudagraph_capture_sizes": [1, 2, 4, 16], "max_cudagraph_capture_size": 4})
    try:
        runner = runner_of(llm)
        assert type(runner).__name__ == "CudaModelRunner" and runner.capture_sizes == [1, 2, 4]
        out = llm.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(max_tokens=3, ignore_eos=True),
                           use_tqdm=False)
        assert len(out[0].outputs[0].token_ids) == 3
    finally:
        llm.shutdown()


def test_cpu_graphs_capped_and_mode_none(tiny_checkpoint_factory):
    model = tiny_checkpoint_factory("llama")
    for options, expected in (({"max_cudagraph_capture_size": 2}, 2), ({"cudagraph_mode": "NONE"}, 0)):
        llm = LLM(model=model, dtype="float32", device="cpu", compilation_config=options)
        try:
            assert runner_of(llm).max_graph_batch == expected
        finally:
            llm.shutdown()
