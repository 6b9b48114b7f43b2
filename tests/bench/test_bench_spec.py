"""`pagedlm bench spec` on a tiny checkpoint: both engines run, outputs compared, JSON fields sane
(the numbers themselves are not checked)."""

from __future__ import annotations

import json

# Imported before any test captures output: the engine's log handler binds the stderr it sees first.
import pagedlm.core.engine.core  # noqa: F401
from pagedlm.core.cli import main


def test_bench_spec_compares_speculation_on_and_off(tiny_llama, tmp_path, capsys):
    out = tmp_path / "spec.json"
    spec = {"model": tiny_llama, "num_speculative_tokens": 2}
    assert main(["bench", "spec", "--model", tiny_llama, "--device", "cpu", "--dtype", "float32", "--output-len", "8",
                 "--num-iters", "2", "--batch-size", "3", "--batch-output-len", "4",
                 "--speculative-config", json.dumps(spec), "--output-json", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["benchmark"] == "spec" and r["speculative_config"] == spec
    assert r["identical_greedy_outputs"] is True and len(r["on"]["single_output"]) == 8
    assert len(r["off"]["decode_tokens_per_s_iters"]) == 2 and r["decode_speedup"] > 0
    assert r["on"]["acceptance"]["num_draft_tokens"] > 0 and r["on"]["acceptance"]["acceptance_rate"] > 0.9
    assert r["off"]["acceptance"]["num_draft_tokens"] == 0
    assert r["batch_size"] == 3 and r["on"]["batch_output_tokens_per_s"] > 0
    assert "decode speedup" in capsys.readouterr().out
