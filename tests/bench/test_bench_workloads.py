"""Benchmark building blocks that need no engine: workloads, statistics, model configs, options."""

from __future__ import annotations

import json

import pytest

from pagedlm.core.bench import common, serve, workloads


def test_nano_workload_is_nano_vllms():
    wl = workloads.nano_workload()
    s = wl.summary()
    # nano-vllm's README reports 133,966 output tokens for its 256-request seed-0 workload.
    assert s["num_requests"] == 256 and s["total_output_tokens"] == 133_966
    assert 100 <= s["input_len"]["min"] and s["input_len"]["max"] <= 1024
    assert all(0 <= t <= 10000 for p in wl.prompts for t in p)
    assert wl.temperature == 0.6 and wl.max_total_len <= 2048
    again = workloads.nano_workload()
    assert again.prompts == wl.prompts and again.output_lens == wl.output_lens
    folded = workloads.nano_workload(vocab_size=512)
    assert [len(p) for p in folded.prompts] == [len(p) for p in wl.prompts]
    assert folded.output_lens == wl.output_lens and max(max(p) for p in folded.prompts) < 512


def test_fixed_and_sharegpt_like_workloads():
    wl = workloads.fixed_workload(num_prompts=5, input_len=7, output_len=3, seed=1, vocab_size=100)
    assert [len(p) for p in wl.prompts] == [7] * 5 and wl.output_lens == [3] * 5
    assert max(max(p) for p in wl.prompts) < 100
    with pytest.raises(ValueError, match="input-len"):
        workloads.fixed_workload(num_prompts=1, input_len=0, output_len=3)
    sg = workloads.sharegpt_like_workload(num_prompts=3000, seed=0)
    s = sg.summary()
    # log-normal means 161 / 338 before clipping to [4, 1024]; clipping trims a little
    assert 140 < s["input_len"]["mean"] < 175 and 290 < s["output_len"]["mean"] < 345
    assert s["input_len"]["min"] >= 4 and s["output_len"]["max"] <= 1024
    short = workloads.sharegpt_like_workload(num_prompts=200, seed=0, max_model_len=256)
    assert short.max_total_len <= 256
    assert workloads.sharegpt_like_workload(num_prompts=20, seed=3).prompts == \
        workloads.sharegpt_like_workload(num_prompts=20, seed=3).prompts


def test_prefix_workload_shares_prefixes():
    wl = workloads.prefix_workload(num_prompts=6, num_prefixes=2, prefix_len=10, suffix_len=3, output_len=4)
    assert wl.prompts[0][:10] == wl.prompts[2][:10] == wl.prompts[4][:10]
    assert wl.prompts[0][:10] != wl.prompts[1][:10]
    assert wl.prompts[0][10:] != wl.prompts[2][10:]
    assert all(len(p) == 13 for p in wl.prompts)


def test_percentiles_and_distribution():
    assert common.percentile([1, 2, 3, 4, 5], 50) == 3
    assert common.percentile([0, 10], 90) == pytest.approx(9.0)
    d = common.distribution([0.001, 0.002, 0.003], 1000.0)
    assert d["count"] == 3 and d["mean"] == pytest.approx(2.0) and d["p50"] == pytest.approx(2.0)
    assert d["min"] == pytest.approx(1.0) and d["max"] == pytest.approx(3.0)
    assert common.distribution([]) == {"count": 0}


# Parameter counts published with each model (embeddings included, tied ones once).
@pytest.mark.parametrize(("name", "arch", "billions"), [
    ("qwen3-0.6b", "Qwen3ForCausalLM", 0.596),
    ("llama-3.2-1b", "LlamaForCausalLM", 1.236),
    ("llama-3.1-8b", "LlamaForCausalLM", 8.030),
    ("qwen3-30b-a3b", "Qwen3MoeForCausalLM", 30.5),
    ("mixtral-8x7b", "MixtralForCausalLM", 46.7),
])
def test_shipped_model_configs(tmp_path, name, arch, billions):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    out = common.model_config_dir(name, str(tmp_path / name))
    raw = json.loads((tmp_path / name / "config.json").read_text())
    assert raw["architectures"] == [arch]
    config = AutoConfig.from_pretrained(out)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    params = sum(p.numel() for p in model.parameters())
    assert params / 1e9 == pytest.approx(billions, rel=0.01)


def test_loopback_only_and_goodput_parsing():
    assert serve.check_loopback("http://127.0.0.1:8000") == ("127.0.0.1", 8000)
    assert serve.check_loopback("http://localhost:9/")[1] == 9
    for url in ("http://10.1.2.3:8000", "http://192.168.0.1", "http://8.8.8.8:80", "ftp://127.0.0.1"):
        with pytest.raises(ValueError):
            serve.check_loopback(url)
    assert serve.parse_goodput(["ttft:500", "tpot:50.5"]) == {"ttft": 500.0, "tpot": 50.5}
    for bad in (["ttft"], ["speed:3"], ["e2e:fast"]):
        with pytest.raises(ValueError, match="goodput"):
            serve.parse_goodput(bad)


def test_launch_flags_are_only_the_changed_options():
    flags = serve._engine_flags({"model": "/m", "dtype": "float32", "seed": 0, "enable_prefix_caching": False,
                                 "load_format": "dummy", "max_model_len": None})
    assert flags == ["--model", "/m", "--dtype", "float32", "--no-enable-prefix-caching", "--load-format", "dummy"]


def test_bench_help_lists_every_subcommand(capsys):
    from pagedlm.core.cli import main

    with pytest.raises(SystemExit):
        main(["bench", "--help"])
    out = capsys.readouterr().out
    for name in ("throughput", "latency", "serve", "prefix"):
        assert name in out
    with pytest.raises(SystemExit):
        main(["bench", "throughput", "--help"])
    out = capsys.readouterr().out
    for flag in ("--workload", "--compare", "--kv-timeline", "--model-config", "--device", "--dtype"):
        assert flag in out
