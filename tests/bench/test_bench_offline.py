"""`pagedlm bench throughput | latency | prefix` on a tiny checkpoint: JSON fields present and sane.

Tiny runs only (seconds); the numbers themselves are not checked, only that they make sense.
"""

from __future__ import annotations

import json
import math

import pytest

# Imported before any test captures output: the engine's log handler binds the stderr it sees first.
import pagedlm.core.engine.core  # noqa: F401
from pagedlm.core.cli import main

CPU = ["--device", "cpu", "--dtype", "float32"]


def _run(argv: list[str], out_json) -> dict:
    assert main(argv + ["--output-json", str(out_json)]) == 0
    return json.loads(out_json.read_text())


def _positive(*values) -> bool:
    return all(isinstance(v, (int, float)) and math.isfinite(v) and v > 0 for v in values)


def _check_png(path) -> None:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000


def test_throughput_fixed_with_hf_and_timeline(tiny_llama, tmp_path, capsys):
    png = tmp_path / "kv.png"
    r = _run(["bench", "throughput", "--model", tiny_llama, *CPU, "--workload", "fixed", "--num-prompts", "6",
              "--input-len", "20", "--output-len", "6", "--compare", "hf", "--kv-timeline", str(png)],
             tmp_path / "t.json")
    assert "pagedlm bench throughput" in capsys.readouterr().out
    assert r["benchmark"] == "throughput" and r["num_requests"] == 6
    assert r["total_input_tokens"] == 120 and r["total_output_tokens"] == 36
    assert _positive(r["elapsed_s"], r["requests_per_s"], r["input_tokens_per_s"], r["output_tokens_per_s"])
    assert r["output_tokens_per_s"] == pytest.approx(36 / r["elapsed_s"])
    assert 0 < r["peak_kv_cache_usage"] <= 1 and r["num_preemptions"] == 0 and r["num_steps"] >= 6
    assert r["engine"]["device"] == "cpu" and r["engine"]["dtype"] == "float32" and r["engine"]["num_blocks"] > 0
    assert r["workload"]["name"] == "fixed" and r["environment"]["cpu_count"] >= 1
    hf = r["hf"]
    assert "error" not in hf, hf
    assert hf["api"] == "generate_batch" and hf["total_output_tokens"] == 36 and _positive(hf["elapsed_s"])
    assert r["speedup_vs_hf"] == pytest.approx(r["output_tokens_per_s"] / hf["output_tokens_per_s"])
    _check_png(png)
    samples = json.loads((tmp_path / "kv.json").read_text())["runs"][0]["samples"]
    assert len(samples) == r["num_steps"] + 1
    assert sum(s["prefill_tokens"] for s in samples) == 120
    for s in samples:
        assert s["used_blocks"] + s["cached_free_blocks"] + s["empty_blocks"] == s["num_blocks"]
    assert samples[-1]["used_blocks"] == 0 and samples[-1]["cached_free_blocks"] > 0  # prefix cache keeps them


def test_throughput_sharegpt_like_with_hf_manager(tiny_llama, tmp_path):
    r = _run(["bench", "throughput", "--model", tiny_llama, *CPU, "--workload", "sharegpt-like", "--num-prompts",
              "5", "--max-model-len", "96", "--compare", "hf"], tmp_path / "s.json")
    w = r["workload"]
    assert w["name"] == "sharegpt-like" and w["num_requests"] == 5
    assert w["input_len"]["max"] + w["output_len"]["min"] <= 96 and len(set(w["params"])) > 5
    assert r["total_output_tokens"] == w["total_output_tokens"]
    # per-request output lengths: HF runs them through its manager's add_request(max_new_tokens=...)
    assert r["hf"].get("api") == "ContinuousBatchingManager", r["hf"]
    assert r["hf"]["total_output_tokens"] == w["total_output_tokens"]


