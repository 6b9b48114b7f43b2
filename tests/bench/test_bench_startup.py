"""`pagedlm bench startup` on the tiny checkpoint: a fresh process per run, its phases, its failures."""

from __future__ import annotations

import json
import math
import os
import re

import pytest

from pagedlm.core.bench import startup
from pagedlm.core.cli import main


def _positive(*values) -> bool:
    return all(isinstance(v, (int, float)) and math.isfinite(v) and v > 0 for v in values)


def test_startup_times_imports_phases_and_first_token(tiny_llama, tmp_path, capsys):
    out = tmp_path / "s.json"
    argv = ["bench", "startup", "--model", tiny_llama, "--device", "cpu", "--num-runs", "1", "--output-json", str(out)]
    assert main(argv) == 0
    r = json.loads(out.read_text())
    assert r["benchmark"] == "startup" and r["engine"]["device"] == "cpu" and r["engine"]["num_blocks"] > 0
    assert r["args"]["num_runs"] == 1 and r["args"]["engine_kwargs"]["model"] == tiny_llama
    (run,) = r["runs"]
    assert _positive(*(run[key] for key, _ in startup.FIGURES))
    # torch is loaded in this process already: only a fresh one pays for importing it
    assert run["import_torch_s"] > 0.05
    assert run["llm_to_first_token_s"] == pytest.approx(run["llm_init_s"] + run["first_token_s"])
    assert run["process_s"] > run["import_torch_s"] + run["import_pagedlm_s"] + run["llm_to_first_token_s"]
    # the CPU runner compiles and captures nothing at start-up; its profile_run is core's no-op
    phases = {p["name"]: p for p in run["phases"]}
    assert list(phases) == ["load_model", "profile_run", "initialize_kv_cache"]
    load, kv = phases["load_model"], phases["initialize_kv_cache"]
    assert 0 < load["duration_s"] < run["llm_init_s"]
    assert 0 < run["before_first_phase_s"] == load["start_s"]
    assert load["start_s"] + load["duration_s"] <= kv["start_s"]
    assert kv["start_s"] + kv["duration_s"] + run["after_last_phase_s"] == pytest.approx(run["llm_init_s"])
    assert r["median"]["llm_to_first_token_s"] == run["llm_to_first_token_s"]
    assert list(r["median"]["phases"]) == list(phases)
    printed = capsys.readouterr().out
    assert f"LLM(...) to first token (s)    {run['llm_to_first_token_s']:.3f}" in printed
    assert re.search(r"\n  1 +before load_model +0\.000 ", printed)
    assert re.search(rf"\n  1 +load_model +{load['start_s']:.3f} +{load['duration_s']:.3f}\n", printed)


def test_medians_over_runs_take_each_phase_once_and_print(capsys):
    def run(scale: float, phases: list[tuple[str, float, float]]) -> dict:
        figures = {key: scale for key, _ in startup.FIGURES}
        return {**figures, "before_first_phase_s": scale / 4, "after_last_phase_s": scale / 8,
                "phases": [{"name": n, "start_s": s, "duration_s": d} for n, s, d in phases]}

    runs = [run(1.0, [("load_model", 0.2, 0.5), ("compile_kernels", 0.3, 0.1)]),
            run(3.0, [("load_model", 0.4, 0.7), ("compile_kernels", 0.5, 0.3), ("load_model", 2.0, 9.0)]),
            run(2.0, [("load_model", 0.3, 0.6)])]
    med = startup._medians(runs)
    assert med["llm_init_s"] == 2.0 and med["before_first_phase_s"] == 0.5 and med["after_last_phase_s"] == 0.25
    # a second call of a phase does not count; a phase missing from a run is the median of the others
    assert med["phases"] == {"load_model": {"start_s": 0.3, "duration_s": 0.6},
                             "compile_kernels": {"start_s": 0.4, "duration_s": 0.2}}
    engine = {"model": "m", "device": "cuda", "dtype": "bfloat16", "load_format": "dummy", "gpu": "NVIDIA H200"}
    startup._print({"engine": engine, "runs": runs, "median": med})
    printed = capsys.readouterr().out
    assert "gpu" in printed and "NVIDIA H200" in printed
    assert "LLM(...) (s)                   2.000 (median; runs: 1.000, 3.000, 2.000)" in printed
    assert re.search(r"\n  median +before load_model +0\.000 +0\.500\n", printed)
    assert re.search(r"\n  median +  compile_kernels +0\.400 +0\.200\n", printed)  # nested: indented


def test_a_failing_child_is_named_not_a_traceback(tmp_path, capsys):
    missing = tmp_path / "no-such-model"
    assert main(["bench", "startup", "--model", str(missing), "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("startup run 1/1: a fresh process\nerror: start-up run 1 of 1 failed")
    assert "exited with code 1: ValueError:" in err and f"model={str(missing)!r} is not a directory" in err
    assert "Traceback" not in err
    log = re.search(r"\(its full stderr: (\S+)\)", err).group(1)
    try:
        with open(log, encoding="utf-8") as f:
            assert "Traceback (most recent call last)" in f.read()  # kept for whoever debugs it
    finally:
        os.remove(log)
