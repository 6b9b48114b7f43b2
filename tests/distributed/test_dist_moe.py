"""Mixture-of-experts models across ranks: TP=2 with every expert sliced, TP=2 with expert
parallelism (whole experts per rank), and PP=2, each giving HF's greedy tokens (fp32, CPU, gloo; on
GPUs with NCCL when ``PAGEDLM_TEST_DIST_DEVICE=cuda``); plus single-process checks that a rank
holds and reads only its share of the experts."""

from __future__ import annotations

import pytest
import torch
from dist_helpers import ENGINE_KWARGS, MAX_NEW, prompts, skip_unless_devices

from pagedlm.core import LLM
from pagedlm.core.config import LoadConfig, ModelConfig, ParallelConfig, VllmConfig
from pagedlm.core.distributed import init_model_parallel
from pagedlm.core.model_loader import load_model
from pagedlm.core.model_loader.weight_utils import LazyWeight
from pagedlm.core.testing import MOE_ARCHITECTURES, assert_greedy_matches_hf, hf_greedy

LAYOUTS = {
    "tp2": {"tensor_parallel_size": 2},
    "tp2-ep": {"tensor_parallel_size": 2, "enable_expert_parallel": True},
    "pp2": {"pipeline_parallel_size": 2},
}


@pytest.fixture(scope="module")
def references(tiny_checkpoint_factory):
    return {arch: hf_greedy(tiny_checkpoint_factory(arch), prompts(), MAX_NEW) for arch in MOE_ARCHITECTURES}


@pytest.mark.timeout(180)
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("arch", MOE_ARCHITECTURES)
def test_moe_layout_matches_hf(arch, layout, tiny_checkpoint_factory, references):
    sizes = LAYOUTS[layout]
    skip_unless_devices(sizes.get("tensor_parallel_size", 1) * sizes.get("pipeline_parallel_size", 1))
    path = tiny_checkpoint_factory(arch)
    llm = LLM(model=path, **ENGINE_KWARGS, **sizes)
    try:
        forgiven = assert_greedy_matches_hf(path, prompts(), MAX_NEW, llm=llm, reference=references[arch])
    finally:
        llm.shutdown()
    assert forgiven <= 1


def _backend():
    from pagedlm.core.plugins import get_plugins, resolve_class_path

    return resolve_class_path(get_plugins().attention_backends()["cpu_paged"])


def _config(path: str, **parallel) -> VllmConfig:
    return VllmConfig(model_config=ModelConfig(model=path, dtype=torch.float32, skip_tokenizer_init=True),
                      load_config=LoadConfig(load_format="auto"), parallel_config=ParallelConfig(**parallel))


def _checkpoint_bytes(path: str) -> int:
    from safetensors import safe_open

    with safe_open(f"{path}/model.safetensors", framework="pt") as f:
        return sum(int(torch.Size(f.get_slice(n).get_shape()).numel()) * 4 for n in f.keys())  # noqa: SIM118


@pytest.fixture
def fake_rank():
    """Install TP coordinates without process groups: building and loading use no collective."""
    yield init_model_parallel
    init_model_parallel(0, 1, None)


def _experts(model, layer: int):
    block = model.model.layers[layer]
    return (block.mlp if hasattr(block.mlp, "experts") else block.block_sparse_moe).experts


@pytest.mark.parametrize("arch", MOE_ARCHITECTURES)
def test_expert_parallel_rank_holds_and_reads_only_its_experts(arch, tiny_checkpoint_factory, fake_rank):
    backend = _backend()
    path = tiny_checkpoint_factory(arch)
    full, _ = load_model(_config(path), backend, "cpu")
    whole = _experts(full, 1)
    num = whole.global_num_experts
    fake_rank(1, 2, None)
    before = LazyWeight.bytes_read
    shard, _ = load_model(_config(path, tensor_parallel_size=2, enable_expert_parallel=True), backend, "cpu")
    read = LazyWeight.bytes_read - before
    moe = _experts(shard, 1)
    assert (moe.ep_size, moe.ep_rank, moe.tp_size, moe.local_num_experts) == (2, 1, 1, num // 2)
    assert torch.equal(moe.w13_weight, whole.w13_weight[num // 2 :])
    assert torch.equal(moe.w2_weight, whole.w2_weight[num // 2 :])
    assert moe.expert_map.tolist() == [-1] * (num // 2) + list(range(num // 2))
    # The experts are most of the checkpoint; attention and the embeddings are sliced too.
    assert read < 0.6 * _checkpoint_bytes(path), (read, _checkpoint_bytes(path))


def test_tensor_parallel_rank_holds_its_slice_of_every_expert(tiny_checkpoint_factory, fake_rank):
    backend = _backend()
    path = tiny_checkpoint_factory("qwen3_moe")
    full, _ = load_model(_config(path), backend, "cpu")
    whole = _experts(full, 0)
    inter = whole.intermediate_size
    fake_rank(0, 2, None)
    shard, _ = load_model(_config(path, tensor_parallel_size=2), backend, "cpu")
    moe = _experts(shard, 0)
    half = inter // 2
    assert (moe.tp_size, moe.ep_size, moe.local_num_experts) == (2, 1, whole.global_num_experts)
    assert torch.equal(moe.w13_weight, torch.cat([whole.w13_weight[:, :half], whole.w13_weight[:, inter:inter + half]],
                                                 dim=1))
    assert torch.equal(moe.w2_weight, whole.w2_weight[:, :, :half])


def test_expert_parallel_needs_enough_experts(tiny_checkpoint_factory, fake_rank):
    path = tiny_checkpoint_factory("mixtral", num_experts=2)
    fake_rank(0, 4, None)
    with pytest.raises(ValueError, match="at least 4 experts"):
        load_model(_config(path, tensor_parallel_size=4, enable_expert_parallel=True), _backend(), "cpu")