def test_throughput_reports_preemptions(tiny_llama, tmp_path):
    # 6 requests grow to 3 blocks each, but the cache has 8: the engine must preempt some.
    r = _run(["bench", "throughput", "--model", tiny_llama, *CPU, "--num-prompts", "6", "--input-len", "8",
              "--output-len", "40", "--num-gpu-blocks-override", "8"], tmp_path / "p.json")
    assert r["num_preemptions"] > 0 and r["steps"]["steps_with_preemption"] > 0
    assert r["peak_kv_cache_usage"] == pytest.approx(1.0) and r["peak_used_blocks"] == 8
    assert r["total_output_tokens"] == 240


def test_throughput_with_a_json_schema_on_every_request(tiny_llama, tmp_path, capsys):
    r = _run(["bench", "throughput", "--model", tiny_llama, *CPU, "--num-prompts", "4", "--input-len", "8",
              "--output-len", "12", "--structured-output-schema", "int-array"], tmp_path / "s.json")
    so = r["structured_outputs"]
    assert so["schema"] == "int-array" and r["total_output_tokens"] == 48  # the schema never ends early
    assert so["bitmask_steps"] == 12 and _positive(so["fill_ms_per_step"], so["apply_host_ms_per_step"])
    assert so["apply_device_ms_per_step"] is None  # no device on the CPU
    assert "bitmask fill / step" in capsys.readouterr().out


def test_throughput_profile_writes_the_top_ops(tiny_llama, tmp_path, capsys):
    r = _run(["bench", "throughput", "--model", tiny_llama, *CPU, "--num-prompts", "4", "--input-len", "8",
              "--output-len", "8", "--profile", str(tmp_path / "prof")], tmp_path / "p.json")
    assert r["profile"]["directory"] == str(tmp_path / "prof") and r["profile"]["device"] == "cpu"
    assert r["profile"]["device_time_s"] is None  # no device on the CPU
    table = (tmp_path / "prof" / "profile-top.txt").read_text()
    assert "aten::" in table and "Self CPU" in table
    assert "profile-top.txt" in capsys.readouterr().out


def test_latency(tiny_llama, tmp_path):
    r = _run(["bench", "latency", "--model", tiny_llama, *CPU, "--batch-size", "3", "--input-len", "24",
              "--output-len", "5", "--num-iters", "3", "--num-iters-warmup", "1"], tmp_path / "l.json")
    assert r["benchmark"] == "latency" and r["batch_size"] == 3
    assert len(r["iterations"]) == 3 and all(x["decode_steps"] == 4 for x in r["iterations"])
    for key in ("prefill_latency_ms", "decode_latency_ms", "e2e_latency_ms"):
        d = r[key]
        assert d["count"] == 3 and _positive(d["mean"], d["p50"], d["p90"], d["p99"])
        assert d["min"] <= d["p50"] <= d["p90"] <= d["p99"] <= d["max"]
    assert r["decode_step_latency_ms"]["count"] == 12
    assert r["prefill_latency_ms"]["mean"] < r["e2e_latency_ms"]["mean"]


def test_prefix_caching_on_vs_off(tiny_llama, tmp_path):
    png = tmp_path / "prefix.png"
    r = _run(["bench", "prefix", "--model", tiny_llama, *CPU, "--num-prompts", "8", "--num-prefixes", "2",
              "--prefix-len", "64", "--suffix-len", "8", "--output-len", "4", "--kv-timeline", str(png)],
             tmp_path / "p.json")
    on, off = r["caching_on"], r["caching_off"]
    assert on["enable_prefix_caching"] and not off["enable_prefix_caching"]
    assert on["prompt_tokens"] == off["prompt_tokens"] == 8 * 72
    # each 64-token prefix (4 blocks) is computed once, then served from the cache to 3 requests
    assert on["cached_prompt_tokens"] == 6 * 64 and on["hit_rate"] == pytest.approx(384 / 576)
    assert on["prefill_tokens_computed"] == 576 - 384
    assert off["cached_prompt_tokens"] == 0 and off["prefill_tokens_computed"] == 576
    assert r["prefill_tokens_saved"] == 384 and r["prefill_reduction"] == pytest.approx(384 / 576)
    assert _positive(r["speedup"], on["elapsed_s"], off["elapsed_s"])
    _check_png(png)
    runs = json.loads((tmp_path / "prefix.json").read_text())["runs"]
    assert [x["label"] for x in runs] == ["prefix caching ON", "prefix caching OFF"]


