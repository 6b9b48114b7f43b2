"""KV connectors end to end on the CPU: SharedStorageConnector between processes, load failures,
the offload tier's correctness, bad kv_transfer_config, and the plugin hook."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from pagedlm.core import LLM, SamplingParams
from pagedlm.core.testing.hf_reference import compare_greedy, hf_greedy

# 70 tokens: 4 full blocks of 16 can load (the last token is always computed), 6 stay to compute
PROMPTS = [list(range(3, 73)), list(range(100, 140)), [7, 8, 9, 10, 11]]
MAX_TOKENS = 6
ROOT = Path(__file__).resolve().parents[2]


def _storage(path: Path, role: str, **extra) -> dict:
    return {"kv_connector": "SharedStorageConnector", "kv_role": role,
            "kv_connector_extra_config": {"shared_storage_path": str(path)}, **extra}


def _generate(llm, prompts=PROMPTS):
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)


@pytest.fixture(scope="module")
def reference(tiny_llama):
    return hf_greedy(tiny_llama, PROMPTS, MAX_TOKENS)


@pytest.fixture(scope="module")
def produced(tiny_llama, tmp_path_factory):
    """A producer process's stored blocks: (storage dir, block files)."""
    store = tmp_path_factory.mktemp("kv-store")
    script = textwrap.dedent(f"""
        from pagedlm.core import LLM, SamplingParams
        llm = LLM(model={tiny_llama!r}, dtype="float32", device="cpu",
                  kv_transfer_config={json.dumps(_storage(store, "kv_producer"))})
        llm.generate([{{"prompt_token_ids": p}} for p in {PROMPTS!r}],
                     SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
        llm.shutdown()
    """)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    subprocess.run([sys.executable, "-c", script], check=True, env=env, cwd=str(ROOT), timeout=240)
    files = sorted(store.glob("*/*.safetensors"))
    assert len(files) == 4 + 2  # the full prompt blocks of the first two prompts
    return store, files


def _consumer(tiny_llama, store, **extra):
    return LLM(model=tiny_llama, dtype="float32", device="cpu", disable_log_stats=False,
               kv_transfer_config=_storage(store, "kv_consumer", **extra))


def test_consumer_process_loads_the_producers_blocks(tiny_llama, produced, reference):
    store, _ = produced
    llm = _consumer(tiny_llama, store)
    try:
        outs = _generate(llm)
        assert compare_greedy([o.outputs[0].token_ids for o in outs], reference) == (0, 0)
        # loaded tokens count as cached: 4 and 2 blocks; the short prompt has no full block
        assert [o.num_cached_tokens for o in outs] == [64, 32, 0]
        stats = llm.llm_engine.core.scheduler.kv_transfer.stats
        assert (stats.num_hit_tokens, stats.num_recomputed_tokens) == (96, 0)
        metrics = {m.name: m.value for m in llm.get_metrics() if "external" in m.name}
        assert metrics == {"pagedlm:external_prefix_cache_queries": sum(map(len, PROMPTS)),
                           "pagedlm:external_prefix_cache_hits": 96}
    finally:
        llm.shutdown()


def test_corrupt_or_missing_blocks_are_recomputed(tiny_llama, produced, reference, tmp_path):
    store, files = produced
    copy = tmp_path / "store"
    for f in files:
        (copy / f.parent.name).mkdir(parents=True, exist_ok=True)
        (copy / f.parent.name / f.name).write_bytes(f.read_bytes())
    copied = {f.name: copy / f.parent.name / f.name for f in files}
    # the first prompt's third block: a flipped byte in its data; the second prompt's first: gone
    first = _block_files(tiny_llama, PROMPTS[0], copied)
    data = bytearray(first[2].read_bytes())
    data[-5] ^= 0xFF
    first[2].write_bytes(bytes(data))
    _block_files(tiny_llama, PROMPTS[1], copied)[0].unlink()
    llm = _consumer(tiny_llama, copy)
    try:
        outs = _generate(llm)
        assert compare_greedy([o.outputs[0].token_ids for o in outs], reference) == (0, 0)
        assert [o.num_cached_tokens for o in outs] == [32, 0, 0]  # up to the bad block; nothing after a gap
        stats = llm.llm_engine.core.scheduler.kv_transfer.stats
        assert stats.num_recomputed_tokens == 32  # blocks 3 and 4 of the first prompt
    finally:
        llm.shutdown()


