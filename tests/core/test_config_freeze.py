"""The config is finalized once, in the front end, and frozen: no process changes it afterwards."""

from __future__ import annotations

import copy
import dataclasses
import pickle

import pytest

from pagedlm.core.config import DeviceConfig, ParallelConfig, SchedulerConfig, VllmConfig


def _final() -> VllmConfig:
    config = VllmConfig(device_config=DeviceConfig(device="cpu"))
    config.finalize()
    return config


def test_finalize_resolves_then_freezes_every_part():
    config = _final()
    assert config.frozen and config.scheduler_config.frozen and config.cache_config.frozen
    assert config.scheduler_config.max_num_batched_tokens is not None  # resolved before freezing
    with pytest.raises(dataclasses.FrozenInstanceError, match=r"SchedulerConfig\.max_num_seqs.*finalize\(\)"):
        config.scheduler_config.max_num_seqs = 3
    with pytest.raises(dataclasses.FrozenInstanceError, match=r"VllmConfig\.usage_context"):
        config.usage_context = "server"
    config.finalize()  # final already: nothing to do, nothing raises


def test_copies_and_pickles_stay_frozen():
    config = _final()
    for other in (copy.deepcopy(config), pickle.loads(pickle.dumps(config))):
        assert other.frozen and other.parallel_config.frozen
        with pytest.raises(dataclasses.FrozenInstanceError):
            other.parallel_config.data_parallel_rank = 1


def test_unfinalized_configs_stay_writable():
    config = SchedulerConfig()
    config.max_num_seqs = 3
    assert not config.frozen


def test_data_parallel_replicas_get_their_rank_in_a_frozen_copy():
    config = VllmConfig(parallel_config=ParallelConfig(data_parallel_size=2), device_config=DeviceConfig(device="cpu"))
    config.finalize()
    replica = config.for_data_parallel_rank(1)
    assert replica.frozen and replica.parallel_config.frozen
    assert replica.parallel_config.data_parallel_rank == 1 and config.parallel_config.data_parallel_rank == 0
    assert replica.model_config is config.model_config


def test_the_engine_core_runs_on_the_front_ends_final_config(tiny_llama):
    from pagedlm.core import LLM
    from pagedlm.core.engine.core import EngineCore

    llm = LLM(model=tiny_llama, dtype="float32", device="cpu", num_gpu_blocks_override=40)
    assert llm.vllm_config.frozen
    assert llm.llm_engine.core.vllm_config is llm.vllm_config
    assert llm.llm_engine.num_gpu_blocks == 40
    with pytest.raises(ValueError, match=r"call vllm_config\.finalize\(\) in the front end"):
        EngineCore(VllmConfig())