def test_latency_compares_with_hf_generate_and_reports_memory(tiny_llama, tmp_path, capsys):
    r = _run(["bench", "latency", "--model", tiny_llama, *CPU, "--batch-size", "2", "--input-len", "16",
              "--output-len", "4", "--num-iters", "2", "--num-iters-warmup", "1", "--compare", "hf", "llama.cpp"],
             tmp_path / "l.json")
    hf, lcpp = r["peers"]
    assert hf["peer"] == "hf" and hf["api"] == "generate" and hf["dtype"] == "float32"
    assert _positive(hf["prefill_ms"], hf["decode_ms_per_token"], hf["e2e_ms"], hf["output_tokens_per_s"])
    # llama.cpp runs one sequence of a GGUF file: refused here with the reason, not skipped silently
    assert lcpp["peer"] == "llama.cpp" and "--batch-size 1" in lcpp["error"]
    assert r["resident_memory_after_load_mb"] > 50
    out = capsys.readouterr().out
    assert "hf (generate)" in out and "llama.cpp" in out and "resident memory after load" in out


def test_no_model_means_the_default_model(tiny_llama, tmp_path, monkeypatch, capsys):
    from pagedlm.core import default_model

    offer = default_model.DefaultModel("tiny-default", "x:y", served_name="tiny-default")
    monkeypatch.setattr(default_model, "resolve_default_model", lambda: (tiny_llama, offer))
    r = _run(["bench", "latency", *CPU, "--batch-size", "1", "--input-len", "8", "--output-len", "3",
              "--num-iters", "1", "--num-iters-warmup", "0"], tmp_path / "l.json")
    assert r["engine"]["model"] == "tiny-default"

    def none_installed():
        raise ValueError(default_model._no_model_message([]))

    monkeypatch.setattr(default_model, "resolve_default_model", none_installed)
    assert main(["bench", "throughput", *CPU]) == 2
    assert "--model" in capsys.readouterr().err


def test_bad_options_name_the_problem(tiny_llama, capsys):
    assert main(["bench", "throughput", "--model", tiny_llama, "--model-config", "qwen3-0.6b", *CPU]) == 2
    assert "not both" in capsys.readouterr().err
    # the tiny model's context is 512 tokens: a 600 + 100 token request cannot fit
    assert main(["bench", "latency", "--model", tiny_llama, *CPU, "--input-len", "600", "--output-len", "100"]) == 2
    assert "max_model_len" in capsys.readouterr().err
    # data-parallel replicas keep their engine cores (and step statistics) in their own processes
    for flag in (["--compare", "hf"], ["--kv-timeline", "kv.png"], ["--profile", "prof"]):
        argv = ["bench", "throughput", "--model", tiny_llama, *CPU, "--data-parallel-size", "2", *flag]
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert flag[0] in err and "--data-parallel-size 2" in err


def test_throughput_with_data_parallel_replicas(tiny_llama, tmp_path, capsys):
    r = _run(["bench", "throughput", "--model", tiny_llama, *CPU, "--data-parallel-size", "2", "--workload", "fixed",
              "--num-prompts", "6", "--input-len", "20", "--output-len", "6"], tmp_path / "dp.json")
    assert r["engine"]["data_parallel_size"] == 2 and r["num_requests"] == 6
    assert r["total_output_tokens"] == 36 and _positive(r["output_tokens_per_s"], r["elapsed_s"])
    # per-step statistics stay in the replicas' processes: reported as unknown, not as zero
    assert r["num_steps"] is None and r["num_preemptions"] is None and r["steps"] == {}
    assert "2 replicas" in capsys.readouterr().out


