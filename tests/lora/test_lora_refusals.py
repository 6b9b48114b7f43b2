"""Bad adapters and bad arguments are refused by name, before anything is queued; the scheduler's
slot rule and the prefix-cache keys without a model."""

from __future__ import annotations

import json
import shutil

import pytest
from lora_helpers import lora_requests

from pagedlm.core import LLM, LoRARequest, SamplingParams
from pagedlm.core.config import LoRAConfig

PARAMS = SamplingParams(temperature=0.0, max_tokens=2)


@pytest.fixture(scope="module")
def llm(lora_setups):
    llm = LLM(lora_setups["llama"].model, dtype="float32", device="cpu", enable_lora=True, max_loras=2,
              max_lora_rank=8, max_model_len=64)
    yield llm
    llm.shutdown()


def _copy(src: str, dst, **config_changes) -> str:
    shutil.copytree(src, dst)
    path = dst / "adapter_config.json"
    config = json.loads(path.read_text())
    config.update(config_changes)
    path.write_text(json.dumps(config))
    return str(dst)


def test_rank_over_limit(llm, lora_setups):
    bad = LoRARequest("big", 7, lora_setups["llama"].adapters["mlp-r16"])
    with pytest.raises(ValueError, match=r"'big'.*r=16 exceeds max_lora_rank=8"):
        llm.generate("hi", PARAMS, lora_request=bad, use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()


def test_module_the_model_lacks(llm, lora_setups, tiny_checkpoint_factory, tmp_path):
    """An adapter of a deeper model of the same width: its layer 2 does not exist here."""
    from pagedlm.core.testing.lora import make_peft_adapter

    deeper = tiny_checkpoint_factory("llama", num_layers=3)
    path = make_peft_adapter(deeper, tmp_path / "deep", rank=4, target_modules=("o_proj",))
    with pytest.raises(ValueError, match=r"'deep'.*targets module 'model.layers.2.self_attn.o_proj'.*no "
                                         r"LoRA-capable layer.*o_proj"):
        llm.generate("hi", PARAMS, lora_request=LoRARequest("deep", 8, path), use_tqdm=False)
    # an adapter of another width: the shapes do not fit
    wider = tiny_checkpoint_factory("llama", hidden_size=128)
    path = make_peft_adapter(wider, tmp_path / "wide", rank=4, target_modules=("o_proj",))
    with pytest.raises(ValueError, match=r"'wide'.*lora_A \[4, 128\].*do not fit the model"):
        llm.generate("hi", PARAMS, lora_request=LoRARequest("wide", 11, path), use_tqdm=False)


@pytest.mark.parametrize(("change", "message"), [
    ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
    ({"use_dora": True}, "DoRA"),
    ({"peft_type": "IA3"}, "peft_type='IA3'"),
    ({"rank_pattern": {"q_proj": 2}}, "rank_pattern"),
])
def test_unsupported_configs(llm, lora_setups, tmp_path, change, message):
    path = _copy(lora_setups["llama"].adapters["all-r8"], tmp_path / "x", **change)
    with pytest.raises(ValueError, match=message):
        llm.llm_engine.add_lora(LoRARequest("x", 9, path))


def test_missing_files_and_bad_arguments(llm, lora_setups, tmp_path):
    with pytest.raises(ValueError, match="no adapter_config.json"):
        llm.generate("hi", PARAMS, lora_request=LoRARequest("nowhere", 10, str(tmp_path)), use_tqdm=False)
    good = lora_requests(lora_setups["llama"])["all-r8"]
    with pytest.raises(ValueError, match="lora_request has 2 entries but there are 1 prompts"):
        llm.generate(["hi"], PARAMS, lora_request=[good, None], use_tqdm=False)
    with pytest.raises(ValueError, match="lora_request must be a LoRARequest"):
        llm.generate("hi", PARAMS, lora_request="all-r8", use_tqdm=False)
    llm.generate("hi", PARAMS, lora_request=good, use_tqdm=False)
    other = LoRARequest("other", good.lora_int_id, lora_setups["llama"].adapters["attn-r4-rslora"])
    with pytest.raises(ValueError, match=r"lora_int_id=1 already names adapter 'all-r8'"):
        llm.generate("hi", PARAMS, lora_request=other, use_tqdm=False)
    with pytest.raises(ValueError, match="lora_int_id=0 must be an integer >= 1"):
        LoRARequest("zero", 0, "/x")
    assert LoRARequest("p", 3, path="/a/b").lora_path == "/a/b"


def test_lora_request_without_enable_lora(lora_setups):
    llm = LLM(lora_setups["llama"].model, dtype="float32", device="cpu", max_model_len=64)
    good = lora_requests(lora_setups["llama"])["all-r8"]
    with pytest.raises(ValueError, match="enable_lora=True"):
        llm.generate("hi", PARAMS, lora_request=good, use_tqdm=False)
    llm.shutdown()


def test_config_validation():
    with pytest.raises(ValueError, match="fully_sharded_loras=True is not supported"):
        LoRAConfig(fully_sharded_loras=True)
    with pytest.raises(ValueError, match="max_cpu_loras=1 must be >= max_loras=2"):
        LoRAConfig(max_loras=2, max_cpu_loras=1)
    with pytest.raises(ValueError, match="max_lora_rank=0"):
        LoRAConfig(max_lora_rank=0)
    with pytest.raises(ValueError, match="lora_dtype='int8'"):
        LoRAConfig(lora_dtype="int8")


def _request(req_id: str, lora: LoRARequest | None, tokens: list[int]):
    from pagedlm.core.request import Request

    return Request(req_id, tokens, SamplingParams(max_tokens=4), lora_request=lora)


def test_scheduler_keeps_distinct_adapters_within_slots():
    from pagedlm.core.kv_cache import KVCacheManager
    from pagedlm.core.sched import Scheduler

    sched = Scheduler(kv_cache_manager=KVCacheManager(num_blocks=64, block_size=4, enable_caching=True,
                                                      max_model_len=64),
                      max_num_seqs=8, max_num_batched_tokens=64, max_model_len=64, max_loras=2)
    a, b, c = (LoRARequest(n, i, "/x") for i, n in enumerate("abc", 1))
    for i, lora in enumerate([a, b, c, a, None, c]):
        sched.add_request(_request(f"r{i}", lora, [1, 2, 3, 4, 5]))
    out = sched.schedule()
    # r2 and r5 (adapter c) wait: a and b hold the two slots; the base request runs
    assert [r.req_id for r in out.scheduled_new_reqs] == ["r0", "r1", "r3", "r4"]
    assert [r.request_id for r in sched.waiting] == ["r2", "r5"]
    stats = sched.make_stats()
    assert stats.running_lora_adapters == {"a": 2, "b": 1} and stats.waiting_lora_adapters == {"c": 2}


def test_prefix_cache_keys_include_the_adapter():
    from pagedlm.core.kv_cache import update_block_hashes

    tokens = list(range(1, 17))
    a, a_again, b = LoRARequest("a", 1, "/x"), LoRARequest("a", 1, "/x"), LoRARequest("b", 2, "/y")
    hashes = {}
    for name, lora in (("base", None), ("a", a), ("a2", a_again), ("b", b)):
        request = _request(name, lora, tokens)
        update_block_hashes(request, 4)
        hashes[name] = request.block_hashes
    assert hashes["a"] == hashes["a2"]
    assert len({tuple(h) for h in hashes.values()}) == 3
    assert not set(hashes["a"]) & set(hashes["b"]) and not set(hashes["a"]) & set(hashes["base"])


def test_cli_flags_and_vllm_import_paths(lora_setups):
    """vLLM's flags through EngineArgs.add_cli_args, and vLLM's module path of LoRARequest."""
    from pagedlm.core import EngineArgs
    from pagedlm.core import LoRARequest as Exported
    from pagedlm.core.lora.request import LoRARequest as FromModule  # vllm.lora.request.LoRARequest
    from pagedlm.core.utils import FlexibleArgumentParser

    assert Exported is FromModule
    parser = EngineArgs.add_cli_args(FlexibleArgumentParser())
    args = parser.parse_args(["--model", lora_setups["llama"].model, "--enable-lora", "--max-loras", "3",
                              "--max_lora_rank", "32", "--max-cpu-loras", "5", "--lora-dtype", "float32"])
    lc = EngineArgs.from_cli_args(args).create_vllm_config().lora_config
    assert (lc.max_loras, lc.max_lora_rank, lc.max_cpu_loras, lc.lora_dtype) == (3, 32, 5, "float32")
    assert EngineArgs(model=lora_setups["llama"].model).create_vllm_config().lora_config is None