def _block_files(model: str, prompt: list[int], files: dict[str, Path]) -> list[Path]:
    """The stored files of the prompt's full blocks, in order."""
    from pagedlm.core.kv_cache.block_hash import hash_block_tokens

    parent, out = None, []
    for start in range(0, len(prompt) - 15, 16):
        parent = hash_block_tokens(parent, prompt[start:start + 16])
        out.append(files[parent.hex() + ".safetensors"])
    return out


def test_load_failure_policy_fail_fails_the_request(tiny_llama, produced, tmp_path):
    store, files = produced
    copy = tmp_path / "store"
    for f in files:
        (copy / f.parent.name).mkdir(parents=True, exist_ok=True)
        (copy / f.parent.name / f.name).write_bytes(b"garbage")
    llm = _consumer(tiny_llama, copy, kv_load_failure_policy="fail")
    try:
        outs = _generate(llm)
        assert outs[0].error and "did not load" in outs[0].error and outs[0].outputs[0].finish_reason == "error"
        assert outs[2].error is None and len(outs[2].outputs[0].token_ids) == MAX_TOKENS  # others go on
    finally:
        llm.shutdown()


def test_offload_tier_brings_evicted_blocks_back_with_the_same_tokens(tiny_llama):
    prefixes = [[(7 * k + i) % 200 + 3 for i in range(64)] for k in range(4)]
    prompts = [prefixes[i % 4] + [250 + i] for i in range(8)]
    reference = hf_greedy(tiny_llama, prompts, 3)
    llm = LLM(model=tiny_llama, dtype="float32", device="cpu", num_gpu_blocks_override=12, max_model_len=128,
              max_num_seqs=1, kv_offloading_size=0.01, async_scheduling=True)
    try:
        params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
        outs = [llm.generate([{"prompt_token_ids": p}], params, use_tqdm=False)[0] for p in prompts]
        assert compare_greedy([o.outputs[0].token_ids for o in outs], reference) == (0, 0)
        assert [o.num_cached_tokens for o in outs] == [0] * 4 + [64] * 4  # from host memory
    finally:
        llm.shutdown()


@pytest.mark.parametrize(("config", "match"), [
    ({"kv_connector": "NoSuchConnector"}, "not a registered KV connector"),
    ({"kv_connector": "SharedStorageConnector", "kv_role": "kv_sender"}, "kv_role='kv_sender' is invalid"),
    ({"kv_connector": "OffloadingConnector"}, "cpu_bytes_to_use=None"),
    ({"kv_connector": "SharedStorageConnector", "colour": 1}, "unknown fields"),
])
def test_bad_kv_transfer_config_is_refused_by_name(tiny_llama, config, match):
    with pytest.raises(ValueError, match=match):
        LLM(model=tiny_llama, dtype="float32", device="cpu", kv_transfer_config=config)


def test_connectors_need_prefix_caching(tiny_llama):
    with pytest.raises(ValueError, match="needs enable_prefix_caching=True"):
        LLM(model=tiny_llama, dtype="float32", device="cpu", enable_prefix_caching=False, kv_offloading_size=1)


def test_a_plugin_registers_a_connector(tiny_llama, tmp_path):
    from pagedlm.core.plugins import get_plugins, hookimpl

    class Plugin:
        @hookimpl
        def pagedlm_register_kv_connectors(self, register):
            register("MyStorage", "pagedlm.core.distributed.kv_transfer.shared_storage_connector:"
                                  "SharedStorageConnector")

    plugins = get_plugins()
    plugins.register(Plugin(), name="test-kv-connector")
    try:
        assert plugins.kv_connectors()["MyStorage"].endswith(":SharedStorageConnector")
        assert {"SharedStorageConnector", "P2pConnector", "OffloadingConnector"} <= set(plugins.kv_connectors())
        llm = LLM(model=tiny_llama, dtype="float32", device="cpu",
                  kv_transfer_config={"kv_connector": "MyStorage",
                                      "kv_connector_extra_config": {"shared_storage_path": str(tmp_path)}})
        llm.shutdown()
    finally:
        plugins.unregister("test-kv-connector")