@pytest.mark.slow
def test_model_config_with_dummy_weights(tmp_path):
    # The published Qwen3-0.6B shape with random weights: no files but the shipped config.json.
    r = _run(["bench", "throughput", "--model-config", "qwen3-0.6b", "--load-format", "dummy", *CPU,
              "--num-prompts", "2", "--input-len", "8", "--output-len", "2", "--max-num-seqs", "2"],
             tmp_path / "q.json")
    assert r["engine"]["model"] == "qwen3-0.6b" and r["engine"]["load_format"] == "dummy"
    assert r["engine"]["max_model_len"] == 16 and r["total_output_tokens"] == 4


def test_prefix_offload_tier_on_vs_off(tiny_llama, tmp_path):
    # 4 prefixes of 4 blocks each cycle through a 12-block device cache one request at a time: each
    # is evicted before its second use, so without the tier nothing hits and with it all 4 come back
    r = _run(["bench", "prefix", "--model", tiny_llama, *CPU, "--num-prompts", "8", "--num-prefixes", "4",
              "--prefix-len", "64", "--suffix-len", "8", "--output-len", "2", "--num-gpu-blocks-override", "12",
              "--max-model-len", "128", "--max-num-seqs", "1", "--kv-offload-gib", "0.01"], tmp_path / "p.json")
    tier, no_tier = r["offload_tier_on"], r["caching_on"]
    assert tier["offload_tier"] and not no_tier["offload_tier"]
    assert no_tier["cached_prompt_tokens"] == 0 and no_tier["prefill_tokens_computed"] == 576
    assert tier["offload_tier_hit_tokens"] == tier["cached_prompt_tokens"] == 4 * 64
    assert tier["prefill_tokens_computed"] == 576 - 256 and tier["hit_rate"] > no_tier["hit_rate"]
    assert r["offload_prefill_tokens_saved"] == 256
def test_throughput_with_images_against_hf_generate(tiny_llava, tmp_path, capsys):
    r = _run(["bench", "throughput", "--model", tiny_llava, *CPU, "--num-prompts", "4", "--input-len", "12",
              "--output-len", "4", "--images-per-request", "1", "--image-size", "60", "--compare", "hf",
              "--hf-batch-size", "2", "--max-model-len", "64"], tmp_path / "t.json")
    assert "images/s" in capsys.readouterr().out
    assert r["num_images"] == 4 and r["images_per_s"] == pytest.approx(4 / r["elapsed_s"])
    assert r["total_input_tokens"] == 4 * (12 + 16)  # one placeholder per image, expanded to 16 tokens
    assert r["prefix_cached_tokens"] == 0  # distinct images: nothing shared
    hf = r["hf"]
    assert "error" not in hf, hf
    assert hf["api"] == "generate" and hf["total_output_tokens"] == 16 and _positive(hf["images_per_s"])
    assert r["speedup_vs_hf"] == pytest.approx(r["output_tokens_per_s"] / hf["output_tokens_per_s"])


def test_llava_model_config_with_images(tmp_path):
    # The published LLaVA-1.5-7B config (no processor or tokenizer files: CLIP's default image
    # preprocessing, 576 tokens per 336 px image), shrunk through --hf-overrides to run on a CPU.
    small = ('{"text_config": {"num_hidden_layers": 1, "hidden_size": 64, "intermediate_size": 64, '
             '"num_attention_heads": 2, "num_key_value_heads": 2}, "vision_config": {"num_hidden_layers": 2, '
             '"hidden_size": 32, "intermediate_size": 32, "num_attention_heads": 2}}')
    r = _run(["bench", "throughput", "--model-config", "llava-1.5-7b", "--load-format", "dummy", *CPU,
              "--num-prompts", "2", "--input-len", "8", "--output-len", "2", "--images-per-request", "1",
              "--max-model-len", "1024", "--hf-overrides", small], tmp_path / "l.json")
    assert r["engine"]["model"] == "llava-1.5-7b" and r["num_images"] == 2
    assert r["total_input_tokens"] == 2 * (8 + 576) and r["total_output_tokens"] == 4
