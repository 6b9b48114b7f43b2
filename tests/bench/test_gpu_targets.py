"""packages/backend-cuda/benchmarks/gpu_targets.py: the figures it derives from the runs' JSON."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "packages/backend-cuda/benchmarks/gpu_targets.py"


@pytest.fixture(scope="module")
def targets():
    spec = importlib.util.spec_from_file_location("gpu_targets", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _latency(p50_ms: float, weight_bytes: float, over_floor: float) -> dict:
    return {"decode_latency_ms": {"p50": p50_ms},
            "weight_read_floor": {"weight_bytes": weight_bytes, "decode_p50_over_floor": over_floor}}


def test_every_run_a_target_needs_is_defined(targets):
    assert all(name in targets.RUNS for names in targets.TARGETS.values() for name in names)


def test_figures_are_ratios_against_the_same_runs_bf16(targets):
    results = {
        "latency bf16": _latency(4.2, 15.0, 1.10),
        "latency w4a16": _latency(2.8, 5.4, 2.0),
        "latency w4a16 packed": _latency(1.6, 3.9, 1.9),
        "fixed bf16": {"output_tokens_per_s": 13000.0},
        "fixed fp8": {"output_tokens_per_s": 18200.0},
        "nano 1": {"output_tokens_per_s": 26000.0}, "nano 2": {"output_tokens_per_s": 33000.0},
        "nano 3": {"output_tokens_per_s": 32500.0},
    }
    rows = {r["figure"]: r for r in targets.evaluate(results)}
    assert rows["bf16 decode p50 / weight read"]["met"]  # 1.10 <= 1.15
    w4 = rows["decode speed-up vs bf16"]
    assert w4["value"] == pytest.approx(1.5) and not w4["met"]
    packed = rows["decode speed-up vs bf16, head + embedding packed"]
    assert packed["value"] == pytest.approx(4.2 / 1.6) and packed["met"]
    assert rows["weights vs bf16, head + embedding packed"]["value"] == pytest.approx(0.26)
    assert rows["output tokens/s vs bf16"]["value"] == pytest.approx(1.4) and not rows["output tokens/s vs bf16"]["met"]
    nano = rows["output tokens/s, median of 3"]
    assert nano["value"] == 32500.0 and nano["met"]


def test_a_failed_run_leaves_its_figures_unmeasured(targets):
    rows = targets.evaluate({"fixed bf16": {"output_tokens_per_s": 1.0}, "fixed fp8": None})
    fp8 = next(r for r in rows if r["target"] == "fp8")
    assert fp8["value"] is None and not fp8["met"]


def test_ab_compares_each_runs_headline_figure(targets):
    base = {"latency bf16": _latency(4.0, 15.0, 1.1), "fixed fp8": {"output_tokens_per_s": 100.0}, "nano 1": None}
    ab = {"latency bf16": _latency(3.6, 15.0, 1.0), "fixed fp8": {"output_tokens_per_s": 110.0},
          "nano 1": {"output_tokens_per_s": 5.0}}
    runs = {r["run"]: r for r in targets.compare_runs(base, ab)}
    assert runs["latency bf16"]["figure"] == "decode p50 ms" and runs["latency bf16"]["ratio"] == 0.9
    assert runs["fixed fp8"]["figure"] == "output tok/s" and runs["fixed fp8"]["ratio"] == 1.1
    assert runs["nano 1"]["base"] is None and runs["nano 1"]["ratio"] is None


@pytest.mark.parametrize("bad", ["PAGEDLM_X", "=1", "A B=1"])
def test_ab_names_an_assignment_it_cannot_read(targets, bad):
    with pytest.raises(ValueError, match=f"--ab {bad!r}: expected KEY=VALUE"):
        targets.parse_env([bad])


def test_ab_runs_each_command_with_and_without_the_variable(targets, tmp_path, monkeypatch, capsys):
    """The switch reaches the benchmark's environment; each run's JSON is kept apart."""
    seen = []

    def fake_run(cmd, capture_output, text, env):
        seen.append(env.get("PAGEDLM_CUDA_SPLIT_KV_MERGE"))
        out = Path(cmd[cmd.index("--output-json") + 1])
        tps = 200.0 if env.get("PAGEDLM_CUDA_SPLIT_KV_MERGE") == "kernel" else 100.0
        out.write_text(json.dumps({"output_tokens_per_s": tps}))
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(targets.subprocess, "run", fake_run)
    monkeypatch.setattr(sys, "argv", ["gpu_targets", "--out", str(tmp_path), "--only", "fp8",
                                      "--ab", "PAGEDLM_CUDA_SPLIT_KV_MERGE=kernel"])
    assert targets.main() == 0
    assert seen == [None, "kernel", None, "kernel"]
    ab = json.loads((tmp_path / "ab.json").read_text())
    assert ab["env"] == {"PAGEDLM_CUDA_SPLIT_KV_MERGE": "kernel"}
    assert [r["ratio"] for r in ab["runs"]] == [2.0, 2.0]
    assert (tmp_path / "fixed_fp8_ab.json").exists() and (tmp_path / "fixed_fp8.json").exists()
    assert "fixed fp8" in capsys.readouterr().out
