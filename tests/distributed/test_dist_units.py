"""Fast, single-process checks of the distributed pieces: rank layout, stage split, the shared-
memory broadcast, per-rank weight reading, stage-only model building, config and CLI flags."""

from __future__ import annotations

import argparse
import multiprocessing
import threading

import pytest
import torch

from pagedlm.core.config import LoadConfig, ModelConfig, ParallelConfig, VllmConfig
from pagedlm.core.distributed import (
    init_model_parallel,
    output_rank,
    pp_group_ranks,
    tp_group_ranks,
)
from pagedlm.core.distributed.shm_broadcast import ShmBroadcast
from pagedlm.core.layers import PPMissingLayer, pp_layer_range
from pagedlm.core.model_loader import load_model
from pagedlm.core.model_loader.weight_utils import LazyWeight


def test_rank_layout_puts_tp_groups_on_consecutive_ranks():
    assert list(tp_group_ranks(2, 2)) == [[0, 1], [2, 3]]
    assert list(pp_group_ranks(2, 2)) == [[0, 2], [1, 3]]
    assert output_rank(2, 2) == 2 and output_rank(4, 1) == 0 and output_rank(1, 3) == 2


def test_pp_layer_range_splits_evenly_and_refuses_empty_stages():
    assert [pp_layer_range(5, r, 2) for r in range(2)] == [(0, 3), (3, 5)]
    assert [pp_layer_range(4, r, 4) for r in range(4)] == [(0, 1), (1, 2), (2, 3), (3, 4)]
    with pytest.raises(ValueError, match="pipeline_parallel_size=3 exceeds the model's 2 layers"):
        pp_layer_range(2, 0, 3)


