"""`pagedlm bench throughput --num-loras N --lora-rank R`: random adapters, requests spread over them."""

from __future__ import annotations

import json

from pagedlm.core.cli import main


def test_throughput_with_random_loras(tiny_llama, tmp_path, capsys):
    out = tmp_path / "r.json"
    assert main(["bench", "throughput", "--model", tiny_llama, "--device", "cpu", "--dtype", "float32",
                 "--workload", "fixed", "--num-prompts", "6", "--input-len", "8", "--output-len", "4",
                 "--num-loras", "3", "--lora-rank", "4", "--output-json", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["lora"] == {"num_loras": 3, "rank": 4} and r["num_requests"] == 6
    assert r["total_output_tokens"] == 24
    assert "3 adapters of rank 4" in capsys.readouterr().out