def test_shm_broadcast_delivers_in_order_to_every_reader_including_multi_slot_messages():
    ctx = multiprocessing.get_context("spawn")
    ring = ShmBroadcast(ctx, num_readers=3, num_slots=2, slot_bytes=128)
    messages = [{"step": i, "ids": list(range(i * 50))} for i in range(12)]  # up to ~10 slots each
    got: list[list] = [[] for _ in range(3)]

    def read(i: int) -> None:
        reader = ring.reader(i)
        for _ in messages:
            ok, msg = reader.dequeue(timeout=10)
            assert ok
            got[i].append(msg)

    threads = [threading.Thread(target=read, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for m in messages:
        ring.enqueue(m)
    for t in threads:
        t.join(20)
    assert got == [messages] * 3


def test_parallel_config_defaults_and_validation():
    assert ParallelConfig().distributed_executor_backend == "uni"
    assert ParallelConfig(tensor_parallel_size=2).distributed_executor_backend == "mp"
    assert ParallelConfig(pipeline_parallel_size=2, tensor_parallel_size=2).world_size == 4
    assert ParallelConfig(data_parallel_size=2).world_size == 1
    with pytest.raises(ValueError, match="'uni' runs one rank"):
        ParallelConfig(tensor_parallel_size=2, distributed_executor_backend="uni")
    with pytest.raises(ValueError, match="must be one of uni, mp, ray"):
        ParallelConfig(distributed_executor_backend="slurm")  # type: ignore[arg-type]


def test_cli_accepts_the_parallel_options():
    from pagedlm.core.engine.arg_utils import EngineArgs

    parser = argparse.ArgumentParser()
    EngineArgs.add_cli_args(parser)
    args = parser.parse_args(["--tensor-parallel-size", "2", "--pipeline-parallel-size", "2",
                              "--data-parallel-size", "3", "--distributed-executor-backend", "ray"])
    pc = EngineArgs.from_cli_args(args).create_vllm_config().parallel_config
    assert (pc.tensor_parallel_size, pc.pipeline_parallel_size, pc.data_parallel_size) == (2, 2, 3)
    assert pc.distributed_executor_backend == "ray"


# -- loading a rank's share ------------------------------------------------------------------------


def _backend():
    pytest.importorskip("pagedlm.backends.cpu.attention")
    from pagedlm.core.plugins import get_plugins, resolve_class_path

    return resolve_class_path(get_plugins().attention_backends()["cpu_paged"])


def _config(path: str, **parallel) -> VllmConfig:
    return VllmConfig(
        model_config=ModelConfig(model=path, dtype=torch.float32, skip_tokenizer_init=True),
        load_config=LoadConfig(load_format="auto"),
        parallel_config=ParallelConfig(**parallel),
    )


@pytest.fixture
def fake_rank():
    """Install TP/PP coordinates without process groups: building and loading use no collective."""
    yield init_model_parallel
    init_model_parallel(0, 1, None)


def _checkpoint_bytes(path: str) -> int:
    from safetensors import safe_open

    total = 0
    with safe_open(f"{path}/model.safetensors", framework="pt") as f:
        for name in f.keys():  # noqa: SIM118
            t = f.get_slice(name)
            total += int(torch.Size(t.get_shape()).numel()) * 4
    return total


def test_tp_rank_reads_only_its_slices(tiny_llama, fake_rank):
    backend = _backend()
    full, _ = load_model(_config(tiny_llama), backend, "cpu")
    full_params = dict(full.named_parameters())
    fake_rank(1, 2, None)
    before = LazyWeight.bytes_read
    shard, _ = load_model(_config(tiny_llama, tensor_parallel_size=2), backend, "cpu")
    read = LazyWeight.bytes_read - before
    # Everything but the (tiny) norm weights is sharded: rank 1 reads about half the checkpoint.
    assert read < 0.55 * _checkpoint_bytes(tiny_llama), (read, _checkpoint_bytes(tiny_llama))
    params = dict(shard.named_parameters())
    down = full_params["model.layers.0.mlp.down_proj.weight"]
    assert torch.equal(params["model.layers.0.mlp.down_proj.weight"], down[:, down.shape[1] // 2 :])
    up = full_params["model.layers.1.mlp.gate_up_proj.weight"]
    inter = up.shape[0] // 2
    assert torch.equal(params["model.layers.1.mlp.gate_up_proj.weight"],
                       torch.cat([up[inter // 2 : inter], up[inter + inter // 2 :]]))
    emb = full_params["model.embed_tokens.weight"]
    assert torch.equal(params["model.embed_tokens.weight"], emb[emb.shape[0] // 2 :])


def test_last_pp_stage_builds_and_reads_only_its_layers(tiny_checkpoint_factory, fake_rank):
    backend = _backend()
    path = tiny_checkpoint_factory("qwen3", tie_word_embeddings=True)
    full, _ = load_model(_config(path), backend, "cpu")
    fake_rank(0, 1, None, pp_rank=1, pp_size=2)
    before = LazyWeight.bytes_read
    stage, layers = load_model(_config(path, pipeline_parallel_size=2), backend, "cpu")
    read = LazyWeight.bytes_read - before
    assert sorted(layers) == ["model.layers.1.self_attn.attn"]
    assert isinstance(stage.model.embed_tokens, PPMissingLayer)
    assert isinstance(stage.model.layers[0], PPMissingLayer)
    assert not any(n.startswith(("model.layers.0.", "model.embed_tokens")) for n, _ in stage.named_parameters())
    # Tied embeddings: the last stage's head is its own copy of the embedding table.
    assert torch.equal(stage.lm_head.weight, full.model.embed_tokens.weight)
    for name, p in stage.named_parameters():
        if name.startswith("model.layers.1.") or name == "model.norm.weight":
            assert torch.equal(p, dict(full.named_parameters())[name]), name
    # Layer 0 and the embedding-as-embedding were never read (the head's copy was, once).
    assert read < 0.75 * _checkpoint_bytes(path)


def test_scheduler_skips_requests_whose_batch_is_in_flight():
    from pagedlm.core.kv_cache import KVCacheManager
    from pagedlm.core.request import EngineCoreRequest, Request
    from pagedlm.core.sampling_params import SamplingParams
    from pagedlm.core.sched import Scheduler

    sched = Scheduler(kv_cache_manager=KVCacheManager(num_blocks=16, block_size=4, enable_caching=False,
                                                      max_model_len=64),
                      max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64)
    params = SamplingParams(temperature=0.0, max_tokens=4)

    def add(req_id: str) -> None:
        core_request = EngineCoreRequest(request_id=req_id, prompt_token_ids=[1, 2, 3], sampling_params=params)
        sched.add_request(Request.from_engine_core_request(core_request, 64))

    add("0")
    assert list(sched.schedule().num_scheduled_tokens) == ["0"]
    add("1")
    # Request 0 waits for its sampled token (batch in flight); request 1 forms the next batch.
    second = sched.schedule()
    assert list(second.num_scheduled_tokens) == ["1"]
    assert sched.schedule().total_num_scheduled_tokens == 0
